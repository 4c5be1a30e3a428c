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

from colibri_backend.commands._load_options import add_load_arguments, load_options


def compute_plan(
    model: str,
    memory_budget: str | int | None,
    context_length: int | None = None,
    batch_size: int | None = None,
    threads: int | None = None,
    kv_cache_type: str | None = None,
    verify: bool = False,
    **store_options: Any,
) -> dict[str, int]:
    """The ledger's plan for loading `model` (path, checkpoint dir or known name) with these settings;
    store_options are the expert-store keywords of colibri_backend.load (expert_slots, ...)."""
    from ctypes import c_void_p

    from colibri_backend import _native
    from colibri_backend.budget import plan_to_dict
    from colibri_backend.engine import ModelInfo, store_params
    from colibri_backend.models import resolve_model

    path = resolve_model(model).gguf
    lib = _native.load_library()
    handle = c_void_p()
    lib.check(lib.colibri_model_open(os.fsencode(path), byref(handle)), f"cannot open {path}")
    try:
        if verify:
            from colibri_backend.digests import verify_model

            verify_model(handle, path)
        info_c = _native.ModelInfoC()
        lib.check(lib.colibri_model_get_info(handle, byref(info_c)), "model info")
        params, _ = store_params(
            lib,
            handle,
            ModelInfo.from_c(info_c),
            path,
            threads=threads,
            context_length=context_length,
            batch_size=batch_size,
            memory_budget=memory_budget,
            kv_cache_type=kv_cache_type,
            **store_options,
        )
        plan = _native.MemoryPlanC()
        lib.check(lib.colibri_plan_model(handle, byref(params), byref(plan)), f"plan for {path}")
        return plan_to_dict(plan)
    finally:
        lib.colibri_model_close(handle)


def run(args: argparse.Namespace) -> int:
    from colibri_backend.budget import format_plan

    options = load_options(args)
    budget = options.pop("memory_budget", None)
    plan = compute_plan(
        args.model, budget, args.context_length, args.batch_size, args.threads, args.kv_cache_type, **options
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
    add_load_arguments(p, budget_aliases=("-b",))
    p.set_defaults(func=run)
