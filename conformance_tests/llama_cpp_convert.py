"""Run llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist) on several checkpoints.

    python llama_cpp_convert.py LLAMA_CPP_DIR OUTTYPE CKPT OUT [CKPT OUT ...]

One process converts them all, so torch and the converter are imported once. Two shims, both about the
tiny checkpoints' tokenizer and nothing about the model tensors or hyper-parameters:
* the converter identifies a BPE pre-tokenizer by the hash of its output on a fixed text and refuses one it
  does not know; the tiny checkpoints' tokenizer is trained here (GPT-2 byte-level pre-tokenizer), so an
  unknown hash is mapped to "gpt-2";
* it reaches for the `sentencepiece` module before checking that a tokenizer.model exists; without that file
  the shim raises the FileNotFoundError the converter would raise with the module installed, so it falls back
  to the tokenizer.json path as usual.
Qwen3.5 checkpoints without a multi-token-prediction block are converted with the converter's own --no-mtp.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def _mtp_flag(ckpt: Path) -> list[str]:
    """The converter expects Qwen3.5's multi-token-prediction block unless told there is none (--no-mtp), as
    a user converting a checkpoint without one would tell it."""
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("model_type", "").startswith("qwen3_5") and not cfg.get("mtp_num_hidden_layers"):
        return ["--no-mtp"]
    return []


def main(argv: list[str]) -> int:
    root = Path(argv[0]).resolve()
    out_type = argv[1]
    pairs = list(zip(argv[2::2], argv[3::2], strict=True))
    sys.path.insert(0, str(root))
    sys.path.insert(1, str(root / "gguf-py"))  # the converter's own gguf-py, as its script arranges
    import conversion.base as base

    known_pre = base.TextModel.get_vocab_base_pre
    spm_vocab = base.TextModel._create_vocab_sentencepiece

    def pre_or_gpt2(self: object, tokenizer: object) -> str:
        try:
            return known_pre(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    def spm_or_missing(self: object) -> object:
        path = self.dir_model / "tokenizer.model"  # type: ignore[attr-defined]
        if not path.is_file():
            raise FileNotFoundError(f"File not found: {path}")
        return spm_vocab(self)

    base.TextModel.get_vocab_base_pre = pre_or_gpt2
    base.TextModel._create_vocab_sentencepiece = spm_or_missing
    script = str(root / "convert_hf_to_gguf.py")
    for ckpt, out in pairs:
        sys.argv = [script, ckpt, "--outfile", out, "--outtype", out_type, *_mtp_flag(Path(ckpt))]
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
