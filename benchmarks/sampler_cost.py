"""What the native sampler costs per token, by sampling setting, on a vocabulary of real size.

    python benchmarks/sampler_cost.py                              # the installed library
    python benchmarks/sampler_cost.py --libs OLD.so,NEW.so --rounds 5   # two builds, alternating

Each measurement is a fresh process that draws --calls tokens from rows of random logits (normal, scale 3,
--vocab entries: SmolLM2's 49,152 by default) with one setting after another: greedy, temperature alone,
top-k 40, top-p 0.95, and llama.cpp's server defaults (top-k 40, top-p 0.95, min-p 0.05). Reported: the
median over --rounds of the microseconds per call, and its range; with --libs the rounds alternate
between the libraries (COLIBRI_LIB) and the last column is the first library's time over the second's.
A decode step of a small model takes a few milliseconds, so a sampler at several hundred microseconds
is a tenth of it, and in a batched server every request's sampler runs between two steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "top-k 40": {"temperature": 0.8, "top_k": 40},
    "top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "k 40, p 0.95, min-p 0.05": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}


def measure(vocab: int, calls: int) -> dict[str, float]:
    """Microseconds per sample call for each setting, in this process's library."""
    import time

    import numpy as np

    from colibri_backend import _native
    from colibri_backend.adapters.sampling import SamplingParams
    from colibri_backend.engine import _NativeSampler

    lib = _native.load_library()
    rows = (np.random.default_rng(0).standard_normal((64, vocab)) * 3).astype(np.float32)
    out = {}
    for name, params in SETTINGS.items():
        with _NativeSampler(lib, SamplingParams(seed=1, **params), vocab, []) as sampler:
            for i in range(8):  # warm the caches and the branch predictors
                sampler.sample(rows[i])
            t = time.perf_counter()
            for i in range(calls):
                sampler.sample(rows[i % len(rows)])
            out[name] = 1e6 * (time.perf_counter() - t) / calls
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default=None, help="libcolibri.so files to compare, comma-separated")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.vocab, args.calls)))
        return 0
    libs = args.libs.split(",") if args.libs else [os.environ.get("COLIBRI_LIB", "")]
    runs: dict[str, list[dict[str, float]]] = {lib: [] for lib in libs}
    for _ in range(args.rounds):
        for lib in libs:
            env = dict(os.environ, COLIBRI_LIB=lib) if lib else dict(os.environ)
            cmd = [sys.executable, __file__, "--child", "--vocab", str(args.vocab)]
            cmd += ["--calls", str(args.calls)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[lib].append(json.loads(done.stdout.strip().splitlines()[-1]))
    names = [lib or "installed" for lib in libs]
    head = "| setting | " + " | ".join(f"{n}: us / call (range)" for n in names)
    print(head + (" | first / second |" if len(libs) == 2 else " |"))
    print("|---" * (len(libs) + 1 + (len(libs) == 2)) + "|")
    for setting in SETTINGS:
        meds = []
        cells = [setting]
        for lib in libs:
            vals = [r[setting] for r in runs[lib]]
            meds.append(statistics.median(vals))
            cells.append(f"{meds[-1]:.0f} ({min(vals):.0f}-{max(vals):.0f})")
        if len(libs) == 2:
            cells.append(f"{meds[0] / meds[1]:.2f}x")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
