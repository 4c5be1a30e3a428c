"""The `colibri` CLI: inspect, run and chat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from smollm2 import smollm2_path

from colibri_backend.cli import main


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri_backend.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        assert sep, f"not a key: value line: {line!r}"
        out[key] = value
    return out


def test_inspect_plain(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(smollm2_path())]) == 0
    f = _fields(capsys.readouterr().out)
    assert f["architecture"] == "llama"
    assert f["dim.block_count"] == "30" and f["dim.embedding_length"] == "576"
    assert f["dim.attention.head_count_kv"] == "3"
    assert f["tensors"] == "272" and f["parameters"].startswith("134515008 ")
    assert f["tied_output"] == "yes"
    assert f["type.Q4_1"].startswith("210 tensors")
    cats = {k: int(v.split()[0]) for k, v in f.items() if k.startswith("bytes.")}
    assert set(cats) >= {
        "bytes.attention",
        "bytes.experts",
        "bytes.shared_experts",
        "bytes.dense_ffn",
        "bytes.norms",
        "bytes.router",
        "bytes.embeddings",
        "bytes.output",
    }
    assert sum(cats.values()) == int(f["tensor_bytes"].split()[0])
    assert cats["bytes.experts"] == 0 and cats["bytes.dense_ffn"] > 0


def test_inspect_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(smollm2_path())]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["architecture"] == "llama" and r["n_tensors"] == 272
    assert r["tensor_types"]["Q8_0"]["tensors"] == 1
    assert sum(r["bytes_by_category"].values()) == r["tensor_bytes"]


def test_inspect_categories() -> None:
    from colibri_backend.commands.inspect import categorize

    assert categorize("blk.3.ffn_gate_exps.weight") == "experts"
    assert categorize("blk.3.ffn_down_shexp.weight") == "shared_experts"
    assert categorize("blk.3.ffn_gate_inp_shexp.weight") == "shared_experts"
    assert categorize("blk.3.ffn_gate_inp.weight") == "router"
    assert categorize("blk.3.ffn_up.weight") == "dense_ffn"
    assert categorize("blk.3.attn_q.bias") == "attention"
    assert categorize("blk.3.attn_k_norm.weight") == "norms"
    assert categorize("output_norm.weight") == "norms"
    assert categorize("output.weight") == "output"
    assert categorize("token_embd.weight") == "embeddings"


def test_inspect_errors_are_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """inspect and run give the same one-line errors (the engine's parser checks the file for both)."""
    import colibri_backend

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"hello")
    whole = colibri_backend.default_model_path().read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[:100_000])  # cut inside the vocabulary
    (tmp_path / "empty_dir").mkdir()
    for target in (bad, truncated, tmp_path / "missing.gguf", tmp_path / "empty_dir"):
        assert main(["inspect", str(target)]) == 1
        inspect_err = capsys.readouterr().err.removeprefix("colibri inspect: ")
        assert main(["run", "--model", str(target), "-n", "1", "hi"]) == 1
        run_err = capsys.readouterr().err.removeprefix("colibri run: ")
        assert (
            inspect_err == run_err
            and inspect_err.startswith("error: ")
            and len(inspect_err.splitlines()) == 1
        )
        assert "numpy" not in inspect_err and "larger dtype" not in inspect_err
    assert main(["inspect", str(truncated)]) == 1
    assert "past end of file" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "empty_dir")]) == 1
    assert "is a directory but neither" in capsys.readouterr().err


def test_run_streams_text_and_reports_speed() -> None:
    r = _cli(
        "run",
        "--model",
        str(smollm2_path()),
        "--max-tokens",
        "6",
        "--threads",
        "2",
        "The capital of France is",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris")
    assert "tok/s" in r.stderr and "time to first token" in r.stderr and "prompt: " in r.stderr


def test_run_chat_and_sampling_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "run",
        "--model",
        str(smollm2_path()),
        "-n",
        "8",
        "--threads",
        "2",
        "--chat",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "3",
        "Say hello.",
    ]
    assert main(args) == 0
    first = capsys.readouterr()
    assert main(args) == 0
    second = capsys.readouterr()
    assert first.out == second.out and first.out.strip()
    assert "decode:" in first.err


def test_run_errors(tmp_path: Path) -> None:
    r = _cli("run", "--model", str(tmp_path / "nope.gguf"), "hi")
    assert r.returncode == 1 and "error" in r.stderr and "Traceback" not in r.stderr
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 100)
    r = _cli("run", "--model", str(junk), "hi")
    assert r.returncode == 1 and "COLIBRI_E_FORMAT" in r.stderr and "Traceback" not in r.stderr


