"""Every expert cache policy, with and without temporal prefetch, replayed on recorded routing traces
against Belady's optimum (docs/memory.md, "The reuse policy"; docs/benchmarks.md, storage section).

    python benchmarks/replay_policies.py \
        --trace v1=v1.gguf:benchmarks/traces/colibri-moe-v1-heldout.npz \
        --trace v2=$V2:benchmarks/traces/colibri-moe-v2-heldout.npz \
        --json benchmarks/results/replay_policies.json

($V2: colibri-moe v2's Q8_0 file, ~/.cache/colibri/train-v2/colibri-moe-v2-q8_0.gguf, docs/benchmarks.md;
v1.gguf: the model bundled before v2,
`git show 0c1345a:colibri_backend/models/colibri-moe-q8_0.gguf > v1.gguf`.)
A trace that holds the lookahead predictor's guesses (`colibri trace` records them) also gets their recall
by depth, and with `--lookahead-confidence 0,0.08,0.1` a table of the default policy prefetching those
recorded guesses (colibri_replay_routing_lookahead) `--lookahead-depth` layers ahead under each confidence
threshold: hit rate, the lookahead's precision and recall, prefetches issued and the bytes of those
evicted unused. `--predictor-sets none,lookahead,temporal,hashed,lookahead+temporal,all` replays the default
policy with each set of predictors (the lookahead from the recorded guesses, `--lookahead-depth` and
`--lookahead-confidence` taking their first values), every set with the model's routing profile
(MODEL.routing: the warm start, and the hashed predictor's table): hit rate, each predictor's precision
and recall, bytes read against no prefetch, wasted MiB and the stall share of the replay's time.
`--prefetch none` leaves the temporal columns out. `--streams 1,8,16` also replays each trace as N
sequences decoding together (batched steps, the union of N tokens' experts per layer; no prefetch, as
live), against Belady's optimum on those unions.
`--foresight 0,1,2,4` adds a table of MIN told the routing of the current token and the next W tokens
only (colibri_backend.optimum.foresight_min): how much of the distance to the optimum a perfect prediction
of the next tokens' routing could close.
The figures depend on the model's shape only (layers, experts, top-k), so a tiny model of the same shape
replays them in seconds where the real file's reads take minutes.
Each cell is one `colibri_replay_routing` run (the same C store the engine decodes with, reading the
experts' bytes from the model file, computing nothing else) at --sizes of the model's routed experts; it
prints the hit rate, the hit rate as a share of Belady's optimum for the same slot count (from an empty
cache) and, where a predictor prefetches, the bytes of prefetches evicted unused. Without prefetch a
replay is deterministic, so these figures do not depend on the machine; a trace takes seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import colibri_backend
from colibri_backend.models import resolve_model
from colibri_backend.optimum import belady, foresight_min
from colibri_backend.trace import load_trace

POLICIES = ("lfu", "lru", "reuse")
PREFETCH = ("none", "temporal")


def lookahead_recall(trace: Any) -> list[float]:
    """Per depth d, the share of the experts layer l+d chose that the lookahead from layer l guessed
    (k guesses for k chosen, so precision is the same number), over every layer pair."""
    la = trace.lookahead_ids
    out = []
    for d in range(1, la.shape[2] + 1):
        g, truth = la[:, : trace.n_layer - d, d - 1], trace.ids[:, d:]
        out.append(float((g[..., :, None] == truth[..., None, :]).any(-1).mean()))
    return out


def store_options(size: str, policy: str, prefetch: str = "none") -> dict[str, str]:
    """The expert store of one cell, as replay_routing and colibri_backend.load take it: a live decode
    with these options is what the replay reproduces (replay_live.py, tests/test_lookahead_record.py)."""
    return {"expert_slots": size, "expert_policy": policy, "prefetch": prefetch}


def replay(
    model: str | Path,
    trace: Any,
    size: str,
    policy: str,
    prefetch: str = "none",
    streams: int = 1,
    **extra: Any,
) -> dict[str, Any]:
    """replay_routing's counters for the trace through the store_options store (streams: sequences
    stepping together) and any further load options in `extra`. With the lookahead among the prefetch
    predictors, the trace's recorded guesses are replayed (lookahead_depth and lookahead_confidence
    among `extra`)."""
    options = store_options(size, policy, prefetch) | extra
    options |= trace.recorded_guesses(prefetch)
    return colibri_backend.replay_routing(model, trace.tokens, trace.ids, streams=streams, **options)


def cell(
    model: Path, trace: Any, size: str, policy: str, prefetch: str, streams: int = 1, **extra: Any
) -> dict[str, Any]:
    s = replay(model, trace, size, policy, prefetch, streams, **extra)
    return {
        "slots": s["expert_slots"],
        "hit_rate": s["expert_hit_rate"],
        "optimal_hit_rate": s["optimal_hit_rate"],
        "share_of_optimum": s["expert_hit_rate"] / s["optimal_hit_rate"] if s["optimal_hit_rate"] else 0.0,
        "prefetch_issued": s["prefetch_issued"],
        "prefetch_wasted_bytes": s["prefetch_wasted_bytes"],
        "bytes_read": s["expert_bytes_read"],
        "misses": s["expert_misses"],
        "calls": s["expert_hits"] + s["expert_misses"],
        "stall_share": s["expert_stall_seconds"] / s["decode_seconds"] if s["decode_seconds"] else 0.0,
        **{
            f"{src}_{m}": s[f"{src}_{m}"]
            for src in ("lookahead", "temporal", "hashed")
            for m in ("precision", "recall")
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace",
        action="append",
        required=True,
        metavar="NAME=MODEL:TRACE",
        help="a routing trace and the model file (or known name) it was recorded with; repeat for more",
    )
    ap.add_argument("--sizes", default="25%,40%,60%", help="expert slots, comma-separated (%(default)s)")
    ap.add_argument("--streams", default="1", help="batched: sequences stepping together (%(default)s)")
    ap.add_argument(
        "--prefetch",
        default="none,temporal",
        help="prefetch modes of the one-stream tables, comma-separated (%(default)s; batched: none)",
    )
    ap.add_argument(
        "--foresight",
        default="",
        help="also MIN told the next W tokens' routing, for each W here, comma-separated (one stream only)",
    )
    ap.add_argument(
        "--lookahead-confidence",
        default="",
        help="with recorded lookahead guesses: replay them under each confidence threshold, comma-separated",
    )
    ap.add_argument(
        "--lookahead-depth", default="1", help="layers ahead for --lookahead-confidence, comma-separated"
    )
    ap.add_argument(
        "--predictor-sets",
        default="",
        help="replay the default policy with each predictor set (none, lookahead, temporal, hashed, "
        "lookahead+temporal, all), with the model's routing profile, comma-separated",
    )
    ap.add_argument("--json", type=Path, help="also write every cell here")
    args = ap.parse_args(argv)
    sizes = [x.strip() for x in args.sizes.split(",") if x.strip()]
    stream_counts = [int(x) for x in args.streams.split(",") if x.strip()]
    prefetches = tuple(x.strip() for x in args.prefetch.split(",") if x.strip())
    try:
        horizons = [int(x) for x in args.foresight.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--foresight takes token counts, comma-separated, got {args.foresight!r}")
    if any(w < 0 for w in horizons):
        ap.error(f"--foresight takes token counts >= 0, got {args.foresight!r}")
    try:
        confidences = [float(x) for x in args.lookahead_confidence.split(",") if x.strip()]
        depths = [int(x) for x in args.lookahead_depth.split(",") if x.strip()]
    except ValueError:
        ap.error(
            "--lookahead-confidence takes probabilities and --lookahead-depth layer counts, comma-separated"
        )
    if not prefetches or any(p not in PREFETCH for p in prefetches):
        ap.error(f"--prefetch takes {', '.join(PREFETCH)}, got {args.prefetch!r}")
    results: list[dict[str, Any]] = []
    for spec in args.trace:
        name, sep, rest = spec.partition("=")
        model_name, sep2, trace_path = rest.rpartition(":")
        if not (sep and sep2 and name and model_name and trace_path):
            ap.error(f"--trace wants NAME=MODEL:TRACE, got {spec!r}")
        model = resolve_model(model_name).gguf
        trace = load_trace(trace_path)
        print(f"\n{name}: {trace_path} ({trace.n_tokens} tokens) on {model}")
        if trace.lookahead_ids is not None:
            recall = lookahead_recall(trace)
            results.append({"trace": name, "lookahead_recall_by_depth": recall})
            print("lookahead recall (= precision) by depth: " + ", ".join(f"{100 * r:.1f}%" for r in recall))
        for streams in stream_counts:
            slots = table(name, model, trace, sizes, streams, results, prefetches)
            if horizons and streams == 1:
                foresight_table(name, trace, slots, horizons, results)
        sets = [x.strip() for x in args.predictor_sets.split(",") if x.strip()]
        if sets:
            depth, confidence = (depths or [1])[0], (confidences or [0.0])[0]
            predictor_table(name, model, trace, sizes, sets, depth, confidence, results)
        if confidences:
            if trace.lookahead_ids is None:
                ap.error(f"--lookahead-confidence: {trace_path} holds no recorded lookahead guesses")
            lookahead_table(name, model, trace, sizes, depths, confidences, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def table(
    name: str,
    model: Path,
    trace: Any,
    sizes: list[str],
    streams: int,
    results: list[dict[str, Any]],
    prefetches: tuple[str, ...] = PREFETCH,
) -> None:
    """One markdown table: every policy (with each of `prefetches` where single steps can prefetch) at
    every size. Returns each size's slot count."""
    prefetches = prefetches if streams == 1 else ("none",)
    if streams > 1:
        print(f"\n{streams} streams of {trace.n_tokens // streams} tokens, batched steps:")
    cols = [f"{p}{'' if f == 'none' else ' + ' + f}" for p in POLICIES for f in prefetches]
    print("| slots | Belady | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    slots: dict[str, int] = {}
    for size in sizes:
        row: list[str] = []
        first: dict[str, Any] | None = None
        for policy in POLICIES:
            for prefetch in prefetches:
                r = cell(model, trace, size, policy, prefetch, streams)
                first = first or r
                key = {"trace": name, "size": size, "streams": streams, "policy": policy}
                key["prefetch"] = prefetch
                results.append({**key, **r})
                text = f"{100 * r['hit_rate']:.1f}% ({100 * r['share_of_optimum']:.1f}%)"
                if prefetch != "none":
                    text += f", {r['prefetch_wasted_bytes'] / (1 << 20):.0f} MiB wasted"
                row.append(text)
        assert first is not None
        slots[size] = first["slots"]
        head = f"| {size} ({first['slots']}) | {100 * first['optimal_hit_rate']:.1f}% | "
        print(head + " | ".join(row) + " |")
        sys.stdout.flush()
    return slots


def lookahead_table(
    name: str,
    model: Path,
    trace: Any,
    sizes: list[str],
    depths: list[int],
    confidences: list[float],
    results: list[dict[str, Any]],
) -> None:
    """One markdown table: the reuse policy prefetching the trace's recorded lookahead guesses, for each
    depth and confidence threshold, at every size: hit rate (a prefetched expert counts as a hit, so
    Belady's demand-fetch optimum is no bound here), the lookahead's precision / recall, the expert bytes
    read against the reuse policy alone, and MiB of prefetches evicted unused."""
    cols = [(d, c) for d in depths for c in confidences]
    print(
        "\nreuse + recorded lookahead: hit rate, precision / recall, bytes read (x reuse alone), MiB wasted"
    )
    print("| slots | Belady | reuse | " + " | ".join(f"depth {d}, p >= {c:g}" for d, c in cols) + " |")
    print("|---" * (len(cols) + 3) + "|")
    for size in sizes:
        base = cell(model, trace, size, "reuse", "none")
        row = [f"{100 * base['hit_rate']:.1f}% ({100 * base['share_of_optimum']:.1f}%)"]
        for d, c in cols:
            r = cell(model, trace, size, "reuse", "lookahead", lookahead_depth=d, lookahead_confidence=c)
            results.append(
                {"trace": name, "size": size, "policy": "reuse", "prefetch": "lookahead (recorded)"}
                | {"lookahead_depth": d, "lookahead_confidence": c}
                | r
            )
            row.append(
                f"{100 * r['hit_rate']:.1f}%, "
                f"{100 * r['lookahead_precision']:.0f}% / {100 * r['lookahead_recall']:.0f}%, "
                f"{r['bytes_read'] / base['bytes_read']:.2f}x, {r['prefetch_wasted_bytes'] / (1 << 20):.0f}"
            )
        print(
            f"| {size} ({base['slots']}) | {100 * base['optimal_hit_rate']:.1f}% | " + " | ".join(row) + " |"
        )
        sys.stdout.flush()


def predictor_table(
    name: str,
    model: Path,
    trace: Any,
    sizes: list[str],
    sets: list[str],
    depth: int,
    confidence: float,
    results: list[dict[str, Any]],
) -> None:
    """One markdown table: the reuse policy with the model's routing profile (warm start, hashed table) and
    each predictor set, at every size: hit rate (share of the demand-fetch optimum), each predictor's
    precision / recall, bytes read against no prefetch, MiB wasted and the stall share of the replay."""
    print(
        f"\nreuse with the routing profile, each predictor set (lookahead: depth {depth}, "
        f"p >= {confidence:g}): hit rate (share of optimum); precision / recall; read (x none); "
        "MiB wasted; stall"
    )
    print("| slots | Belady | " + " | ".join(sets) + " |")
    print("|---" * (len(sets) + 2) + "|")
    short = {"lookahead": "L", "temporal": "T", "hashed": "H"}
    for size in sizes:
        row: list[str] = []
        base: dict[str, Any] | None = None
        for pset in sets:
            prefetch = pset.replace("+", ",")
            r = cell(
                model,
                trace,
                size,
                "reuse",
                prefetch,
                warmup_routing=True,
                lookahead_depth=depth,
                lookahead_confidence=confidence,
            )
            base = base or r
            results.append(
                {"trace": name, "size": size, "policy": "reuse", "profile": True, "prefetch": pset} | r
            )
            pr = " ".join(
                f"{short[src]} {100 * r[f'{src}_precision']:.0f}/{100 * r[f'{src}_recall']:.0f}%"
                for src in short
                if r[f"{src}_precision"] or r[f"{src}_recall"]
            )
            row.append(
                f"{100 * r['hit_rate']:.1f}% ({100 * r['share_of_optimum']:.0f}%)"
                + (f"; {pr}" if pr else "")
                + f"; {r['bytes_read'] / base['bytes_read']:.2f}x"
                + f"; {r['prefetch_wasted_bytes'] / (1 << 20):.0f}"
                + f"; {100 * r['stall_share']:.0f}%"
            )
        assert base is not None
        print(
            f"| {size} ({base['slots']}) | {100 * base['optimal_hit_rate']:.1f}% | " + " | ".join(row) + " |"
        )
        sys.stdout.flush()


def foresight_table(
    name: str, trace: Any, slots: dict[str, int], horizons: list[int], results: list[dict[str, Any]]
) -> None:
    """One markdown table: MIN told the current token's and the next W tokens' routing (least recently
    used beyond them), for each W in `horizons`, at each size's slot count, beside Belady's optimum."""
    n_expert = int(trace.meta.get("n_expert", 0))
    if n_expert <= 0:
        raise SystemExit(f"{name}: the trace's metadata has no n_expert")
    print("\nMIN told the next W tokens' routing only (hit rate, share of Belady's optimum):")
    print("| slots | Belady | " + " | ".join(f"W = {w}" for w in horizons) + " |")
    print("|---" * (len(horizons) + 2) + "|")
    for size, n_slots in slots.items():
        best = belady(trace.ids, n_expert, n_slots).hit_rate
        row = []
        for w in horizons:
            hit = foresight_min(trace.ids, n_expert, n_slots, w).hit_rate
            results.append(
                {
                    "trace": name,
                    "size": size,
                    "slots": n_slots,
                    "foresight_tokens": w,
                    "hit_rate": hit,
                    "optimal_hit_rate": best,
                }
            )
            row.append(f"{100 * hit:.1f}% ({100 * hit / best:.1f}%)")
        print(f"| {size} ({n_slots}) | {100 * best:.1f}% | " + " | ".join(row) + " |")
        sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
