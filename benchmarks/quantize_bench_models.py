"""Quantize the F16 bench models into the files users download: llama.cpp's own quantizer
(llama_cpp.llama_model_quantize, its default mix rules) and, with --colibri, Colibri's `colibri quantize`.

    python benchmarks/make_bench_models.py --out-type f16          # once: bench-a-f16.gguf, bench-b-f16.gguf
    python benchmarks/quantize_bench_models.py --types q4_k_m,q6_k,q5_k_m,iq4_xs
    python benchmarks/bench.py --models bench-a,bench-b --bench-type q4_k_m      # then benchmark them

Writes `bench-X-<type>.gguf` (llama.cpp's quantizer; what bench.py --bench-type reads) and, with --colibri,
`bench-X-<type>-colibri.gguf` beside the F16 files. Existing outputs newer than their source are kept
(--force redoes them). Each file is written to a temporary name and renamed, so an interrupted run leaves
no partial file.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_bench_models import DEFAULT_CACHE_DIR, gguf_path  # noqa: E402


def llama_quantize(src: Path, dst: Path, qtype: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params.nthread = threads
    tmp = dst.with_name(dst.name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize({src.name} -> {qtype}) failed with {rc}")
    os.replace(tmp, dst)


def colibri_quantize(src: Path, dst: Path, qtype: str, threads: int) -> None:
    # colibri quantize writes to a temporary name itself and renames at the end
    cmd = ["colibri", "quantize", str(src), str(dst), "--type", qtype, "--threads", str(threads)]
    subprocess.run(cmd, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bench-a,bench-b")
    ap.add_argument("--types", default="q4_k_m,q6_k,q5_k_m,iq4_xs")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--colibri", action="store_true", help="also quantize with `colibri quantize`")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    for name in args.models.split(","):
        src = gguf_path(args.cache_dir, name, "f16")
        if not src.is_file():
            raise SystemExit(f"{src} is missing: python benchmarks/make_bench_models.py --out-type f16")
        for qtype in args.types.split(","):
            jobs = [(gguf_path(args.cache_dir, name, qtype), llama_quantize)]
            if args.colibri:
                jobs.append((args.cache_dir / f"{name}-{qtype}-colibri.gguf", colibri_quantize))
            for dst, quantize in jobs:
                if dst.is_file() and dst.stat().st_mtime > src.stat().st_mtime and not args.force:
                    print(f"{dst.name}: up to date")
                    continue
                t0 = time.perf_counter()
                quantize(src, dst, qtype, args.threads)
                print(f"{dst.name}: {dst.stat().st_size / 1e9:.3f} GB in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
