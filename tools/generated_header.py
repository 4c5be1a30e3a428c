"""The command line of the tools/gen_*.py scripts that write a C header from a rule: write the header, or
with --check only say whether the checked-in one is what the script writes (exit 1 if not)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def generator_main(out: Path, render: Callable[[], str], description: str, source: str = "") -> int:
    """Parse sys.argv, then write render() to out or compare it with out; source names what the table was
    derived from (e.g. the Unicode version) in the messages."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="compare with the checked-in header, write nothing")
    args = ap.parse_args()
    text = render()
    src = f" ({source})" if source else ""
    if args.check:
        if out.is_file() and out.read_text(encoding="utf-8") == text:
            return 0
        print(
            f"{out} is not what {Path(sys.argv[0]).name} writes{src}: run it without --check", file=sys.stderr
        )
        return 1
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}{src}")
    return 0
