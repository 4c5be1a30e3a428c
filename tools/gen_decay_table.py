"""Writes native/src/decay_table.h: 0.5^(k / H) for k = 0 .. H - 1 (H = 32, the expert store's LFU half-life)
as exact hex-float constants, each the double nearest the true value.

    python tools/gen_decay_table.py            # rewrites the table
    python tools/gen_decay_table.py --check    # exit 1 if the checked-in table differs

The expert store's eviction scores decay by 0.5^(g / H) for an age of g tokens. libm's pow() may round the
last bit differently on each platform, and a replay compares the C policy's hits exactly with a Python
simulator (tests/test_replay_batched.py), so a flipped near tie would break it. With this table,
0.5^(g / H) = ldexp(table[g % H], -(g / H)): a table entry scaled by a power of two, exact on every CPU.

The entries are found with integer arithmetic alone (no floating-point function whose rounding could differ
between the machines that run this script): for 0 < k < H the value x = 2^(-k/H) lies in (1/2, 1), so its
nearest double is m / 2^53 with m the integer nearest x * 2^53; m is the floor of the H-th root of
2^(53 H - k), rounded up when (m + 1/2)^H is still below that power. x is irrational, so no value lies on a
midpoint and the rounding is never a tie.
"""

from __future__ import annotations

import sys
from pathlib import Path

from generated_header import generator_main

OUT = Path(__file__).resolve().parents[1] / "native" / "src" / "decay_table.h"
HALF_LIFE = 32
MANT = 53  # bits of a double's significand


def nearest_double(k: int, h: int = HALF_LIFE) -> float:
    """The double nearest 2^(-k/h), 0 <= k < h."""
    if k == 0:
        return 1.0
    assert 0 < k < h
    target = 1 << (MANT * h - k)  # (x * 2^53)^h
    m = int(2.0 ** (MANT - k / h))  # a first guess, corrected exactly below
    while m**h > target:
        m -= 1
    while (m + 1) ** h <= target:
        m += 1
    # m = floor(x * 2^53); round up when the midpoint m + 1/2 is below x: (2m + 1)^h < 2^h * target
    if (2 * m + 1) ** h < target << h:
        m += 1
    assert 1 << (MANT - 1) <= m < 1 << MANT
    return m / float(1 << MANT)  # exact: m has 53 bits


def table(h: int = HALF_LIFE) -> list[float]:
    return [nearest_double(k, h) for k in range(h)]


def render(h: int = HALF_LIFE) -> str:
    lines = [
        "/* decay_table.h: written by tools/gen_decay_table.py (do not edit; rerun it).",
        " *",
        " * DECAY_TABLE[k] = 0.5^(k / DECAY_HALF_LIFE), each the double nearest the exact value, found",
        " * with integer arithmetic. 0.5^(g / H) = ldexp(DECAY_TABLE[g % H], -(g / H)) is then exact on",
        " * every CPU, where libm's pow() may round the last bit differently from one platform to the",
        " * next. */",
        "#ifndef COLIBRI_DECAY_TABLE_H",
        "#define COLIBRI_DECAY_TABLE_H",
        "",
        f"#define DECAY_HALF_LIFE {h}",
        "",
        "static const double DECAY_TABLE[DECAY_HALF_LIFE] = {",
    ]
    lines += [f"    {v.hex()}, /* k = {k} */" for k, v in enumerate(table(h))]
    lines += ["};", "", "#endif", ""]
    return "\n".join(lines)


def main() -> int:
    return generator_main(OUT, render, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
