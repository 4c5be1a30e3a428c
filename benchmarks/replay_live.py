"""A live run against its replay: every token of a routing trace decoded one step at a time (teacher
forced, in the trace's windows, each from an empty KV cache as it was recorded), then the same trace
replayed through the same store; prints both counters (docs/benchmarks.md, storage section).

    python benchmarks/replay_live.py --trace benchmarks/traces/colibri-moe-v2-heldout-bundled.npz \
        --policies lru,reuse --sizes 25%,40%
"""

from __future__ import annotations

import argparse
from pathlib import Path

from replay_policies import replay, store_options

import colibri_backend
from colibri_backend.trace import load_trace


def live_counts(model: str, tokens: list[int], window: int, size: str, policy: str) -> tuple[int, int]:
    with colibri_backend.load(model, **store_options(size, policy), threads=2) as m:
        for start in range(0, len(tokens), window):
            chunk = tokens[start : start + window]
            for i in range(len(chunk)):
                m.next_logits(chunk[: i + 1])  # one decode step: the cache holds the rest
        s = m.stats()
    return int(s["expert_hits"]), int(s["expert_misses"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True, help="a trace from `colibri trace`")
    ap.add_argument("--model", default="colibri-moe", help="the model it was recorded with (%(default)s)")
    ap.add_argument("--policies", default="lru,reuse")
    ap.add_argument("--sizes", default="25%,40%")
    args = ap.parse_args(argv)
    tr = load_trace(args.trace)
    window = int(tr.meta.get("window") or tr.n_tokens)
    for policy in args.policies.split(","):
        for size in args.sizes.split(","):
            hits, misses = live_counts(args.model, tr.tokens.tolist(), window, size, policy)
            r = replay(args.model, tr, size, policy)
            print(
                f"{policy} {size}: live {hits} hits / {misses} misses ({100 * hits / (hits + misses):.2f}%), "
                f"replay {r['expert_hits']} / {r['expert_misses']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
