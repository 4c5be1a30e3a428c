"""Weight bandwidth of the matrix kernels per tensor type, next to a plain read of the same bytes.

Builds native/tools/bench_kernels.c (the `bench-kernels` tool) in its own CMake build folder and runs it on
the two bench expert shapes (2816x1024 gate/up and 1024x2816 down) for every type named:

  decode   n_tok = 1: GB/s of weight bytes, each call on a different copy of the matrix out of a ring larger
           than the last-level cache, against the same threads summing the same bytes (the roofline); the
           share is kernel GB/s / read GB/s;
  prefill  n_tok = 64 (with --prefill): GFLOP/s (2 * rows * cols * n_tok per call).

Each figure is the median of 15 timed repetitions (bench-kernels prints best and per-CPU-second figures
too). Run it on a quiet machine: on a loaded one the plain read and the kernels are preempted differently.

    python benchmarks/kernel_bandwidth.py --types Q4_K,Q5_K,Q6_K,IQ4_XS,Q8_0 --threads 2 --prefill \\
        --json benchmarks/results/kernel-bandwidth.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(
    r"^(?P<backend>\w+)\s+(?P<type>\w+)\s+(?P<rows>\d+)x(?P<cols>\d+)\s+n_tok=(?P<ntok>\d+)\s+thr=(?P<thr>\d+)"
    r"\s+median\s+(?P<us>[\d.]+) us\s+(?P<gbs>[\d.]+) GB/s\s+(?P<gflops>[\d.]+) GFLOP/s"
    r" \| best\s+(?P<best>[\d.]+) GB/s\s+[\d.]+ GFLOP/s \| per CPU-s\s+[\d.]+ GB/s"
    r"(?: \| plain read\s+(?P<read>[\d.]+) GB/s \(\s*\d+%\))?\s+\((?P<what>[^)]*)\)\s*$"
)


def build_tool(build_dir: Path) -> Path:
    """Configure and build bench-kernels (Release, no tests); returns the executable's path."""
    subprocess.run(
        [
            "cmake",
            "-S",
            str(REPO / "native"),
            "-B",
            str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DCOLIBRI_BUILD_TESTS=OFF",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(build_dir), "--target", "bench-kernels", "-j2"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return build_dir / "bench-kernels"


def run_tool(
    tool: Path, types: str, threads: int, ntok: int, backend: str | None, seconds: float
) -> list[dict]:
    cmd = [
        str(tool),
        "--types",
        types,
        "--threads",
        str(threads),
        "--ntok",
        str(ntok),
        "--seconds",
        str(seconds),
    ]
    cmd += ["--backend", backend or "best"]  # bench-kernels alone runs every kernel set
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        rows.append(
            {
                "backend": m["backend"],
                "type": m["type"],
                "shape": f"{m['rows']}x{m['cols']}",
                "n_tok": int(m["ntok"]),
                "threads": int(m["thr"]),
                "median_us": float(m["us"]),
                "gb_s": float(m["gbs"]),
                "gflop_s": float(m["gflops"]),
                "best_gb_s": float(m["best"]),
                "read_gb_s": float(m["read"]) if m["read"] else None,
                "what": m["what"],
            }
        )
    if not rows:
        raise RuntimeError(f"no results parsed from {' '.join(cmd)}:\n{out}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,IQ4_XS,Q8_0", help="comma-separated GGUF type names")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--backend", default=None, help="scalar, avx2 or avx512 (default: the best this CPU runs)"
    )
    ap.add_argument("--seconds", type=float, default=1.5, help="timed seconds per figure")
    ap.add_argument("--prefill", action="store_true", help="also measure n_tok = 64")
    ap.add_argument("--build-dir", type=Path, default=REPO / "build" / "kernel-bench")
    ap.add_argument("--tool", type=Path, default=None, help="an existing bench-kernels executable")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.seconds <= 0:
        ap.error("--threads must be >= 1 and --seconds > 0")

    tool = args.tool or build_tool(args.build_dir)
    if not os.access(tool, os.X_OK):
        ap.error(f"{tool} is not an executable")
    results = run_tool(tool, args.types, args.threads, 1, args.backend, args.seconds)
    if args.prefill:
        results += run_tool(tool, args.types, args.threads, 64, args.backend, args.seconds)

    head = f"{'backend':7} {'type':7} {'shape':10} {'n_tok':>5} {'thr':>3}"
    print(f"{head} {'GB/s':>6} {'read':>6} {'share':>5} {'GFLOP/s':>8}")
    for r in results:
        decode = r["n_tok"] == 1 and r["read_gb_s"]
        gbs = f"{r['gb_s']:6.1f}" if r["n_tok"] == 1 else "     -"
        read = f"{r['read_gb_s']:6.1f}" if decode else "     -"
        share = f"{100 * r['gb_s'] / r['read_gb_s']:4.0f}%" if decode else "    -"
        head = f"{r['backend']:7} {r['type']:7} {r['shape']:10} {r['n_tok']:5d} {r['threads']:3d}"
        print(f"{head} {gbs} {read} {share} {r['gflop_s']:8.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