def test_chat_repl_from_stdin() -> None:
    r = _cli(
        "chat",
        "--model",
        str(smollm2_path()),
        "-n",
        "8",
        "--threads",
        "2",
        stdin="Hello!\n/reset\nWhat is 2+2?\n/exit\n",
    )
    assert r.returncode == 0, r.stderr
    replies = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(replies) >= 2
    assert "conversation cleared" in r.stderr


def test_run_stats_flag() -> None:
    r = _cli("run", "--model", str(smollm2_path()), "-n", "3", "--threads", "2", "--stats", "-q", "Hello")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("stats.")]
    stats = dict(line.split(": ", 1) for line in lines)
    assert stats["stats.last.generated_tokens"] == "3"
    assert stats["stats.allocs_last_eval"] == "0"
    assert "tok/s" not in r.stderr  # -q drops the speed line


def test_chat_defaults_to_the_instruction_tuned_model() -> None:
    from colibri_backend.cli import build_parser

    assert build_parser().parse_args(["chat"]).model == "smollm2"
    assert build_parser().parse_args(["run", "x"]).model is None  # run: the bundled default model


# ---- what a new user hits first ------------------------------------------------------------------


def test_python_dash_m_runs_the_cli() -> None:
    r = subprocess.run([sys.executable, "-m", "colibri_backend", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: colibri" in r.stdout and "serve" in r.stdout
    r = subprocess.run([sys.executable, "-m", "colibri_backend"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage: colibri" in r.stderr  # no command: argparse's usage error


def test_run_max_tokens_zero_prefills_and_prints_no_nan() -> None:
    r = _cli("run", "--model", str(smollm2_path()), "-n", "0", "--threads", "2", "Hello")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "\n" and "nan" not in r.stderr.lower()
    assert "decode: 0 tokens" in r.stderr and "time to first token: none" in r.stderr
    r = _cli("run", "--model", str(smollm2_path()), "-n", "-1", "Hello")
    assert r.returncode == 1 and "max_tokens must be a whole number >= 0" in r.stderr


def test_serve_stops_at_start_when_its_model_cannot_load(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    serve = _cli("serve", "--model", str(missing), "--port", "0")
    run = _cli("run", "--model", str(missing), "hi")
    assert serve.returncode == run.returncode == 1
    assert "serving" not in serve.stderr  # it never announced a port
    assert serve.stderr.removeprefix("colibri serve: ") == run.stderr.removeprefix("colibri run: ")
    truncated = tmp_path / "truncated.gguf"
    import colibri_backend

    truncated.write_bytes(colibri_backend.default_model_path().read_bytes()[:100_000])
    serve = _cli("serve", "--model", str(truncated), "--port", "0")
    assert (
        serve.returncode == 1 and "past end of file" in serve.stderr and len(serve.stderr.splitlines()) == 1
    )


def test_chat_sends_reasoning_to_stderr_and_keeps_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    """`colibri chat` on a model that thinks: the <think> block goes to stderr, the answer to stdout, and
    only the answer is returned for the conversation's next turn."""
    from colibri_backend.cli import build_parser
    from colibri_backend.commands.run import stream_to_stdout
    from colibri_backend.generation import GenerationEvent
    from colibri_backend.server.tool_calls import output_parser_for

    pieces = ["<think>", "add ", "them", "</think>", "2+2", " is 4"]

    class Thinking:
        chat_template = "{% for m in messages %}<think></think>{{ m.content }}{% endfor %}"
        tokenizer = None

        def generate_tokens(self, ids: list[int], **_: object):  # noqa: ANN202
            for i, text in enumerate(pieces):
                yield GenerationEvent(i, text, finish_reason="stop" if i == len(pieces) - 1 else None)

        def stats(self) -> dict:
            return {"last": {"prompt_tokens": 3, "cached_prompt_tokens": 0, "prefill_seconds": 0.0}}

    args = build_parser().parse_args(["chat", "-n", "8"])
    model = Thinking()
    fig, reply = stream_to_stdout(model, [1, 2, 3], args, output_parser_for(model, tools=False))
    out = capsys.readouterr()
    assert reply == "2+2 is 4"
    assert out.out == "2+2 is 4"
    assert "add them" in out.err and "<think>" not in out.out
    assert fig["generated"] == len(pieces) and fig["finish"] == "stop"
