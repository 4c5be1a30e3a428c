"""One model on one compute backend: decode and prefill speed, and the streaming pipeline's timeline.

For a quick look at a device (docs/portability.md, "Accelerator backend"). The cgroup-capped protocol is
benchmarks/bench.py with COLIBRI_DEVICE set; this script runs in the current process, with the engine's
own memory budget:

    python benchmarks/device_pipeline.py --model ~/.cache/colibri/bench/bench-a-q8_0.gguf --device opencl
    python benchmarks/device_pipeline.py --model ~/.cache/colibri/bench/bench-a-q8_0.gguf --device opencl \\
        --memory-budget 333M --prefetch lookahead --max-tokens 8

It prefills --prompt-tokens tokens of fixed text, generates --max-tokens greedily, then prints tok/s,
the expert hit rate, the device counters and each pipeline stage's busy seconds and share, and the
seconds stages overlapped (stats()["pipeline"]); --json writes the same to a file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass lamp "
    "and a notebook in which he recorded the weather, the ships that passed and the birds that rested on "
    "the rail. Over forty years he had filled more than two hundred notebooks."
)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import colibri_backend

    options: dict[str, Any] = {"threads": args.threads, "device": args.device, "context_length": 512}
    if args.memory_budget:
        options["memory_budget"] = args.memory_budget
    if args.prefetch:
        options["prefetch"] = args.prefetch
    with colibri_backend.load(args.model, **options) as m:
        ids = (m.tokenize(PROMPT) * 4)[: args.prompt_tokens]
        n = sum(1 for _ in m.generate_tokens(ids, max_tokens=args.max_tokens))
        s = m.stats()
    keys = (
        "device",
        "decode_tokens_per_second",
        "prefill_tokens_per_second",
        "expert_hit_rate",
        "expert_slots",
    )
    out = {k: s[k] for k in keys}
    out["generated"] = n
    out.update({k: v for k, v in s.items() if k.startswith("device_")})
    out["pipeline"] = s["pipeline"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF path or a known model name")
    ap.add_argument("--device", choices=("cpu", "opencl"), default="opencl")
    ap.add_argument("--memory-budget", default=None, help="e.g. 333M (default: the engine's)")
    ap.add_argument("--prefetch", default=None, help="expert predictors, e.g. lookahead (default none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    r = measure(args)
    p = r["pipeline"]
    print(
        f"{r['device']}: decode {r['decode_tokens_per_second']:.2f} tok/s, prefill "
        f"{r['prefill_tokens_per_second']:.2f} tok/s, expert hit rate {r['expert_hit_rate']:.3f}"
    )
    print(
        f"  device jobs {r['device_jobs']}, handed to the CPU {r['device_cpu_jobs']}, errors "
        f"{r['device_errors']}, staged {r['device_staged_bytes'] / 2**20:.1f} MiB, SwiGLU output read back "
        f"{r['device_readback_bytes']} bytes"
    )
    print(f"  span {p['span_seconds']:.2f} s, some stage busy {p['any_busy_seconds']:.2f} s")
    for name, st in p["stages"].items():
        print(f"  {name:8s} busy {st['busy_seconds']:.3f} s ({100 * st['busy_share']:.1f}%)")
    for pair, sec in p["overlap_seconds"].items():
        print(f"  overlap {pair:14s} {sec:.3f} s")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
