"""NFC in the C tokenizer (issue 10): native/src/unicode_nfc.c, through `colibri-tokenize --nfc`, against
Python's unicodedata.normalize("NFC"), and the tokenizer.ggml.pre names it is applied for against the Python
tokenizer's (_NFC_PRES).

unicode_nfc.c is held to unicodedata on every code point, on random strings of combining marks (in and out
of canonical order, in runs long enough for its counting sort and its heap buffer), Hangul jamo and
syllables, singletons, composition exclusions and precomposed letters, on the non-NFC strings of
test_real_tokenizers, and on text with bytes that are not UTF-8 (kept as they are). Its quick check may say
"not certain" of text in NFC, never "NFC" of text that is not. The tables are Unicode 14.0 (Python 3.11's
unicodedata, tools/gen_unicode_nfc.py); under another Python the single code points compared are those
Unicode 3.2 assigns, whose normalization no later version changes.
"""

from __future__ import annotations

import random
import re
import unicodedata
from pathlib import Path

import c_tokenizer as ct
import tiny_models as tm
from test_real_tokenizers import NON_NFC_TEXTS, _write_vocab_gguf

from colibri_backend.adapters.tokenizer import _NFC_PRES, PRE_TOKENIZER_REGEXES, Tokenizer

TABLE = ct.REPO / "native" / "src" / "unicode_nfc_table.h"

# combining marks of several classes (Latin, Greek, Hebrew, Arabic, Devanagari, Tibetan, musical symbols),
# conjoining jamo (L, V, T) and syllables (LV, LVT), singletons (Angstrom, Kelvin, Ohm, a CJK compatibility
# ideograph), composition exclusions (Devanagari QA, Tibetan vowels, a Hebrew presentation form), characters
# that compose (e, A, U with diaeresis, alpha, omega, Oriya and Sinhala vowels) and precomposed ones
POOL = (
    [chr(c) for c in range(0x300, 0x350)]
    + list("\u0591\u05b0\u05bc\u05c1\u064b\u0651\u0654\u0655\u093c\u094d\u0f71\u0f72\u0f74\u0f80\u0345")
    + [chr(c) for c in (0x1D15E, 0x1D165, 0x1D16E, 0x1D1BB)]
    + [chr(c) for c in range(0x1100, 0x1113)]
    + [chr(c) for c in range(0x1161, 0x1176)]
    + [chr(c) for c in range(0x11A7, 0x11C3)]
    + list("\uac00\uac01\ub098\ud7a3\u212b\u212a\u2126\uf900\u0958\u0f73\u0f77\ufb2c\u0344\u0340\u0374")
    + list("eEaAoOuUsS \u00dc\u03b1\u03c9\u0391\u0b47\u0b3e\u0b57\u0dd9\u0dcf\u0dca\u0627\u0928\u0915")
    + list("\u00e9\u00c5\u1e63\u1e69\u01d5\u1f00\u1f80\u0929\u0b4b\u0ddd\u4e2d")
)


def table_version() -> str:
    m = re.search(r"\(Unicode ([0-9.]+)\)", TABLE.read_text(encoding="utf-8"))
    assert m, "the table names its Unicode version"
    return m.group(1)


def random_texts(n: int, seed: int) -> list[str]:
    """n strings from POOL: most of 1 to 40 characters, one in 50 a long run of marks (up to 300)."""
    rng = random.Random(seed)
    marks = [c for c in POOL if unicodedata.combining(c)]
    out = []
    for k in range(n):
        if k % 50 == 0:
            out.append(
                rng.choice("eaA\u1100") + "".join(rng.choice(marks) for _ in range(rng.randint(17, 300)))
            )
        else:
            out.append("".join(rng.choice(POOL) for _ in range(rng.randint(1, 40))))
    return out


def _check(texts: list[str]) -> list[bool]:
    """C's NFC of each text == unicodedata's; its quick check never calls a text NFC that is not. Returns
    the quick check's answers."""
    got = ct.c_nfc([t.encode() for t in texts])
    bad = [
        (t, out)
        for t, (_, out) in zip(texts, got, strict=True)
        if out != unicodedata.normalize("NFC", t).encode()
    ]
    assert not bad, f"{len(bad)} of {len(texts)} differ; first {bad[0]!r}"
    wrong_yes = [
        t for t, (q, _) in zip(texts, got, strict=True) if q and not unicodedata.is_normalized("NFC", t)
    ]
    assert not wrong_yes, wrong_yes[:5]
    return [q for q, _ in got]


def test_every_code_point() -> None:
    same = table_version() == unicodedata.unidata_version
    cps = [
        c
        for c in range(0x110000)
        if not 0xD800 <= c <= 0xDFFF and (same or unicodedata.ucd_3_2_0.category(chr(c)) != "Cn")
    ]
    texts = [chr(c) for c in cps]
    quick = _check(texts)
    changed = sum(unicodedata.normalize("NFC", t) != t for t in texts)
    tm.report(
        f"C NFC == unicodedata on {len(texts)} code points "
        f"({changed} changed, {quick.count(False)} not certain)"
    )
    assert changed > 1000 or not same  # singletons, exclusions, non-starter decompositions
    # one code point is uncertain exactly when NFC removes it or it may compose with what precedes it
    assert (
        quick[cps.index(0x301)] is False
        and quick[cps.index(0xE9)] is True
        and quick[cps.index(0x212B)] is False
    )


