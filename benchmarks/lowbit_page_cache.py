"""What the low-bit copies leave in the page cache (issue 11 item 5: nothing is cached twice).

Greedy decode with `lowbit_experts` under a memory budget, the sidecar dropped from the page cache first;
per decoded token: the sidecar's pages in the page cache (mincore(2) over a map that touches nothing), the
process's major faults (/proc/self/stat) and the machine's `Cached` (/proc/meminfo: every process counts,
so on a shared machine only a coarse figure). Run it once per library (COLIBRI_LIB) to compare builds.

    COLIBRI_LIB=build/dev/libcolibri.so python benchmarks/lowbit_page_cache.py --model M.gguf
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
from pathlib import Path

import colibri_backend


def cached_pages(path: Path) -> int:
    """Pages of path in the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    c = ctypes
    libc.mmap.restype = c.c_void_p
    libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
    libc.mincore.argtypes = [c.c_void_p, c.c_size_t, c.c_char_p]
    libc.munmap.argtypes = [c.c_void_p, c.c_size_t]
    size = path.stat().st_size
    vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, c.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def major_faults() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[9])


def cached_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1])
    raise RuntimeError("no Cached line in /proc/meminfo")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a GGUF with MODEL.gguf.lowbit beside it")
    ap.add_argument("--budget", type=float, default=0.25, help="memory budget, a share of the file's size")
    ap.add_argument("--weight", type=float, default=0.5, help="lowbit_experts threshold")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    side = Path(f"{args.model}.lowbit")
    fd = os.open(side, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    before_load = cached_pages(side)
    budget = int(args.model.stat().st_size * args.budget)
    model = colibri_backend.load(
        args.model, memory_budget=budget, lowbit_experts=args.weight, context_length=128, threads=args.threads
    )
    try:
        marks: list[tuple[int, int, int, int]] = []
        tokens: list[int] = []
        for tok in model.generate_tokens(list(range(100, 116)), max_tokens=args.decode_tokens):
            tokens.append(tok.token_id)
            marks.append((cached_pages(side), major_faults(), cached_kib(), model.stats()["lowbit_computed"]))
    finally:
        model.close()
    n = max(len(marks) - 1, 1)
    (p0, f0, k0, l0), (p1, f1, k1, l1) = marks[0], marks[-1]
    out = {
        "library": os.environ.get("COLIBRI_LIB", "(installed)"),
        "loadavg": os.getloadavg()[0],
        "sidecar_pages": (side.stat().st_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE,
        "sidecar_pages_cached_before_load": before_load,
        "sidecar_pages_cached_after_first_token": p0,
        "sidecar_pages_cached_at_end": p1,
        "copies_per_token": (l1 - l0) / n,
        "sidecar_pages_cached_per_token": (p1 - p0) / n,
        "major_faults_per_token": (f1 - f0) / n,
        "meminfo_cached_kib_per_token": (k1 - k0) / n,
        "tokens": tokens,  # greedy: the same ids from two builds say the copies computed the same
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
