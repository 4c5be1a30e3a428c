"""`colibri plan MODEL --memory-budget B [--context N]`: the engine's memory plan, by category.

The numbers come from the engine itself (colibri_plan in colibri.h), so this command and a
load with the same settings can never disagree. Exit status 0 when the budget fits, 2 when it
does not (the last line names the budget that would work).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from ctypes import byref
from typing import Any


def compute_plan(
    model: str,
    memory_budget: str | int | None,
    context_length: int | None = None,
    batch_size: int | None = None,
    threads: int | None = None,
    kv_cache_type: str | None = None,
) -> dict[str, int]:
    """The ledger's plan for loading `model` (path, checkpoint dir or known name) with these settings."""
    from colibri_backend import _native
    from colibri_backend.budget import parse_kv_cache_type, plan_to_dict, resolve_budget
    from colibri_backend.models import resolve_model

    path = resolve_model(model).gguf
    lib = _native.load_library()
    params = _native.ContextParamsC()
    lib.colibri_context_default_params(byref(params))
    params.n_threads = int(threads or 0)
    params.n_ctx = int(context_length or 0)
    if batch_size:
        params.n_batch = int(batch_size)
    params.memory_budget = resolve_budget(memory_budget)
    params.kv_type = parse_kv_cache_type(kv_cache_type)
    plan = _native.MemoryPlanC()
    lib.check(lib.colibri_plan(os.fsencode(path), byref(params), byref(plan)), f"plan for {path}")
    return plan_to_dict(plan)


def run(args: argparse.Namespace) -> int:
    from colibri_backend.budget import format_plan

    plan = compute_plan(
        args.model, args.memory_budget, args.context_length, args.batch_size, args.threads, args.kv_cache_type
    )
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(f"memory plan for {args.model}")
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
    p.add_argument(
        "--memory-budget",
        "-b",
        default=None,
        help="512M, 1.5G, bytes, or 0 for unlimited (default: a share of available memory / cgroup limit)",
    )
    p.add_argument(
        "--context",
        "--context-length",
        dest="context_length",
        type=int,
        default=None,
        help="context window in tokens (default: min(trained length, 4096))",
    )
    p.add_argument("--batch-size", type=int, default=None, help="prefill chunk in tokens (512)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all CPUs)")
    p.add_argument(
        "--kv-cache-type", choices=("f16", "int8"), default=None, help="KV cache elements (default f16)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
