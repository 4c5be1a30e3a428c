"""`colibri replay MODEL TRACE`: a recorded routing through an expert store, without the model.

    colibri trace --model colibri-moe --file some.py -o some.npz
    colibri replay colibri-moe some.npz --expert-slots 40% --warmup-routing --prefetch temporal,hashed

Each traced token is one decode step through a store set up as the options say (slots, policy,
profile warm-up and pinning, temporal and hashed predictors; the lookahead predictor needs hidden states,
so it is replayed from the guesses a trace recorded, `colibri trace --record-lookahead N`, under
--lookahead-depth and --lookahead-confidence). The experts' bytes are really read from the model file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from colibri_backend.commands._load_options import add_load_arguments, load_options


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def summary(s: dict[str, Any]) -> dict[str, Any]:
    """The figures `colibri replay` reports, from replay_routing's counters."""
    out: dict[str, Any] = {
        "tokens": s["n_tokens"],
        "streams": s["streams"],
        "expert_slots": s["expert_slots"],
        "calls": s["expert_calls"],
        "hits": s["expert_hits"],
        "misses": s["expert_misses"],
        "hit_rate": s["expert_hit_rate"],
        "optimal_misses": s["optimal_misses"],
        "optimal_hit_rate": s["optimal_hit_rate"],
        "optimal_hit_rate_preloaded": s["optimal_hit_rate_preloaded"],
        "share_of_optimum": _ratio(s["expert_hit_rate"], s["optimal_hit_rate"]),
        "prefetch_issued": s["prefetch_issued"],
        "prefetch_used": s["prefetch_used"],
        "prefetch_wasted": s["prefetch_wasted"],
        "prefetch_wasted_bytes": s["prefetch_wasted_bytes"],
        "prefetch_dropped": s["prefetch_dropped"],
        "bytes_read": s["expert_bytes_read"],
        "stall_seconds": s["expert_stall_seconds"],
        "replay_seconds": s["decode_seconds"],
        # The replay computes nothing, so this is the share of its time spent waiting for expert reads.
        "stall_share": _ratio(s["expert_stall_seconds"], s["decode_seconds"]),
        "experts_pinned": s["experts_pinned"],
        "routing_profile": s.get("routing_profile"),
    }
    for src in ("lookahead", "temporal", "hashed"):
        out[f"{src}_precision"] = s[f"{src}_precision"]
        out[f"{src}_recall"] = s[f"{src}_recall"]
        out[f"{src}_predicted"] = s[f"{src}_predicted"]
    return out


def format_summary(r: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"tokens replayed: {r['tokens']}"
        + (f" as {r['streams']} streams in batched steps" if r["streams"] > 1 else "")
        + f"  expert slots: {r['expert_slots']}  pinned: {r['experts_pinned']}"
        + (f"  profile: {r['routing_profile']}" if r["routing_profile"] else ""),
        f"hit rate: {100 * r['hit_rate']:.1f}%  "
        f"({r['hits']} hits, {r['misses']} misses of {r['calls']} uses)",
        f"Belady's optimum: {100 * r['optimal_hit_rate']:.1f}% from an empty cache "
        f"({r['optimal_misses']} misses), "
        f"{100 * r['optimal_hit_rate_preloaded']:.1f}% from the best preload; "
        f"this store reaches {100 * r['share_of_optimum']:.1f}% of the optimum",
        f"prefetch: issued {r['prefetch_issued']}, used {r['prefetch_used']}, wasted {r['prefetch_wasted']} "
        f"({r['prefetch_wasted_bytes'] / mib:.1f} MiB wasted), dropped unread {r['prefetch_dropped']}; "
        f"{r['bytes_read'] / mib:.1f} MiB read in all",
        f"stall: {r['stall_seconds']:.3f} s of {r['replay_seconds']:.3f} s ({100 * r['stall_share']:.1f}%)",
    ]
    for src in ("lookahead", "temporal", "hashed"):
        if r[f"{src}_predicted"]:
            lines.append(
                f"{src} predictor: precision {r[f'{src}_precision']:.2f}, recall {r[f'{src}_recall']:.2f}"
            )
        else:
            lines.append(f"{src} predictor: off")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import colibri_backend
    from colibri_backend.models import resolve_model
    from colibri_backend.trace import load_trace

    options = load_options(args)
    if options.expert_slots is None and options.memory_budget is None:
        raise ValueError(
            "give the store to replay through: --expert-slots N (or P%) or --memory-budget SIZE "
            "below what holds every expert"
        )
    if options.route_prefilter_margin or options.drop_cold_share:
        raise ValueError(
            "--route-prefilter and --drop-cold change the routing itself; a replay keeps the trace's"
        )
    if options.memory_budget is None:  # the store is sized by --expert-slots alone
        options = options.with_changes(memory_budget=0)
    trace = load_trace(args.trace)
    path = resolve_model(args.model).gguf
    meta_sha = trace.meta.get("model_sha256")
    if meta_sha:
        from colibri_backend.trace import file_sha256

        if file_sha256(path) != meta_sha:
            print(
                f"colibri replay: warning: {args.trace} was recorded with another model file "
                f"(sha256 {meta_sha[:12]}) than {path}",
                file=sys.stderr,
            )
    from colibri_backend.budget import PREFETCHERS, parse_prefetch

    guesses = trace.recorded_guesses(options.prefetch)
    wants_lookahead = parse_prefetch(options.prefetch or "none") & PREFETCHERS["lookahead"]
    # ("all" is every predictor that can run: without guesses the lookahead cannot)
    if wants_lookahead and not guesses and (options.prefetch or "").strip().lower() != "all":
        raise ValueError(
            f"--prefetch lookahead: {args.trace} holds no recorded lookahead guesses to replay "
            "(record them with `colibri trace --record-lookahead N`)"
        )
    stats = colibri_backend.replay_routing(
        path, trace.tokens, trace.ids, options, streams=args.streams, **guesses
    )
    result = summary(stats)
    if args.json:
        print(
            json.dumps(
                {"model": str(path), "trace": str(args.trace), "options": options.changed(), **result},
                indent=2,
            )
        )
    else:
        print(format_summary(result))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay a routing trace through an expert store: hit rate, prefetch, stalls",
        description="Replay TRACE (written by `colibri trace`) through MODEL's expert store as the options "
        "set it up, every token one decode step, reading expert bytes from the file but computing "
        "nothing else. Prints hit rate, misses, prefetches issued / used / wasted (and wasted bytes), "
        "stall time and the predictors' precision and recall. The lookahead predictor needs hidden "
        "states: it replays the guesses the trace recorded (`colibri trace --record-lookahead N`).",
    )
    p.add_argument("model", help="a .gguf file, a Hugging Face checkpoint directory, or a known name")
    p.add_argument("trace", type=Path, help="a routing trace (.npz or .jsonl) from `colibri trace`")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--streams",
        type=int,
        default=1,
        metavar="N",
        help="replay the trace as N sequences decoding together (N consecutive parts, one token of each "
        "per batched step, the union of their experts per layer; needs --prefetch none), against Belady's "
        "optimum on those unions (default 1: one decode step per token)",
    )
    add_load_arguments(p)
    p.set_defaults(func=run)
