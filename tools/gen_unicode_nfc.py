"""Writes native/src/unicode_nfc_table.h: the Unicode facts NFC needs (UAX #15), as compact sorted tables,
from Python's own Unicode database (`unicodedata`).

    python tools/gen_unicode_nfc.py            # rewrites the table
    python tools/gen_unicode_nfc.py --check    # exit 1 if the checked-in table differs

Three tables, all sorted by code point, read by binary search in unicode_nfc.c:
* NFC_PROPS, runs of (canonical combining class, quick-check flags): each entry
  (first code point << 10) | (flags << 8) | ccc, a run lasting until the next entry. Flag NFC_NO: the code
  point never survives NFC (unicodedata.normalize('NFC', c) != c: singletons, composition exclusions,
  non-starter decompositions); flag NFC_MAYBE: it can compose with what precedes it (the second code point
  of a composition pair, and the Hangul vowel and trailing jamo).
* NFC_DECOMP, the canonical decompositions one level deep (one or two code points; the C side recurses):
  {code point, first, second or 0}.
* NFC_COMPOSE, the primary composites: indices into NFC_DECOMP of the entries (c -> a b) where
  unicodedata.normalize('NFC', c) == c, ordered by (a, b), so one table serves both directions.
Hangul syllables are algorithmic (unicode_nfc.c) and in none of the tables.
"""

from __future__ import annotations

import functools
import sys
import unicodedata
from pathlib import Path

from generated_header import generator_main

OUT = Path(__file__).resolve().parents[1] / "native" / "src" / "unicode_nfc_table.h"

NFC_NO, NFC_MAYBE = 1, 2
NFC_MAX_GROWTH = 3  # unicode_nfc.h
S_BASE, S_COUNT = 0xAC00, 11172
HANGUL_V = range(0x1161, 0x1176)
HANGUL_T = range(0x11A8, 0x11C3)


def code_points() -> range:
    return range(0x110000)


def decompositions() -> dict[int, tuple[int, ...]]:
    """Canonical decompositions, one level (compatibility ones, tagged <...>, are not NFC's)."""
    out = {}
    for cp in code_points():
        d = unicodedata.decomposition(chr(cp))
        if d and not d.startswith("<"):
            out[cp] = tuple(int(x, 16) for x in d.split())
    return out


