"""native/src/unicode_class_table.h (the pre-tokenizers' Unicode classes) against its generator,
tools/gen_unicode_class.py, and Python's unicodedata.

Under the Unicode version the table was written with, the checked-in file is byte for byte what the
generator writes. Under another version (a newer Python), every code point the table classes as something
other than OTHER still has that class: a newer Unicode only assigns code points the older one left unassigned
(OTHER here), which the table then lags behind on.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from types import ModuleType

from repo_tools import load_tool

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "native" / "src" / "unicode_class_table.h"


def _generator() -> ModuleType:
    return load_tool("gen_unicode_class")


def _table() -> tuple[str, list[tuple[int, str]]]:
    text = TABLE.read_text(encoding="utf-8")
    version = re.search(r"\(Unicode ([0-9.]+)\)", text)
    assert version, "the table names its Unicode version"
    runs = [(int(cp, 16), cls) for cp, cls in re.findall(r"0x([0-9a-f]{6})u << 4 \| (UC_[A-Z]+)", text)]
    (n,) = re.findall(r"#define UC_N_RUNS (\d+)", text)
    assert len(runs) == int(n) and runs[0][0] == 0
    assert all(a[0] < b[0] and a[1] != b[1] for a, b in zip(runs, runs[1:], strict=False))
    return version.group(1), runs


def test_table_is_what_the_generator_writes() -> None:
    gen = _generator()
    version, runs = _table()
    if version == unicodedata.unidata_version:
        assert TABLE.read_text(encoding="utf-8") == gen.render()
        return
    bounds = [cp for cp, _ in runs[1:]] + [0x110000]
    for (start, cls), end in zip(runs, bounds, strict=True):
        if cls == "UC_OTHER":
            continue
        for cp in range(start, end):
            assert gen.class_of(cp) == cls, (hex(cp), cls, gen.class_of(cp))


def test_classes_of_known_code_points() -> None:
    gen = _generator()
    cases = {
        "A": "UC_LU",
        "z": "UC_LL",
        "\u01c5": "UC_LT",
        "\u02b0": "UC_LM",
        "\u4e2d": "UC_LO",
        "\u0301": "UC_M",
        "\u00bd": "UC_N",
        "!": "UC_P",
        "$": "UC_S",
        "\u3000": "UC_SPACE",
        "\x85": "UC_SPACE",
        "\x1c": "UC_OTHER",  # str.isspace() says yes; not White_Space, so \s does not match it
        "\ue000": "UC_OTHER",
    }
    for ch, cls in cases.items():
        assert gen.class_of(ord(ch)) == cls, (hex(ord(ch)), cls)
