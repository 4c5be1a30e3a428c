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
    """Every name the Python tokenizer reads is one pretokenize.c lists (its --words refuses the others),
    "default" (llama.cpp's split, also for a GGUF without tokenizer.ggml.pre) included."""
    for pre in sorted(PRE_TOKENIZER_REGEXES):
        ct.c_pretokenize(pre, ["x"])
    with pytest.raises(AssertionError, match="is not known"):
        ct.c_pretokenize("no-such-pre", ["x"])


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_REGEXES))
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


def _apostrophe_texts() -> list[str]:
    """Every code point after an apostrophe, alone and in the two-letter contractions' places ('rX, 'Xe), in
    texts of 4096 cases each. Code points unassigned in Unicode 14.0 (Python 3.11's unicodedata, which
    unicode_class_table.h is generated from) are left out: Hugging Face tokenizers' Oniguruma knows later
    versions and classes some of them as numbers or letters, so the two splits differ on those (120 code
    points after an apostrophe, all of them Cn in 14.0; docs/conformance.md)."""
    import unicodedata

    cps = [chr(c) for c in range(0x80, 0x110000) if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    cases = [f"'{p}{c}{s}" for c in cps for p, s in (("", ""), ("r", ""), ("", "e"))]
    return ["\x01".join(cases[i : i + 4096]) for i in range(0, len(cases), 4096)]


def test_case_folded_contractions_over_every_code_point() -> None:
    """(?i:'s|'t|'re|'ve|'m|'ll|'d), as Oniguruma folds case, matches one non-ASCII character: U+017F (long
    s, folded to s), which pretokenize.c special-cases; the C and Python llama3 / gpt-4o splits agree after an
    apostrophe on every assigned code point."""
    from tokenizers import Regex, pre_tokenizers

    texts = _apostrophe_texts()
    contractions = pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"), behavior="isolated")
    matched = set()
    for t in texts:
        for word, _ in contractions.pre_tokenize_str(t):
            if word.startswith("'") and len(word) <= 3 and not word.isascii():  # a match, not a gap
                matched.add(word)
    assert matched == {"'ſ"}, sorted(matched)[:10]
    for pre in ("llama3", "gpt-4o"):
        py, c = ct.py_pretokenize(pre, texts), ct.c_pretokenize(pre, texts)
        bad = [k for k in range(len(texts)) if py[k] != c[k]]
        tm.report(
            f"{pre}: every code point after an apostrophe, {len(texts) - len(bad)} of {len(texts)} equal"
        )
        assert not bad
