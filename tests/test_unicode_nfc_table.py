"""native/src/unicode_nfc_table.h (the C tokenizer's NFC tables) against its generator,
tools/gen_unicode_nfc.py, and Python's unicodedata.

Under the Unicode version the table was written with, the checked-in file is byte for byte what the
generator writes. Under another version (another Python), every decomposition and combining class the table
has for a code point that version also assigns is unchanged (both are immutable once assigned, Unicode's
normalization stability policy). unicode_nfc.c itself is checked against unicodedata.normalize in
conformance_tests/test_nfc.py.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from pathlib import Path

import pytest
from repo_tools import assert_check_mode_round_trip, load_tool

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "native" / "src" / "unicode_nfc_table.h"
gen = load_tool("gen_unicode_nfc")


def header_version() -> str:
    m = re.search(r"\(Unicode ([0-9.]+)\)", HEADER.read_text(encoding="utf-8"))
    assert m, "the table names its Unicode version"
    return m.group(1)


def header_decompositions() -> dict[int, tuple[int, ...]]:
    """NFC_DECOMP of the checked-in header: code point -> its one-level canonical decomposition."""
    text = HEADER.read_text(encoding="utf-8")
    rows = re.findall(r"\{0x([0-9a-f]+), 0x([0-9a-f]+), 0x([0-9a-f]+)\}", text)
    (n,) = re.findall(r"#define NFC_N_DECOMP (\d+)", text)
    assert len(rows) == int(n)
    out = {int(c, 16): tuple(int(x, 16) for x in (a, b) if int(x, 16)) for c, a, b in rows}
    assert list(out) == sorted(out)
    return out


def header_classes() -> list[tuple[int, int, int]]:
    """NFC_PROPS of the checked-in header: (first code point, flags, combining class) runs."""
    text = HEADER.read_text(encoding="utf-8")
    runs = [
        (int(c, 16), int(f), int(k)) for c, f, k in re.findall(r"NFC_RUN\(0x([0-9a-f]+), (\d), (\d+)\)", text)
    ]
    (n,) = re.findall(r"#define NFC_N_PROPS (\d+)", text)
    assert len(runs) == int(n) and runs[0] == (0, 0, 0)
    return runs


def header_props(runs: list[tuple[int, int, int]], cp: int) -> tuple[int, int]:
    """(flags, combining class) of cp in the runs of header_classes()."""
    _, flags, ccc = runs[bisect.bisect_right(runs, (cp, 9, 999)) - 1]
    return flags, ccc


def test_header_is_what_the_generator_writes() -> None:
    if header_version() == unicodedata.unidata_version:
        assert HEADER.read_text(encoding="utf-8") == gen.render()
        return
    # another Unicode: what the table says of a code point this Python also assigns still holds
    now, runs = gen.decompositions(), header_classes()
    for cp, v in header_decompositions().items():
        if unicodedata.category(chr(cp)) != "Cn":
            assert now.get(cp) == v, hex(cp)
    for cp in range(0x110000):
        ccc = header_props(runs, cp)[1]
        if ccc and unicodedata.category(chr(cp)) != "Cn":
            assert unicodedata.combining(chr(cp)) == ccc, hex(cp)


def test_tables_hold_known_facts() -> None:
    decomp, runs = header_decompositions(), header_classes()
    assert decomp[0xE9] == (0x65, 0x301)  # é = e + acute
    assert decomp[0x212B] == (0xC5,)  # the Angstrom sign is a singleton: Å
    assert decomp[0x1E69] == (0x1E63, 0x307)  # one level: ṩ = ṣ + dot above (ṣ = s + dot below)
    assert 0xAC00 not in decomp  # Hangul is computed
    assert header_props(runs, 0x301) == (gen.NFC_MAYBE, 230)  # composes with what precedes it
    assert header_props(runs, 0x344) == (gen.NFC_NO, 230)  # two marks; never in NFC
    assert header_props(runs, 0x212B) == (gen.NFC_NO, 0)
    assert header_props(runs, 0x41) == header_props(runs, 0xE9) == header_props(runs, 0x4E2D) == (0, 0)
    assert header_props(runs, 0x1161) == header_props(runs, 0x11A8) == (gen.NFC_MAYBE, 0)  # Hangul V, T
    assert header_props(runs, 0x093C) == (gen.NFC_MAYBE, 7)  # the nukta composes with some letters...
    assert header_props(runs, 0x0958) == (gen.NFC_NO, 0)  # ...but QA is a composition exclusion


def test_generator_check_mode_sees_a_stale_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if header_version() != unicodedata.unidata_version:
        pytest.skip(
            f"the table is Unicode {header_version()}, this Python's is {unicodedata.unidata_version}"
        )
    stale = tmp_path / "unicode_nfc_table.h"
    stale.write_text(gen.render().replace("{0x000e9, 0x00065, 0x00301}", "{0x000e9, 0x00065, 0x00300}"))
    assert_check_mode_round_trip(gen, stale, HEADER, monkeypatch)