def test_random_strings() -> None:
    texts = random_texts(20000, seed=15)
    quick = _check(texts)
    changed = sum(unicodedata.normalize("NFC", t) != t for t in texts)
    tm.report(
        f"C NFC == unicodedata on {len(texts)} random strings "
        f"({changed} changed, {quick.count(True)} certain)"
    )
    assert changed > len(texts) // 2 and any(len(t.encode()) > 400 for t in texts)


def test_non_nfc_conformance_strings() -> None:
    quick = _check(NON_NFC_TEXTS)
    assert not any(quick)
    # already in NFC, and from the shared corpus: unchanged, most of them certain
    composed = [unicodedata.normalize("NFC", t) for t in NON_NFC_TEXTS]
    assert [out for _, out in ct.c_nfc([t.encode() for t in composed])] == [t.encode() for t in composed]


def test_bytes_that_are_not_utf8_are_kept() -> None:
    """Each byte that is not UTF-8 (a stray continuation byte, 0xff, an overlong form, a surrogate's bytes, a
    truncated sequence) is copied and blocks composition, as U+FFFD would: the text between is normalized on
    its own."""
    rng = random.Random(16)
    invalid = [
        b"\xff",
        b"\xfe",
        b"\xc0",
        b"\x80",
        b"\xbf",
        b"\xed\xa0\x80",
        b"\xc0\xaf",
        b"\xe2\x96",
        b"\xf0\x9f",
    ]
    texts, want = [], []
    for _ in range(3000):
        pieces = [
            "".join(rng.choice(POOL) for _ in range(rng.randint(0, 8))) for _ in range(rng.randint(1, 4))
        ]
        raw, nfc = pieces[0].encode(), unicodedata.normalize("NFC", pieces[0]).encode()
        for p in pieces[1:]:
            bad = rng.choice(invalid)
            raw += bad + p.encode()
            nfc += bad + unicodedata.normalize("NFC", p).encode()
        texts.append(raw)
        want.append(nfc)
    got = ct.c_nfc(texts)
    assert [out for _, out in got] == want
    assert [out for _, out in ct.c_nfc([b"e\xcc", b"\xcc\x81", b"e\x80\xcc\x81"])] == [
        b"e\xcc",
        b"\xcc\x81",
        b"e\x80\xcc\x81",
    ]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte alphabet, the character each byte stands for: printable bytes themselves, the others
    U+0100 + n in increasing order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, n = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def test_c_normalizes_for_the_python_tokenizers_names(tmp_path: Path) -> None:
    """For every tokenizer.ggml.pre name of the Python tokenizer, the C tokenizer (a byte-level vocabulary of
    the 256 bytes, no merges) gives non-NFC text the ids of its NFC form exactly when the Python tokenizer
    does: when the name is in _NFC_PRES. A special token is cut out first and not normalized. The second
    text triples in length under NFC (U+1D160 is three code points of four bytes each)."""
    texts = ["Cafe\u0301 \u1100\u1161 \u212b<|x|>\u0301", "\U0001d160" * 300 + "\u0301 x"]
    composed = [unicodedata.normalize("NFC", t) for t in texts]
    assert len(composed[1].encode()) > 2.9 * len(texts[1].encode())
    tokens = [*_byte_alphabet(), "<|x|>", "ZZ"]  # a merge the texts never use: GGUFWriter drops an empty list
    by_name = {}
    for pre in sorted(PRE_TOKENIZER_REGEXES):
        meta = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 256 + [3, 1],
            "tokenizer.ggml.merges": ["Z Z"],
        }
        path = tmp_path / f"{pre}.gguf"
        _write_vocab_gguf(meta, path)
        rc, out, err = ct.c_run(path, texts + composed)
        assert rc == 0, err
        c_ids = [ids for ids, _ in out]
        py = Tokenizer.from_gguf_metadata(meta, source=pre)
        py_ids = [py.encode(t, add_special_tokens=False) for t in texts + composed]
        by_name[pre] = c_ids[:2] == c_ids[2:]
        assert by_name[pre] or all(a != b for a, b in zip(c_ids[:2], c_ids[2:], strict=True)), pre
        assert (py_ids[:2] == py_ids[2:]) == by_name[pre], pre
        assert "is not known" not in err, pre
        assert c_ids == py_ids, pre
        assert c_ids[0][-3:] == [256, 0xCC, 0x81]  # the special token, then U+0301 alone: its two bytes
    assert {p for p, normalized in by_name.items() if normalized} == set(_NFC_PRES)
