"""Colibri's C tokenizer (native/src/tokenizer.c, pretokenize.c) from the conformance tests, through the
colibri-tokenize tool of this checkout's build/dev, and the random strings its pre-tokenizers are checked on.
"""

from __future__ import annotations

import functools
import random
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def c_tool() -> Path:
    """colibri-tokenize of this checkout's build/dev, brought up to date with the sources once per test run
    (a tool left by an older checkout would test old code)."""
    exe = REPO / "build" / "dev" / "colibri-tokenize"
    if not (exe.parent / "CMakeCache.txt").is_file():
        subprocess.run(
            ["cmake", "-S", str(REPO / "native"), "-B", str(exe.parent), "-DCMAKE_BUILD_TYPE=Release"],
            check=True,
            capture_output=True,
        )
    subprocess.run(
        ["cmake", "--build", str(exe.parent), "-j2", "--target", "colibri-tokenize"],
        check=True,
        capture_output=True,
    )
    return exe


def _records(texts: list[str]) -> bytes:
    return b"".join(b"%d\n%s" % (len(t.encode()), t.encode()) for t in texts)


def c_run(vocab: Path, texts: list[str]) -> tuple[int, list[tuple[list[int], str]], str]:
    """colibri-tokenize's exit status, ids and decoded text for each text (special tokens parsed, no BOS),
    and its stderr."""
    r = subprocess.run([str(c_tool()), str(vocab)], input=_records(texts), capture_output=True, check=False)
    lines = r.stdout.decode().split("\n")
    out = [
        ([int(x) for x in lines[2 * k].split()], bytes.fromhex(lines[2 * k + 1]).decode("utf-8", "replace"))
        for k in range(len(texts))
        if r.returncode == 0
    ]
    return r.returncode, out, r.stderr.decode(errors="replace")


def c_tokenize(vocab: Path, texts: list[str]) -> list[tuple[list[int], str]]:
    """colibri-tokenize's ids and decoded text for each text; its pre-tokenizer must know the file's
    tokenizer.ggml.pre (a name it does not know is split as gpt2 splits it, with a warning)."""
    rc, out, err = c_run(vocab, texts)
    assert rc == 0, err
    assert "is not known" not in err, err
    return out


def c_ids(vocab: Path, texts: list[str]) -> list[list[int]]:
    return [ids for ids, _ in c_tokenize(vocab, texts)]


def c_pretokenize(pre: str, texts: list[str]) -> list[list[str]]:
    """The words of `colibri-tokenize --words PRE` (native/src/pretokenize.c) for each text."""
    r = subprocess.run(
        [str(c_tool()), "--words", pre], input=_records(texts), capture_output=True, check=False
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    lines = r.stdout.decode().split("\n")[: len(texts)]
    return [
        [bytes.fromhex(w).decode("utf-8", "replace") for w in ln.split(" ")] if ln else [] for ln in lines
    ]


def c_nfc(texts: list[bytes]) -> list[tuple[bool, bytes]]:
    """`colibri-tokenize --nfc` (native/src/unicode_nfc.c) on each byte string: whether nfc_quick_check calls
    it NFC for certain, and nfc_normalize's output."""
    r = subprocess.run(
        [str(c_tool()), "--nfc"],
        input=b"".join(b"%d\n%s" % (len(t), t) for t in texts),
        capture_output=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    lines = r.stdout.decode().split("\n")
    assert len(lines) == len(texts) + 1 and lines[-1] == ""
    return [(ln[0] == "1", bytes.fromhex(ln[2:])) for ln in lines[:-1]]


def hf_pretokenize(pre_tokenizer: Any, texts: list[str]) -> list[list[str]]:
    """The words a Hugging Face pre-tokenizer splits each text into, as substrings of the text."""
    return [[t[a:b] for _, (a, b) in pre_tokenizer.pre_tokenize_str(t)] for t in texts]


def py_pretokenize(pre: str, texts: list[str]) -> list[list[str]]:
    """The words of the Python tokenizer's pre-tokenizer for the tokenizer.ggml.pre name `pre` (the one
    Tokenizer.from_gguf_metadata builds for a byte-level BPE vocabulary)."""
    from colibri_backend.adapters.tokenizer import _pre_tokenizer

    return hf_pretokenize(_pre_tokenizer(pre), texts)


# Characters of every class the pre-tokenizer regexes tell apart: ASCII of each kind, contractions and the
# long s (which (?i:'s) also matches), Latin / Greek / Cyrillic letters of both cases, titlecase and modifier
# letters, CJK, kana, Hangul, combining marks, Devanagari, Arabic and its digits, fullwidth forms, other
# numbers (superscripts, fractions, Roman numerals), White_Space beyond ASCII, controls, format characters,
# emoji, private use, an unassigned code point, symbols and punctuation beyond ASCII.
RANDOM_POOL = list(
    "aAbBzZeEsStTlLdDmMrRvV0123456789    '''\t\n\r\n!?.,;:-_/\\\"#$%&()*+<=>@[]^`{|}~"
    "ſéÉßµçÑαΑωΩπжЖяЯ中文字日本ひらがなカタカナ한국어가힣\u0301\u0308\u0951कमि्ाअ٠١٢عربي"
    "ＡＺａｚ！？０９、。「」　\u00a0\u2028\u3000\u0085\x00\x1c\x7f²½Ⅻⅷǅǈʻʼ😀🚀\u200d\ufe0f\ue000"
    "€©™𝐁𝔘\u0378—…“”‘’·ǂƻ\u02b0ᵃ"
)


def random_texts(n: int, seed: int) -> list[str]:
    """n strings of 1 to 48 characters drawn from RANDOM_POOL."""
    rng = random.Random(seed)
    return ["".join(rng.choice(RANDOM_POOL) for _ in range(rng.randint(1, 48))) for _ in range(n)]


def c_add_bos(vocab: Path) -> bool:
    """Whether the C runner puts BOS before a prompt (colibri-tokenize --add-bos)."""
    r = subprocess.run([str(c_tool()), "--add-bos", str(vocab)], capture_output=True, check=False)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout.strip() == b"1"


def c_end_of_generation(vocab: Path) -> set[int]:
    """The ids at which the C runner stops generating (colibri-tokenize --eog)."""
    r = subprocess.run([str(c_tool()), "--eog", str(vocab)], capture_output=True, check=False)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return {int(x) for x in r.stdout.split()}
