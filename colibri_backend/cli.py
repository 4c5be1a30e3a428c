"""The `colibri` command line.

Each subcommand lives in its own module under `colibri_backend.commands` and exposes
`register(subparsers)`, which adds its parser and sets `func` to the function that runs it.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from colibri_backend import commands as _commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri",
        description="Run mixture-of-experts language models within a memory budget.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(_commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{_commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a clear one-line error instead of a traceback for user mistakes
        from colibri_backend.errors import ColibriError

        if isinstance(exc, (ColibriError, FileNotFoundError, ValueError)):
            print(f"colibri {args.command}: error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
