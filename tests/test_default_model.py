"""The bundled default model: Colibri's own trained MoE, shipped inside the package.

`colibri_backend.default_model_path()` points into the installed package, the file loads as a Mixtral-style
MoE, `colibri run` without --model completes Python code with it, and SmolLM2 stays available by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import colibri_backend
from colibri_backend import models

PROMPT = "def fibonacci(n):"
MAX_SHIPPED_BYTES = 30 * 1024 * 1024
PYTHON_MARKERS = ("return", "if ", "(", ":", "=")


def test_default_is_the_bundled_moe() -> None:
    path = colibri_backend.default_model_path()
    package_dir = Path(colibri_backend.__file__).resolve().parent
    assert path.is_file()
    assert path.resolve().parent == package_dir / "models", f"{path} is not inside the package {package_dir}"
    assert path.suffix == ".gguf"
    assert 1024 * 1024 < path.stat().st_size <= MAX_SHIPPED_BYTES
    assert models.DEFAULT_MODEL == "colibri-moe"
    # the short name, in any case, and the default path are the same file
    for name in ("colibri-moe", "Colibri-MoE"):
        assert models.resolve_model(name).gguf == path
    with colibri_backend.load(path, threads=2) as model:
        info = model.info
        assert (info.arch, info.n_expert, info.n_expert_used) == ("mixtral", 32, 4)
        assert info.n_vocab == model.tokenizer.vocab_size
        ids = model.tokenize(PROMPT, add_special_tokens=False)
        assert model.detokenize(ids) == PROMPT


def _colibri(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "colibri_backend.cli", *args],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )


def test_colibri_run_without_model_prints_code() -> None:
    res = _colibri("run", PROMPT, "--max-tokens", "24", "--threads", "2")
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    text = res.stdout.decode("utf-8")  # strict: the stream must be valid UTF-8
    assert text.strip(), "no output"
    assert any(m in text for m in PYTHON_MARKERS), f"does not look like Python: {text!r}"
    # code, not byte soup: printable ASCII and whitespace only
    assert all(c.isascii() and (c.isprintable() or c in "\n\t") for c in text), repr(text)
    assert "decode: 24 tokens" in res.stderr.decode() or "finish: stop" in res.stderr.decode()
    # greedy is deterministic: the same text as the Python API (run ends its output with a newline)
    with colibri_backend.load(colibri_backend.default_model_path(), threads=2) as model:
        assert model.generate(PROMPT, max_tokens=24) + "\n" == text


def test_trace_without_model_uses_default(tmp_path: Path) -> None:
    from colibri_backend.trace import file_sha256, load_trace

    out = tmp_path / "fib.npz"
    res = _colibri("trace", "--text", PROMPT, "-o", str(out), "--threads", "2")
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    trace = load_trace(out)
    assert trace.meta["model_sha256"] == file_sha256(colibri_backend.default_model_path())
    assert (trace.n_layer, trace.k) == (trace.meta["n_layer"], 4)
    with colibri_backend.load(colibri_backend.default_model_path(), threads=2) as model:
        assert trace.tokens.tolist() == model.tokenize(PROMPT, add_special_tokens=False)


def test_smollm2_still_resolves_by_name() -> None:
    assert "smollm2" in models.KNOWN_MODELS
    resolved = models.resolve_model("smollm2")
    assert resolved.name == "smollm2"
    assert resolved.gguf.name == models.KNOWN_MODELS["smollm2"].filename
    with colibri_backend.load("smollm2", threads=2, context_length=64) as model:
        assert model.info.arch == "llama" and model.info.n_expert == 0
        assert model.name == "smollm2"


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(FileNotFoundError) as err:
        models.resolve_model("no-such-model")
    assert "colibri-moe" in str(err.value) and "smollm2" in str(err.value)


def test_missing_bundled_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(models, "BUNDLED_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="bundled model 'colibri-moe' is missing"):
        models.default_model_path()
