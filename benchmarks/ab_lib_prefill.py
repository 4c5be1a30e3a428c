"""Two builds of libcolibri on one model: teacher-forced prefill time, and whether the logits are equal.

    python benchmarks/ab_lib_prefill.py --old /tmp/main/build/libcolibri.so --new build/bench/libcolibri.so \
        --model bench-deepseek2 --tokens 64 --reps 5 --rounds 2

For a change meant to be bit-identical and faster (an architecture's hot path). Each round runs the old
and then the new library in a fresh process (COLIBRI_LIB), which evaluates the same `--tokens`-token
prompt `--reps` times on a fresh sequence (`LoadedModel.logits`: every position's logits) and reports the
fastest repetition: the one least disturbed by other jobs, so the figure means something on a shared
machine too (the slowest is printed beside it). The last round's logits of both are compared bit for bit.

With `--decode N` each repetition then appends N more tokens of the same text one at a time
(`LoadedModel.next_logits`, one decode step each); the figures are then per decode step (the fastest and
the median over all steps of all repetitions), and the logits compared are the N steps' of the last
repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import prompt_ids, resolve_model  # noqa: E402
from make_bench_models import DEFAULT_CACHE_DIR  # noqa: E402

_CHILD = """
import json, sys, time
import numpy as np
import colibri_backend
path, ids, reps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
n_decode = int(sys.argv[6])
n_prompt = len(ids) - n_decode
with colibri_backend.load(path, threads=int(sys.argv[5])) as m:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits = m.logits(ids[:n_prompt])
        if n_decode:
            steps = []
            for k in range(n_prompt + 1, len(ids) + 1):
                t0 = time.perf_counter()
                steps.append(m.next_logits(ids[:k]))
                times.append(time.perf_counter() - t0)
            logits = np.stack(steps)
        else:
            times.append(time.perf_counter() - t0)
np.save(out, logits)
print(json.dumps(times))
"""


def run_one(
    lib: Path, model: Path, ids: list[int], reps: int, threads: int, out: Path, n_decode: int = 0
) -> list[float]:
    """The child's times: one per repetition, or one per decode step with n_decode (the last n_decode ids)."""
    env = {**os.environ, "COLIBRI_LIB": str(lib)}
    args = [sys.executable, "-c", _CHILD, str(model), json.dumps(ids), str(reps), str(out), str(threads)]
    args.append(str(n_decode))
    p = subprocess.run(args, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{lib}: {(p.stderr.strip().splitlines() or [f'exit {p.returncode}'])[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the reference libcolibri.so")
    ap.add_argument("--new", type=Path, required=True, help="the changed libcolibri.so")
    ap.add_argument("--model", required=True, help="a bench model's name or a GGUF path")
    ap.add_argument("--bench-type", default="q8_0")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=0, help="then time this many single-token decode steps")
    args = ap.parse_args(argv)
    for lib in (args.old, args.new):
        if not lib.is_file():
            ap.error(f"{lib} does not exist")
    if min(args.tokens, args.reps, args.rounds, args.threads) < 1 or args.decode < 0:
        ap.error("--tokens, --reps, --rounds and --threads must be at least 1, --decode at least 0")
    label, model = resolve_model(args.model, args.cache_dir, args.bench_type)
    ids = prompt_ids(model, args.tokens + args.decode)
    what = f"decode step after {args.tokens} tokens" if args.decode else f"{args.tokens}-token prefill"
    per = 1 if args.decode else len(ids)
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, lib in (("old", args.old), ("new", args.new)):
                out = Path(tmp) / f"{name}.npy"
                times = run_one(lib, model, ids, args.reps, args.threads, out, args.decode)
                best[name] = min(best.get(name, float("inf")), min(times))
                print(
                    f"{label} round {r + 1} {name}: fastest {min(times) * 1e3:.1f} ms "
                    f"({per / min(times):.1f} tok/s), median {float(np.median(times)) * 1e3:.1f} ms, "
                    f"slowest {max(times) * 1e3:.1f} ms",
                    flush=True,
                )
        same = np.array_equal(np.load(Path(tmp) / "old.npy"), np.load(Path(tmp) / "new.npy"))
    print(
        f"{label}: {what}, fastest of all: old {best['old'] * 1e3:.1f} ms, "
        f"new {best['new'] * 1e3:.1f} ms ({best['old'] / best['new']:.2f}x); logits bit-identical: {same}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
