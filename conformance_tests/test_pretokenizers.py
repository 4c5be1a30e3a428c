"""Colibri's two pre-tokenizers against each other and against Hugging Face tokenizers (issue 10).

The C one (`native/src/pretokenize.c`, through `colibri-tokenize --words`) and the Python one (the
Split regexes of PRE_TOKENIZER_REGEXES, run by Hugging Face tokenizers) must split every text into the same
words for every tokenizer.ggml.pre name, on the tokenizer corpus and random strings drawn from every
character class the regexes tell apart. Where Hugging Face tokenizers has the pre-tokenizer built in (GPT-2's
ByteLevel regex; Digits before it, as SmolLM's and StarCoder's tokenizer.json have it), that is the reference
for both. The names of real tokenizer.json files (DeepSeek, Qwen, GLM, MiniMax) are checked against those
files in test_real_tokenizers.py.
"""

from __future__ import annotations

import c_tokenizer as ct
import pytest
import tiny_models as tm
from test_tokenizer import corpus

from colibri_backend.adapters.tokenizer import PRE_TOKENIZER_REGEXES

# the one name only the Python tokenizer has: a GGUF with no tokenizer.ggml.pre. The C tokenizer splits
# such a file as gpt-2 does, with a warning; llama.cpp uses neither split (see docs/conformance.md)
PY_ONLY = {"default"}

# the names whose split Hugging Face tokenizers has built in: tokenizer.json's pre_tokenizer
GPT2_NAMES = {"gpt-2", "gpt2", "mpt", "olmo", "jais"}
DIGITS_GPT2_NAMES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}


def _texts() -> list[str]:
    return corpus() + ct.random_texts(2000, seed=23)


def _builtin_words(pre: str, texts: list[str]) -> list[list[str]] | None:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in GPT2_NAMES:
        return ct.hf_pretokenize(byte_level, texts)
    if pre in DIGITS_GPT2_NAMES:
        seq = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return ct.hf_pretokenize(seq, texts)
    return None


def test_c_knows_every_python_name() -> None:
    """Every name the Python tokenizer reads is one pretokenize.c lists (its --words refuses the others)."""
    for pre in sorted(set(PRE_TOKENIZER_REGEXES) - PY_ONLY):
        ct.c_pretokenize(pre, ["x"])
    with pytest.raises(AssertionError, match="is not known"):
        ct.c_pretokenize("default", ["x"])


@pytest.mark.parametrize("pre", sorted(set(PRE_TOKENIZER_REGEXES) - PY_ONLY))
def test_c_and_python_pretokenizers_agree(pre: str) -> None:
    texts = _texts()
    want = ct.py_pretokenize(pre, texts)
    got = {"C": ct.c_pretokenize(pre, texts)}
    builtin = _builtin_words(pre, texts)
    if builtin is not None:
        got["HF built-in"] = builtin
    bad = {
        name: [(t, w, g) for t, w, g in zip(texts, want, words, strict=True) if w != g]
        for name, words in got.items()
    }
    counts = ", ".join(f"{name} {len(texts) - len(b)} of {len(texts)}" for name, b in bad.items())
    tm.report(f"pre-tokenizer {pre!r}: words equal to the Python one's: {counts}")
    for name, b in bad.items():
        assert not b, f"{name}: {len(b)} differ from Python; first {b[0]!r}"
