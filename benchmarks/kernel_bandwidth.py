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

With --compare (one or more JSON files of benchmarks/llama_bench_compare.py) it reports the roofline of
whole decode steps instead. The machine's read bandwidth comes from native/tools/bench_bandwidth.c (the
`bench-bandwidth` tool): a buffer of --read-mib MiB (four times the reference machine's last-level cache)
on transparent huge pages, as the resident weight copy is, summed by --threads threads; the median of
--read-runs runs reading the whole buffer per pool_run is the roofline, and the same read in 2.75 MiB
chunks, one pool_run per chunk as the decode loop runs one per matrix, is printed next to it. The bytes of
weights one decoded token reads come from the file's tensor sizes: every tensor outside the routed experts
(attention, norms, router, shared experts, output head), top-k of the n routed experts of each layer
(k / n of each expert tensor) and one row of the token embedding (all of it where the head is tied to it).
The KV cache's reads are left out (128 positions of a few layers). The share is bytes per token x decode
tok/s / read bandwidth, for each engine:

    python benchmarks/kernel_bandwidth.py --compare bench-a.json bench-b.json --threads 2 \\
        --json benchmarks/results/roofline.json
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


def build_tool(build_dir: Path, target: str = "bench-kernels") -> Path:
    """Configure and build a native tool (Release, no tests); returns the executable's path."""
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
        ["cmake", "--build", str(build_dir), "--target", target, "-j2"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return build_dir / target


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


READ_LINE = re.compile(
    r"^read (?P<mib>\d+) MiB chunk (?P<chunk>\d+) KiB thr=(?P<thr>\d+) pages=(?P<pages>\w+) "
    r"median (?P<gbs>[\d.]+) GB/s best (?P<best>[\d.]+) GB/s per CPU-s (?P<cpu>[\d.]+) GB/s"
)


def read_bandwidth(tool: Path, mib: int, chunk_kib: int, threads: int, thp: bool, seconds: float) -> dict:
    """One bench-bandwidth run: GB/s median, best and per CPU-second of a streaming read."""
    cmd = [str(tool), "--mib", str(mib), "--chunk-kib", str(chunk_kib), "--threads", str(threads)]
    cmd += ["--seconds", str(seconds)] + (["--thp"] if thp else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = READ_LINE.search(out)
    if m is None:
        raise RuntimeError(f"no result parsed from {' '.join(cmd)}:\n{out}")
    return {
        "command": cmd,
        "mib": int(m["mib"]),
        "chunk_kib": int(m["chunk"]),
        "threads": int(m["thr"]),
        "pages": m["pages"],
        "gb_s": float(m["gbs"]),
        "best_gb_s": float(m["best"]),
        "per_cpu_s_gb_s": float(m["cpu"]),
    }


def decode_bytes(path: Path) -> dict:
    """Bytes of weights one decoded token reads, from the GGUF's tensor sizes, in all and per tensor type:
    every tensor outside the routed experts, k / n of each routed-expert tensor (top-k of n experts) and
    one row of the token embedding, or all of it when no output.weight exists (the head is tied to it)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    n_expert = int(r.fields[f"{arch}.expert_count"].contents()) if f"{arch}.expert_count" in r.fields else 0
    k = int(r.fields[f"{arch}.expert_used_count"].contents()) if n_expert else 0
    names = {t.name for t in r.tensors}
    total, by_type = 0, {}
    for t in r.tensors:
        nb = int(t.n_bytes)
        if "_exps." in t.name and n_expert:
            nb = nb * k // n_expert
        elif t.name == "token_embd.weight" and "output.weight" in names:
            nb //= int(t.shape[-1])  # one row of n_vocab
        total += nb
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + nb
    return {"bytes": total, "by_type": by_type, "experts": n_expert, "top_k": k}


def roofline(compare: list[dict], read_gb_s: float) -> list[dict]:
    """Per file and mode of llama_bench_compare's summaries: bytes per token and each engine's share."""
    cells, sizes = [], {}
    for doc in compare:
        paths = {r["model"]: r["path"] for r in doc["runs"]}
        for row in doc["summary"]:
            path = paths[row["model"]]
            if path not in sizes:
                sizes[path] = decode_bytes(Path(path))
            cell = {"model": row["model"], "mode": row["mode"], "bytes_per_token": sizes[path]["bytes"]}
            for engine, e in row["engines"].items():
                tps = e["decode_tps"]
                gbs = sizes[path]["bytes"] * tps * 1e-9 if tps else None
                cell[engine] = {
                    "decode_tps": tps,
                    "gb_s": gbs,
                    "share": gbs / read_gb_s if gbs else None,
                }
            cells.append(cell)
    return cells


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
    ap.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        default=None,
        help="llama_bench_compare.py JSON files: report the decode roofline of their cells instead",
    )
    ap.add_argument("--read-mib", type=int, default=2048, help="bench-bandwidth's buffer (MiB)")
    ap.add_argument("--read-chunk-kib", type=int, default=2816, help="bench-bandwidth's chunk (KiB)")
    ap.add_argument("--read-runs", type=int, default=3, help="bench-bandwidth runs per kind (median)")
    ap.add_argument(
        "--read-gb-s", type=float, default=None, help="a read bandwidth measured before: skip bench-bandwidth"
    )
    args = ap.parse_args(argv)
    if args.threads < 1 or args.seconds <= 0:
        ap.error("--threads must be >= 1 and --seconds > 0")
    if args.compare:
        return main_roofline(args)

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


def main_roofline(args: argparse.Namespace) -> int:
    compare = [json.loads(p.read_text()) for p in args.compare]
    reads: list[dict] = []
    if args.read_gb_s is None:
        tool = build_tool(args.build_dir, "bench-bandwidth")
        # alternating: the whole buffer per pool_run (the streaming bound, the roofline) and one pool_run
        # per --read-chunk-kib (the decode loop's hand-offs), both on huge pages
        for _ in range(args.read_runs):
            for chunk in (0, args.read_chunk_kib):
                reads.append(read_bandwidth(tool, args.read_mib, chunk, args.threads, True, 4 * args.seconds))
        for chunk in (0, args.read_chunk_kib):
            vals = sorted(r["gb_s"] for r in reads if r["chunk_kib"] == chunk)
            what = "in one pool_run per pass" if chunk == 0 else f"in {chunk} KiB chunks"
            print(
                f"read bandwidth, {args.read_mib} MiB {what}, {args.threads} threads, huge pages: "
                f"median of {len(vals)} {vals[len(vals) // 2]:.1f} GB/s ({vals[0]:.1f}–{vals[-1]:.1f})"
            )
        streaming = sorted(r["gb_s"] for r in reads if r["chunk_kib"] == 0)
        read_gb_s = streaming[len(streaming) // 2]
    else:
        read_gb_s = args.read_gb_s
    cells = roofline(compare, read_gb_s)
    print(f"roofline at {read_gb_s:.1f} GB/s")
    engines = "llama-bench tok/s | GB/s | share | colibri-run tok/s | GB/s | share"
    print(f"| model | mode | MB / token | {engines} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        cols = []
        for engine in ("llama_bench", "colibri_run"):
            e = c[engine]
            if e["decode_tps"]:
                cols.append(f"{e['decode_tps']:.1f} | {e['gb_s']:.1f} | {100 * e['share']:.0f}%")
            else:
                cols.append("– | – | –")
        print(f"| {c['model']} | {c['mode']} | {c['bytes_per_token'] / 1e6:.1f} | {cols[0]} | {cols[1]} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": sys.argv, "read": reads, "read_gb_s": read_gb_s, "cells": cells}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
