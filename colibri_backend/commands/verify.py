"""`colibri verify MODEL [--write]`: check a GGUF's tensors against their digests (MODEL.digests)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check a model file's tensors against their digests, or write the digests",
        description="Read the whole GGUF file and compare every tensor (every expert of a stacked expert "
        "tensor) with the digests in MODEL.digests beside it. Exit 0 when all match, 1 with the names of "
        "the tensors that differ (or when the file or its digests cannot be read). --write computes the "
        "digests of the file as it is now and writes MODEL.digests (colibri convert writes them itself).",
    )
    p.add_argument("model", metavar="MODEL", help="a .gguf file")
    p.add_argument("--write", action="store_true", help="write MODEL.digests for the file as it is now")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from colibri_backend.digests import verify_file, write_digests

    path = Path(args.model)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    if args.write:
        print(f"wrote {write_digests(path)}")
        return 0
    bad = verify_file(path)
    if bad:
        print(f"{path}: {len(bad)} tensor(s) do not match their digests:", file=sys.stderr)
        for name in bad:
            print(name)
        return 1
    print(f"{path}: every tensor matches its digest")
    return 0
