"""A live run against its replay: every token of a routing trace decoded one step at a time (teacher
forced, in the trace's windows, each from an empty KV cache as it was recorded), then the same trace
replayed through the same store, and the routing the live decode made (Model.routing after every step)
replayed too; prints the three counters (docs/benchmarks.md, storage section). The trace was recorded in
prefill windows and a decode step's routing can differ from it now and then; the replay of the live
routing must match the live counters exactly.

    python benchmarks/replay_live.py --trace benchmarks/traces/colibri-moe-v2-heldout-bundled.npz \
        --policies lru,reuse --sizes 25%,40%

--streams N (N > 1) checks batched decode steps instead: the trace's tokens cut into N consecutive
streams (colibri_backend.replay.interleave), each teacher forced into its own sequence of one context
(max_concurrency N, every sequence from an empty cache), one token of every stream per step in one
eval_batch call, as the server's scheduler decodes N clients together. The routing each live step made
(Model.routing) is then replayed as batched steps (replay_routing(streams=N)) through a store set up the
same way, and both counters are printed with Belady's optimum on the same unions. --tokens limits the
tokens used (the first ones of the trace).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from replay_policies import replay, store_options

import colibri_backend
from colibri_backend.trace import load_trace


def live_counts(
    model: str, tokens: list[int], window: int, size: str, policy: str
) -> tuple[int, int, np.ndarray]:
    """Hits and misses of the live decode, and the routing it made [T, L, k]."""
    routes = []
    with colibri_backend.load(model, **store_options(size, policy), threads=2) as m:
        for start in range(0, len(tokens), window):
            chunk = tokens[start : start + window]
            for i in range(len(chunk)):
                m.next_logits(chunk[: i + 1])  # one decode step: the cache holds the rest
                ids = m.routing()[0]
                if ids.shape[0] != 1:
                    raise RuntimeError(f"step {start + i} evaluated {ids.shape[0]} tokens, not one")
                routes.append(ids[0])
        s = m.stats()
    return int(s["expert_hits"]), int(s["expert_misses"]), np.stack(routes)


def live_batched(model: str, tokens: np.ndarray, size: str, policy: str) -> tuple[dict, np.ndarray]:
    """tokens [n_steps, n_seq]: batched decode steps live; the counters and the routing of every step,
    [n_steps * n_seq, L, k] stream-major (as replay_routing(streams=n_seq) takes a trace)."""
    n_steps, n_seq = tokens.shape
    options = store_options(size, policy)
    with colibri_backend.load(
        model, **options, threads=2, max_concurrency=n_seq, context_length=n_steps, prefix_cache_size=0
    ) as m:
        seqs = np.arange(n_seq, dtype=np.int32)
        want = np.zeros(n_seq, dtype=np.uint8)  # no logits: teacher forced
        routes = []
        for step in tokens:
            m.eval_batch(seqs, step, want)
            routes.append(m.routing()[0])  # [n_seq, L, k]
        s = m.stats()
    steps = np.stack(routes)  # [n_steps, n_seq, L, k]
    return s, np.ascontiguousarray(steps.swapaxes(0, 1).reshape(-1, *steps.shape[2:]))


def check_batched(model: str, trace, streams: int, sizes: list[str], policies: list[str], limit: int) -> int:
    ids_in = trace.ids[:limit] if limit else trace.ids
    toks = (trace.tokens[:limit] if limit else trace.tokens).astype(np.int32)
    n_steps = len(toks) // streams
    tokens = np.ascontiguousarray(toks[: n_steps * streams].reshape(streams, n_steps).T)  # [n_steps, n_seq]
    same_routing = None
    bad = 0
    for policy in policies:
        for size in sizes:
            s, ids = live_batched(model, tokens, size, policy)
            # the same options (max_concurrency, no prefix cache), so the store has the same slots
            r = colibri_backend.replay_routing(
                model,
                np.zeros(len(ids), dtype=np.int32),
                ids,
                **store_options(size, policy),
                max_concurrency=streams,
                context_length=n_steps,
                prefix_cache_size=0,
                streams=streams,
            )
            if same_routing is None:  # the live routing against the trace's (recorded in windows)
                same_routing = float((np.sort(ids, -1) == np.sort(ids_in[: len(ids)], -1)).mean())
                print(
                    f"{streams} streams of {n_steps} tokens: live routing equals the trace's on "
                    f"{100 * same_routing:.1f}% of the ids",
                    flush=True,
                )
            live = (int(s["expert_hits"]), int(s["expert_misses"]))
            rep = (int(r["expert_hits"]), int(r["expert_misses"]))
            bad += live != rep or int(s["expert_slots"]) != int(r["expert_slots"])
            print(
                f"{policy} {size} ({r['expert_slots']} slots): live {live[0]} hits / {live[1]} misses "
                f"({100 * live[0] / max(1, sum(live)):.2f}%), replay {rep[0]} / {rep[1]}, "
                f"{'equal' if live == rep else 'DIFFERENT'}; Belady {100 * r['optimal_hit_rate']:.2f}%",
                flush=True,
            )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True, help="a trace from `colibri trace`")
    ap.add_argument("--model", default="colibri-moe", help="the model it was recorded with (%(default)s)")
    ap.add_argument("--policies", default="lru,reuse")
    ap.add_argument("--sizes", default="25%,40%")
    ap.add_argument(
        "--streams", type=int, default=1, help="N > 1: batched steps of N sequences (%(default)s)"
    )
    ap.add_argument("--tokens", type=int, default=0, help="use the first N tokens only (0: all)")
    args = ap.parse_args(argv)
    tr = load_trace(args.trace)
    policies, sizes = args.policies.split(","), args.sizes.split(",")
    if args.streams > 1:
        return check_batched(args.model, tr, args.streams, sizes, policies, args.tokens)
    window = int(tr.meta.get("window") or tr.n_tokens)
    tokens = tr.tokens.tolist()[: args.tokens or None]
    for policy in policies:
        for size in sizes:
            hits, misses, live_ids = live_counts(args.model, tokens, window, size, policy)
            n = len(tokens)
            r = (
                replay(args.model, tr, size, policy)
                if not args.tokens
                else colibri_backend.replay_routing(
                    args.model, tr.tokens[:n], tr.ids[:n], **store_options(size, policy)
                )
            )
            # the trace was recorded in prefill windows, the live run decodes token by token: where the
            # two routings differ, so may the counts; the live routing's own replay must match exactly
            own = colibri_backend.replay_routing(
                args.model, tr.tokens[:n], live_ids, **store_options(size, policy)
            )
            same = float((np.sort(live_ids, -1) == np.sort(tr.ids[:n], -1)).mean())
            mine = (own["expert_hits"], own["expert_misses"])
            print(
                f"{policy} {size}: live {hits} hits / {misses} misses ({100 * hits / (hits + misses):.2f}%), "
                f"replay of the trace {r['expert_hits']} / {r['expert_misses']}, replay of the live routing "
                f"{own['expert_hits']} / {own['expert_misses']} "
                f"({'equal' if (hits, misses) == mine else 'DIFFERENT'}); "
                f"live routing = trace's on {100 * same:.2f}% of the ids",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