def compositions(decomp: dict[int, tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """(a, b, c) for every primary composite c = a + b, sorted by (a, b)."""
    pairs = [
        (v[0], v[1], c)
        for c, v in decomp.items()
        if len(v) == 2 and unicodedata.normalize("NFC", chr(c)) == chr(c)
    ]
    return sorted(pairs)


def flags_of(cp: int, decomp: dict[int, tuple[int, ...]], second: set[int]) -> int:
    # only a code point with a canonical decomposition can be changed by NFC on its own
    f = NFC_NO if cp in decomp and unicodedata.normalize("NFC", chr(cp)) != chr(cp) else 0
    if cp in second or cp in HANGUL_V or cp in HANGUL_T:
        f |= NFC_MAYBE
    return f


def prop_runs(decomp: dict[int, tuple[int, ...]], second: set[int]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for cp in code_points():
        key = (flags_of(cp, decomp, second), unicodedata.combining(chr(cp)))
        if not out or out[-1][1:] != key:
            out.append((cp, *key))
    return out


def check_assumptions(decomp: dict[int, tuple[int, ...]], pairs: list[tuple[int, int, int]]) -> None:
    """What unicode_nfc.c relies on, asserted against this Unicode version. Only code points with a canonical
    decomposition (the table's and the Hangul syllables) can be changed by NFD or NFC on their own."""
    second = {b for _, b, _ in pairs}
    hangul = range(S_BASE, S_BASE + S_COUNT)
    decomposing = {*decomp, *hangul}
    assert all(unicodedata.normalize("NFD", chr(c)) == chr(c) for c in code_points() if c not in decomposing)
    # the fast path: below U+0300 nothing decomposes into, reorders or composes with what follows
    assert all(unicodedata.combining(chr(c)) == 0 and flags_of(c, decomp, second) == 0 for c in range(0x300))
    # one or two code points per level; NFC never grows UTF-8 by more than 3x, nor NFD past 3 code points
    # per 2 bytes (the buffer sizes of unicode_nfc.c)
    assert all(1 <= len(v) <= 2 for v in decomp.values())
    for c in decomposing:
        n = len(chr(c).encode())
        assert 2 * len(unicodedata.normalize("NFD", chr(c))) <= 3 * n
        assert len(unicodedata.normalize("NFC", chr(c)).encode()) <= NFC_MAX_GROWTH * n
    # composites are starters made of a starter and something else; Hangul is left to the algorithm
    for a, _, c in pairs:
        assert unicodedata.combining(chr(a)) == 0 and unicodedata.combining(chr(c)) == 0
    assert not any(c in hangul for c in decomp)
    # a safe code point (class 0, no flag) decomposes into one of class 0 that composes with nothing before
    # it, followed by others: unicode_nfc.c cuts the text into chunks at safe code points
    for c in decomposing:
        if unicodedata.combining(chr(c)) == 0 and flags_of(c, decomp, second) == 0:
            first = ord(unicodedata.normalize("NFD", chr(c))[0])
            assert unicodedata.combining(chr(first)) == 0 and not flags_of(first, decomp, second) & NFC_MAYBE
    assert len(decomp) < 0x10000  # NFC_COMPOSE holds uint16_t indices


@functools.cache
def render() -> str:
    decomp = decompositions()
    pairs = compositions(decomp)
    check_assumptions(decomp, pairs)
    order = sorted(decomp)
    index = {cp: k for k, cp in enumerate(order)}
    runs = prop_runs(decomp, {b for _, b, _ in pairs})
    lines = [
        "/* unicode_nfc_table.h — generated by tools/gen_unicode_nfc.py from Python's unicodedata",
        f" * (Unicode {unicodedata.unidata_version}); do not edit. Included by unicode_nfc.c only; the",
        " * generator's docstring describes the three tables. */",
        "#define NFC_NO 1u",
        "#define NFC_MAYBE 2u",
        "#define NFC_RUN(first, flags, ccc) ((uint32_t)(first) << 10 | (flags) << 8 | (ccc))",
        f"#define NFC_N_PROPS {len(runs)}",
        "static const uint32_t NFC_PROPS[NFC_N_PROPS] = {",
    ]
    for k in range(0, len(runs), 5):
        row = runs[k : k + 5]
        lines.append("    " + " ".join(f"NFC_RUN(0x{cp:05x}, {f}, {ccc})," for cp, f, ccc in row))
    lines += [
        "};",
        f"#define NFC_N_DECOMP {len(order)}",
        "static const uint32_t NFC_DECOMP[NFC_N_DECOMP][3] = {",
    ]
    for k in range(0, len(order), 4):
        row = order[k : k + 4]
        cells = []
        for cp in row:
            v = decomp[cp]
            cells.append(f"{{0x{cp:05x}, 0x{v[0]:05x}, 0x{v[1] if len(v) > 1 else 0:05x}}},")
        lines.append("    " + " ".join(cells))
    lines += [
        "};",
        f"#define NFC_N_COMPOSE {len(pairs)}",
        "static const uint16_t NFC_COMPOSE[NFC_N_COMPOSE] = {",
    ]
    for k in range(0, len(pairs), 12):
        lines.append("    " + " ".join(f"{index[c]}," for _, _, c in pairs[k : k + 12]))
    lines.append("};")
    return "\n".join(lines) + "\n"


def main() -> int:
    return generator_main(OUT, render, __doc__.splitlines()[0], f"Unicode {unicodedata.unidata_version}")


if __name__ == "__main__":
    sys.exit(main())
