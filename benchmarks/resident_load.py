"""Load time and memory of the engine's own copy of resident weights (native/src/resident.c) against an
older library that read them through a map of the file (docs/robustness.md).

For each library (--lib NAME=PATH, repeatable), model and mode, a fresh process drops the model file
from the page cache (posix_fadvise DONTNEED on that file only), loads it (colibri_backend.load), generates
--tokens greedy tokens, and reports: load seconds, seconds to the end of generation, peak RSS (VmHWM),
RssAnon and RssFile after generating, and how much of the file the page cache holds afterwards (fincore).
Modes: resident (memory_budget=0: every expert resident) and streamed (expert_slots=25%).

    python benchmarks/resident_load.py --lib before=/tmp/old/libcolibri.so \\
        --lib after=build/dev/libcolibri.so --model colibri-moe \\
        --model ~/.cache/colibri/bench/bench-a-q8_0.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODES = {"resident": {"memory_budget": 0}, "streamed": {"expert_slots": "25%"}}

CHILD = r"""
import json, os, subprocess, sys, time
path, opts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
import colibri_backend
from colibri_backend.models import resolve_model
gguf = str(resolve_model(path).gguf)
fd = os.open(gguf, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
t0 = time.perf_counter()
m = colibri_backend.load(gguf, threads=2, **opts)
t1 = time.perf_counter()
m.generate("def fibonacci(n):", max_tokens=n)
t2 = time.perf_counter()
fincore = ["fincore", "-b", "-n", "-o", "RES", gguf]
cached = subprocess.run(fincore, capture_output=True, text=True).stdout.split()
print(json.dumps({"load_s": t1 - t0, "load_and_generate_s": t2 - t0, "peak_rss": status("VmHWM"),
                  "rss_anon": status("RssAnon"), "rss_file": status("RssFile"),
                  "file_bytes": os.path.getsize(gguf), "page_cache_bytes": int(cached[0]) if cached else -1}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for model in args.model:
        for mode, opts in MODES.items():
            for _ in range(args.runs):
                for spec in args.lib:  # alternating libraries within each repetition
                    name, _, lib = spec.partition("=")
                    env = dict(os.environ, COLIBRI_LIB=str(Path(lib).resolve()))
                    proc = subprocess.run(
                        [sys.executable, "-c", CHILD, model, json.dumps(opts), str(args.tokens)],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=900,
                    )
                    if proc.returncode != 0:
                        print(f"{name} {model} {mode}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                        return 1
                    row = {
                        "lib": name,
                        "model": Path(model).name,
                        "mode": mode,
                        **json.loads(proc.stdout.splitlines()[-1]),
                    }
                    rows.append(row)
                    mib = 1 << 20
                    print(
                        f"{row['model']:28} {mode:9} {name:7} load {row['load_s']:6.2f} s  "
                        f"load+{args.tokens} tok {row['load_and_generate_s']:6.2f} s  "
                        f"peak RSS {row['peak_rss'] / mib:7.1f} MiB  "
                        f"anon {row['rss_anon'] / mib:7.1f}  file {row['rss_file'] / mib:7.1f}  "
                        f"page cache {row['page_cache_bytes'] / mib:7.1f} MiB",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
