"""The `llm` plugin, driven through the real `llm` command line (LLM_USER_PATH in a temporary directory).

Models come from a temporary colibri.toml ($COLIBRI_CONFIG) naming the conformance suite's tiny random
Mixtral checkpoint, converted to F32 GGUF: small and fast, with a chat template. Greedy output through `llm`
must be exactly what the engine's own chat() gives for the same messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llm")

CONFORMANCE = Path(__file__).resolve().parent.parent / "conformance_tests"
if str(CONFORMANCE) not in sys.path:
    sys.path.insert(0, str(CONFORMANCE))

import tiny_models  # noqa: E402

import colibri_backend  # noqa: E402
from colibri_backend.convert import convert  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("llm_plugin")
    tok = tiny_models.build_tokenizer(root / "tokenizer")
    ckpt = tiny_models.build_checkpoint(tiny_models.SPEC_BY_NAME["mixtral"], root / "mixtral", tok)
    gguf = convert(ckpt, root / "tiny-mixtral.f32.gguf", out_type="f32", progress=False)
    config = root / "colibri.toml"
    config.write_text(
        'model = "tiny"\n'
        "[models.tiny]\n"
        f'path = "{gguf}"\n'
        "threads = 2\n"
        "context_length = 512\n"
        "[models.tiny-budget]\n"
        f'path = "{gguf}"\n'
        'memory_budget = "1G"\n'
    )
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("COLIBRI_") and key != "COLIBRI_LIB":
            del env[key]
    env.update(
        {"COLIBRI_CONFIG": str(config), "LLM_USER_PATH": str(root / "llm-home"), "PYTHONIOENCODING": "utf-8"}
    )
    engine = colibri_backend.load(gguf, threads=2, context_length=512)
    yield {"gguf": gguf, "env": env, "engine": engine, "root": root}
    engine.close()


def run_llm(
    setup: dict, *args: str, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "llm", *args],
        capture_output=True,
        text=True,
        env=env or setup["env"],
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, f"llm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def logs(setup: dict, n: int) -> list[dict]:
    """The last n logged responses, oldest first."""
    out = run_llm(setup, "logs", "-n", str(n), "--json").stdout
    return json.loads(out)


def test_models_listed(setup: dict) -> None:
    listing = run_llm(setup, "colibri", "models").stdout
    assert "colibri/tiny (default, alias: colibri): backend=colibri" in listing
    assert "colibri/tiny-budget: backend=colibri" in listing and "memory_budget=1073741824" in listing
    assert str(setup["root"] / "colibri.toml") in listing
    models = run_llm(setup, "models").stdout
    assert "colibri/tiny" in models and "colibri/tiny-budget" in models


def test_prompt_matches_engine_and_records_usage(setup: dict) -> None:
    prompt = "def read_config(path):"
    out = run_llm(setup, "-m", "colibri/tiny", "-o", "max_tokens", "12", prompt).stdout
    expected = setup["engine"].chat([{"role": "user", "content": prompt}], max_tokens=12)
    assert out.rstrip("\n") == expected.rstrip("\n") and expected.strip()
    entry = logs(setup, 1)[0]
    assert entry["model"] == "colibri/tiny"
    n_in = len(setup["engine"].chat_prompt_ids([{"role": "user", "content": prompt}]))
    assert entry["input_tokens"] == n_in
    assert 1 <= entry["output_tokens"] <= 12


def test_conversation_continues_through_chat_template(setup: dict) -> None:
    first = "import json"
    second = "class Parser:"
    a = run_llm(setup, "-m", "colibri", "-o", "max_tokens", "10", first).stdout.rstrip("\n")
    b = run_llm(setup, "-c", "-o", "max_tokens", "10", second).stdout.rstrip("\n")
    engine = setup["engine"]
    reply1 = engine.chat([{"role": "user", "content": first}], max_tokens=10)
    messages = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": second},
    ]
    assert a == reply1.rstrip("\n")
    assert b == engine.chat(messages, max_tokens=10).rstrip("\n")
    earlier, latest = logs(setup, 2)  # llm lists the last n in chronological order
    assert latest["conversation_id"] == earlier["conversation_id"]
    assert latest["input_tokens"] == len(engine.chat_prompt_ids(messages)) > earlier["input_tokens"]


def test_sampling_options_and_seed(setup: dict) -> None:
    def sampled(seed: int) -> str:
        return run_llm(
            setup,
            "-m",
            "colibri/tiny",
            "-o",
            "temperature",
            "1.2",
            "-o",
            "top_p",
            "0.9",
            "-o",
            "seed",
            str(seed),
            "-o",
            "max_tokens",
            "16",
            "-n",
            "x = ",
        ).stdout

    one, two, other = sampled(7), sampled(7), sampled(8)
    assert one == two
    assert one != other  # a different seed samples differently (16 tokens of a random model)


def test_memory_budget_option_and_bad_options(setup: dict) -> None:
    ok = run_llm(setup, "-m", "colibri/tiny", "-o", "memory_budget", "800M", "-o", "max_tokens", "4", "hi")
    assert ok.stdout.strip() or ok.returncode == 0
    bad_budget = run_llm(setup, "-m", "colibri/tiny", "-o", "memory_budget", "lots", "hi", check=False)
    assert bad_budget.returncode != 0 and "memory_budget" in bad_budget.stderr
    bad_temp = run_llm(setup, "-m", "colibri/tiny", "-o", "temperature", "5", "hi", check=False)
    assert bad_temp.returncode != 0 and "temperature" in bad_temp.stderr


def test_streaming_through_python_api(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import llm

    for key, value in setup["env"].items():
        if key.startswith(("COLIBRI_", "LLM_")):
            monkeypatch.setenv(key, value)
    model = llm.get_model("colibri/tiny")
    response = model.prompt("for i in range(10):", max_tokens=12, stream=True)
    chunks = list(response)
    assert len(chunks) > 1
    expected = setup["engine"].chat([{"role": "user", "content": "for i in range(10):"}], max_tokens=12)
    assert "".join(chunks) == expected
    assert response.input_tokens and response.output_tokens and response.output_tokens <= 12


def test_broken_configuration_does_not_break_llm(setup: dict, tmp_path: Path) -> None:
    bad = tmp_path / "colibri.toml"
    bad.write_text("[models.x]\nthreads = 'many'\n")
    env = dict(setup["env"], COLIBRI_CONFIG=str(bad))
    proc = run_llm(setup, "models", env=env)
    assert "colibri/smollm2" in proc.stdout  # the default model is still offered
    assert "ignoring the Colibri configuration" in proc.stderr
