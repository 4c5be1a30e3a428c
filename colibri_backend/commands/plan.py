"""`colibri plan MODEL --memory-budget B [--context N]`: the engine's memory plan, by category.

The numbers come from the engine itself (colibri_plan in colibri.h), so this command and a
load with the same settings can never disagree. Exit status 0 when the budget fits, 2 when it
does not (the last line names the budget that would work).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from colibri_backend.commands._load_options import (
    add_context_length_argument,
    add_load_arguments,
    add_threads_argument,
    load_options,
)


def run(args: argparse.Namespace) -> int:
    from colibri_backend.budget import format_plan
    from colibri_backend.engine import plan_memory

    plan = plan_memory(args.model, load_options(args))
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(f"memory plan for {args.model}")
        if args.max_concurrency and args.max_concurrency > 1:
            print(f"  (the KV cache holds {args.max_concurrency} sequences, --max-concurrency)")
        print(format_plan(plan))
    if not plan["fits"]:
        print(
            f"colibri plan: the budget does not fit; use --memory-budget {plan['min_budget']} or more",
            file=sys.stderr,
        )
        return 2
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print the memory plan for a model and budget, and whether it fits",
        description="Print every byte the engine would hold for MODEL (resident weights, KV cache, scratch, "
        "expert slots) under a memory budget, and whether the budget holds the minimum working set.",
    )
    p.add_argument("model", help="a .gguf file, a Hugging Face checkpoint directory, or a known name")
    add_context_length_argument(p, "--context")
    p.add_argument("--batch-size", type=int, default=None, help="prefill chunk in tokens (512)")
    add_threads_argument(p)
    p.add_argument(
        "--kv-cache-type", choices=("f16", "int8"), default=None, help="KV cache elements (default f16)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_load_arguments(p, budget_aliases=("-b",))
    p.set_defaults(func=run)
