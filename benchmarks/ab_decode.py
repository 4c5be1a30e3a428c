"""Decode and prefill speed of two or more colibri-run builds on the same files, alternating, fresh processes.

    python benchmarks/ab_decode.py --build base=/path/base/colibri-run --build new=build/bench/colibri-run \
        --model ~/.cache/colibri/bench/bench-a-q4_k_m.gguf --model ~/.cache/colibri/bench/bench-a-q6_k.gguf \
        --rounds 5 --json ab.json

Each round runs every (model, build) pair once, in that order, each a fresh `colibri-run FILE -p PROMPT -n 128
-t 2` process (greedy; `--prompt-file` for -f, `--warmup` for colibri-run's untimed first prompt as
llama-bench has, `--cpus` to pin it with taskset, `--chrt` to run it under SCHED_FIFO 10, which needs
root), and reads the prefill and decode tok/s of its report lines. The machine is shared and noisy, so the
figures are medians with ranges, and the ratios are of medians against the first build. The load average at
each run goes to the JSON beside its figures.
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
# the timed prompt's line; with --warmup an earlier line reports the untimed one after "colibri-run: "
_PREFILL_RE = re.compile(r"^\s*prompt: \d+ tokens in [0-9.]+ s \(([0-9.]+) tok/s\)", re.M)


def run_rates(
    exe: str, model: Path, prompt: list[str], n_gen: int, threads: int, extra: list[str], wrap: list[str]
) -> dict[str, float]:
    """One colibri-run process: its prefill and decode tok/s. prompt: ["-p", TEXT] or ["-f", PATH]."""
    cmd = [*wrap, exe, str(model), *prompt, "-n", str(n_gen), "-t", str(threads), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = proc.stderr + proc.stdout
    decode, prefill = _DECODE_RE.search(text), _PREFILL_RE.search(text)
    if proc.returncode != 0 or decode is None or prefill is None:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    return {"tok_s": float(decode.group(1)), "prefill_tok_s": float(prefill.group(1))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--build", action="append", required=True, help="NAME=PATH of a colibri-run (first = base)"
    )
    ap.add_argument("--model", action="append", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default="Hello there, this is")
    ap.add_argument("--prompt-file", type=Path, default=None, help="colibri-run -f PATH instead of --prompt")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", action="store_true", help="pass --warmup (an untimed first prompt)")
    ap.add_argument("--cpus", default=None, help="pin each process to these CPUs (taskset -c LIST)")
    ap.add_argument("--chrt", action="store_true", help="run each process under chrt -f 10 (root)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    builds = [b.split("=", 1) for b in args.build]
    if any(len(b) != 2 for b in builds):
        ap.error("--build takes NAME=PATH")
    prompt = ["-f", str(args.prompt_file)] if args.prompt_file else ["-p", args.prompt]
    extra = ["--warmup"] if args.warmup else []
    wrap = (["taskset", "-c", args.cpus] if args.cpus else []) + (["chrt", "-f", "10"] if args.chrt else [])
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for r in range(args.rounds):
        for model in args.model:
            for name, exe in builds:
                rates = run_rates(exe, model, prompt, args.n_gen, args.threads, extra, wrap)
                load = os.getloadavg()[0]
                runs.setdefault(model.name, {}).setdefault(name, []).append({**rates, "load": load})
                print(
                    f"round {r} {model.name} {name}: decode {rates['tok_s']:.1f} tok/s, prefill "
                    f"{rates['prefill_tok_s']:.1f} tok/s (load {load:.1f})",
                    flush=True,
                )
    summary = []
    for model_name, by_build in runs.items():
        base: dict[str, float] = {}
        for name, _ in builds:
            row: dict = {"model": model_name, "build": name}
            for key, prefix in (("tok_s", ""), ("prefill_tok_s", "prefill_")):
                vals = [x[key] for x in by_build[name]]
                med = statistics.median(vals)
                base.setdefault(key, med)
                row.update(
                    {
                        f"{prefix}median": med,
                        f"{prefix}min": min(vals),
                        f"{prefix}max": max(vals),
                        f"{prefix}ratio": med / base[key],
                    }
                )
            summary.append(row)
    for row in summary:
        print(
            f"{row['model']:28s} {row['build']:8s} decode {row['median']:7.1f} "
            f"({row['min']:.1f}-{row['max']:.1f})  {row['ratio']:.2f}x  prefill {row['prefill_median']:7.1f} "
            f"({row['prefill_min']:.1f}-{row['prefill_max']:.1f})  {row['prefill_ratio']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps({"builds": dict(builds), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
