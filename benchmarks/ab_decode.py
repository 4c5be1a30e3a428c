"""Decode speed of two or more colibri-run builds on the same files, alternating, fresh processes.

    python benchmarks/ab_decode.py --build base=/path/base/colibri-run --build new=build/bench/colibri-run \
        --model ~/.cache/colibri/bench/bench-a-q4_k_m.gguf --model ~/.cache/colibri/bench/bench-a-q6_k.gguf \
        --rounds 5 --json ab.json

Each round runs every (model, build) pair once, in that order, each a fresh `colibri-run FILE -p PROMPT -n 128
-t 2` process (greedy; `--chrt` runs it under SCHED_FIFO 10, which needs root), and reads the decode tok/s of
its report line. The machine is shared and noisy, so the figures are medians with ranges, and the ratio is of
medians against the first build. The load average at each run goes to the JSON beside its figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

_DECODE_RE = re.compile(r"decode ([0-9.]+) tok/s")


def decode_rate(exe: str, model: Path, prompt: str, n_gen: int, threads: int, chrt: bool) -> float:
    cmd = [exe, str(model), "-p", prompt, "-n", str(n_gen), "-t", str(threads)]
    if chrt:
        cmd = ["chrt", "-f", "10", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = _DECODE_RE.search(proc.stderr + proc.stdout)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--build", action="append", required=True, help="NAME=PATH of a colibri-run (first = base)"
    )
    ap.add_argument("--model", action="append", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default="Hello there, this is")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chrt", action="store_true", help="run each process under chrt -f 10 (root)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    builds = [b.split("=", 1) for b in args.build]
    if any(len(b) != 2 for b in builds):
        ap.error("--build takes NAME=PATH")
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for r in range(args.rounds):
        for model in args.model:
            for name, exe in builds:
                rate = decode_rate(exe, model, args.prompt, args.n_gen, args.threads, args.chrt)
                load = os.getloadavg()[0]
                runs.setdefault(model.name, {}).setdefault(name, []).append({"tok_s": rate, "load": load})
                print(f"round {r} {model.name} {name}: {rate:.1f} tok/s (load {load:.1f})", flush=True)
    summary = []
    for model_name, by_build in runs.items():
        base_median = None
        for name, _ in builds:
            rates = [x["tok_s"] for x in by_build[name]]
            med = statistics.median(rates)
            base_median = med if base_median is None else base_median
            summary.append(
                {
                    "model": model_name,
                    "build": name,
                    "median": med,
                    "min": min(rates),
                    "max": max(rates),
                    "ratio": med / base_median,
                }
            )
    for row in summary:
        print(
            f"{row['model']:28s} {row['build']:8s} {row['median']:7.1f} ({row['min']:.1f}-{row['max']:.1f})"
            f"  {row['ratio']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps({"builds": dict(builds), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
