"""What the native sampler costs per token, by sampling setting, on a vocabulary of real size.

    python benchmarks/sampler_cost.py                              # the installed library
    python benchmarks/sampler_cost.py --libs OLD.so,NEW.so --rounds 5   # two builds, alternating
    python benchmarks/sampler_cost.py --libs OLD.so,NEW.so --model smollm2   # and what decode gains

Each measurement is a fresh process that draws --calls tokens from rows of random logits (normal, scale 3,
--vocab entries: SmolLM2's 49,152 by default) with one setting after another: greedy, temperature alone,
top-k 40, top-p 0.95, and llama.cpp's server defaults (top-k 40, top-p 0.95, min-p 0.05). Reported: the
median over --rounds of the microseconds per call (the rows without "tok/s"), and its range; with --libs
the rounds alternate between the libraries (COLIBRI_LIB) and the last column is the first library's
figure over the second's.
A decode step of a small model takes a few milliseconds, so a sampler at several hundred microseconds
is a tenth of it, and in a batched server every request's sampler runs between two steps. --model M
adds a row per setting of decode tok/s of M (a known name or a GGUF; 128 tokens after a short prompt,
2 threads, through Model.generate_tokens: the engine's step and the sampler, as a user's loop runs them).
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


def decode_speed(model_name: str) -> dict[str, float]:
    """Decode tok/s of the model under each setting (the same prompt and seed every time)."""
    import time

    import colibri_backend
    from colibri_backend.adapters.sampling import SamplingParams

    out = {}
    with colibri_backend.load(model_name, threads=2) as model:
        ids = model.tokenize("Write a long story about the history of the printing press.")
        never_stop = {t: float("-inf") for t in model.tokenizer.stop_token_ids}  # always 128 tokens
        for name, params in SETTINGS.items():
            sp = SamplingParams(seed=1, logit_bias=never_stop, **params)
            stamps = []
            for _ in range(2):  # the first pass warms the caches and fills the prefix cache
                stamps = []
                for _ev in model.generate_tokens(ids, max_tokens=129, sampling=sp, stop=None, logprobs=None):
                    stamps.append(time.perf_counter())
            out[f"decode tok/s, {name}"] = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default=None, help="libcolibri.so files to compare, comma-separated")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="also decode tok/s of this model under each setting")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        figures = measure(args.vocab, args.calls)
        if args.model:
            figures |= decode_speed(args.model)
        print(json.dumps(figures))
        return 0
    libs = args.libs.split(",") if args.libs else [os.environ.get("COLIBRI_LIB", "")]
    runs: dict[str, list[dict[str, float]]] = {lib: [] for lib in libs}
    for _ in range(args.rounds):
        for lib in libs:
            env = dict(os.environ, COLIBRI_LIB=lib) if lib else dict(os.environ)
            cmd = [sys.executable, __file__, "--child", "--vocab", str(args.vocab)]
            cmd += ["--calls", str(args.calls)] + (["--model", args.model] if args.model else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed (COLIBRI_LIB={lib}):\n{done.stderr}")
            runs[lib].append(json.loads(done.stdout.strip().splitlines()[-1]))
    names = [lib or "installed" for lib in libs]
    head = "| setting | " + " | ".join(f"{n}: median (range)" for n in names)
    print(head + (" | first / second |" if len(libs) == 2 else " |"))
    print("|---" * (len(libs) + 1 + (len(libs) == 2)) + "|")
    for setting in runs[libs[0]][0]:
        meds = []
        cells = [setting]
        for lib in libs:
            vals = [r[setting] for r in runs[lib]]
            meds.append(statistics.median(vals))
            cells.append(f"{meds[-1]:.1f} ({min(vals):.1f}-{max(vals):.1f})")
        if len(libs) == 2:
            cells.append(f"{meds[0] / meds[1]:.2f}x")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
