"""native/src/decay_table.h (the expert store's decay factors 0.5^(k / 32), used instead of pow() so that a
replay ranks slots alike on every CPU) against its generator, tools/gen_decay_table.py, and exact arithmetic.

The checked-in header is byte for byte what the generator writes; each entry is the double nearest
2^(-k/32), checked here with fractions (the two neighbouring midpoints raised to the 32nd power bracket
2^-k) rather than with the generator's integer roots. tests/test_replay_batched.py reads the same table for
its simulator (and checks its factor); native/tests/test_experts.c checks experts.c's store_decay.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest
from repo_tools import assert_check_mode_round_trip, load_tool

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "native" / "src" / "decay_table.h"
gen = load_tool("gen_decay_table")


def test_header_is_what_the_generator_writes() -> None:
    text = HEADER.read_text(encoding="utf-8")
    assert text == gen.render()
    assert f"#define DECAY_HALF_LIFE {gen.HALF_LIFE}\n" in text
    assert "#define STORE_LFU_HALF_LIFE 32 " in (ROOT / "native" / "src" / "experts.h").read_text(
        encoding="utf-8"
    )


@pytest.mark.parametrize("h", [32, 4, 7])
def test_entries_are_the_nearest_doubles(h: int) -> None:
    for k, v in enumerate(gen.table(h)):
        if k == 0:
            assert v == 1.0
            continue
        half_ulp = Fraction(math.ulp(v)) / 2
        lo, hi, x_h = Fraction(v) - half_ulp, Fraction(v) + half_ulp, Fraction(1, 2**k)
        assert lo**h < x_h < hi**h, (h, k, v.hex())  # 2^(-k/h) within half an ulp of v
        assert 0.5 < v < 1.0


def test_generator_check_mode_sees_a_stale_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "decay_table.h"
    stale.write_text(gen.render().replace("0x1.6a09e667f3bcdp-1", "0x1.6a09e667f3bccp-1"), encoding="utf-8")
    assert_check_mode_round_trip(gen, stale, HEADER, monkeypatch)
