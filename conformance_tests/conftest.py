"""Shared fixtures of the conformance suite.

* `tiny_zoo`: the tiny random checkpoints of tiny_models.SPECS, built once per session in a temporary
  directory, and their GGUF conversions (any of f32 / f16 / q8_0 / q4_0), made on first request.
  `tiny_zoo.gguf(name, "f32", converter="llama.cpp")` is the same checkpoint converted by llama.cpp's own
  convert_hf_to_gguf.py (tiny_models.llama_cpp_source: the llama-cpp-python sdist), all specs at once.
* `smollm2_gguf`: SmolLM2-135M-Instruct Q4_1 (resolved as the product does, or the development copy).
* tiny_models.reference_engine(name) (used by the tests): imports a reference engine (transformers +
  torch, or llama_cpp). Where it is missing, tests fall back to the recorded outputs in
  conformance_tests/reference/; under CI=true a missing engine is a failure, so the live comparison can
  never be silently skipped there.
* tiny_models.english_text(): real English prose available offline (this Python installation's
  LICENSE.txt), read at test time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import tiny_models  # noqa: E402


class TinyZoo:
    """Tiny checkpoints and their GGUF conversions, built lazily and cached for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tokenizer: Path | None = None
        self._gemma4_tokenizer: Path | None = None
        self._ckpts: dict[str, Path] = {}
        self._ggufs: dict[tuple[str, str, str], Path] = {}

    def tokenizer_dir(self) -> Path:
        if self._tokenizer is None:
            self._tokenizer = tiny_models.build_tokenizer(self.root / "tokenizer")
        return self._tokenizer

    def gemma4_tokenizer_dir(self) -> Path:
        if self._gemma4_tokenizer is None:
            self._gemma4_tokenizer = tiny_models.build_gemma4_tokenizer(self.root / "gemma4_tokenizer")
        return self._gemma4_tokenizer

    def checkpoint(self, name: str) -> Path:
        if name not in self._ckpts:
            spec = tiny_models.SPEC_BY_NAME[name]
            gemma = spec.extra.get("tokenizer") == "gemma4"
            tok = self.gemma4_tokenizer_dir() if gemma else self.tokenizer_dir()
            self._ckpts[name] = tiny_models.build_checkpoint(spec, self.root / name, tok)
        return self._ckpts[name]

    def gguf(self, name: str, out_type: str = "f32", converter: str = "colibri") -> Path:
        key = (name, out_type, converter)
        if converter == "llama.cpp" and key not in self._ggufs:
            # one converter process for every spec: it imports torch, which costs more than converting
            names = [s.name for s in tiny_models.SPECS if tiny_models.llama_cpp_converts(s)]
            pairs = [(self.checkpoint(n), self.root / f"{n}.{out_type}.llama-cpp.gguf") for n in names]
            tiny_models.llama_cpp_convert(pairs, out_type)
            for n, (_, out) in zip(names, pairs, strict=True):
                self._ggufs[(n, out_type, converter)] = out
        if key not in self._ggufs:
            from colibri_backend.convert import convert

            self._ggufs[key] = convert(
                self.checkpoint(name),
                self.root / f"{name}.{out_type}.gguf",
                out_type=out_type,
                progress=False,
            )
        return self._ggufs[key]


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory) -> TinyZoo:
    return TinyZoo(tmp_path_factory.mktemp("tiny_zoo"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return tiny_models.resolve_smollm2()


@pytest.fixture(scope="session")
def colibri() -> Any:
    """The colibri_backend package, with the native engine loadable (a failure, not a skip, if it is not)."""
    import colibri_backend

    if not hasattr(colibri_backend, "load"):
        pytest.fail("colibri_backend.load is missing: the engine API is not available", pytrace=False)
    return colibri_backend
