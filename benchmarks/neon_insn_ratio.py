"""Instructions per matrix product of each NEON kernel table against the scalar kernels, counted under qemu.

There is no ARM machine here, and speed under an emulator says nothing about ARM hardware. What qemu can
measure exactly is how many guest instructions a kernel call executes: benchmarks/qemu_insn_count.c (a TCG
plugin, built here with the host's cc) counts them, and native/tools/kernel_repeat.c (cross-compiled in the
aarch64 build) runs one matrix product CALLS times. Each configuration runs twice (1 call and 1 + --repeat
calls); the difference divided by --repeat is one call's instructions, setup excluded.

    cmake -S native -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=native/cmake/aarch64-linux-gnu.cmake
    cmake --build build/aarch64 -j2 --target kernel-repeat
    python benchmarks/neon_insn_ratio.py --build build/aarch64 --json insn.json

The ratio scalar / table is an instruction-count ratio, not a speed-up: a NEON instruction does 4-16 lanes
of work and costs more cycles than a scalar one on some cores, and memory stalls are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_SRC = ROOT / "benchmarks" / "qemu_insn_count.c"
SYSROOT = "/usr/aarch64-linux-gnu"
TABLES = ("scalar", "neon", "neon-dotprod", "neon-i8mm")
TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
    "IQ4_NL",
    "IQ4_XS",
    "MXFP4",
)


def build_plugin(out_dir: Path) -> Path:
    """The counting plugin, compiled for the host."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SystemExit("neon_insn_ratio: a host C compiler (cc) is needed for the qemu plugin")
    so = out_dir / "qemu_insn_count.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(so), str(PLUGIN_SRC)], check=True)
    return so


def count(plugin: Path, exe: Path, cpu: str, args: list[str]) -> int:
    """Guest instructions of one run of exe under qemu-aarch64 -cpu cpu."""
    qemu = shutil.which("qemu-aarch64")
    if not qemu:
        raise SystemExit("neon_insn_ratio: qemu-aarch64 is needed (apt-get install qemu-user)")
    cmd = [qemu, "-cpu", cpu, "-plugin", str(plugin), "-d", "plugin", "-L", SYSROOT, str(exe), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"neon_insn_ratio: {' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("insns ")]
    if len(lines) != 1:
        raise SystemExit(
            f"neon_insn_ratio: no instruction count from the plugin (qemu without plugins?): {r.stderr}"
        )
    return int(lines[0].split()[1])


def per_call(
    plugin: Path, exe: Path, table: str, ty: str, rows: int, cols: int, ntok: int, repeat: int
) -> float:
    shape = [table, ty, str(rows), str(cols), str(ntok)]
    once = count(plugin, exe, "max", [*shape, "1"])
    more = count(plugin, exe, "max", [*shape, str(1 + repeat)])
    return (more - once) / repeat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, default=ROOT / "build" / "aarch64", help="aarch64 build dir")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=1024, help="a multiple of 256")
    ap.add_argument("--ntok", default="1,8", help="token counts, comma-separated (1 = decode)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--repeat", type=int, default=4, help="extra calls in the second run")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = ap.parse_args(argv)
    exe = a.build / "kernel-repeat"
    if not exe.is_file():
        raise SystemExit(
            f"neon_insn_ratio: {exe} is missing (cmake --build {a.build} --target kernel-repeat)"
        )
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    ntoks = [int(n) for n in a.ntok.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        plugin = build_plugin(Path(tmp))
        configs = [(ty, n, table) for ty in types for n in ntoks for table in TABLES]
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            futs = {
                c: pool.submit(per_call, plugin, exe, c[2], c[0], a.rows, a.cols, c[1], a.repeat)
                for c in configs
            }
            insns = {c: f.result() for c, f in futs.items()}
    rows = []
    head = f"{'type':<7} {'ntok':>4} {'scalar insns/call':>18}" + "".join(
        f" {t + ' x':>15}" for t in TABLES[1:]
    )
    print(f"{a.rows} rows x {a.cols} columns; scalar instructions / table instructions per call")
    print(head)
    for ty in types:
        for n in ntoks:
            s = insns[(ty, n, "scalar")]
            ratios = {t: s / insns[(ty, n, t)] for t in TABLES[1:]}
            rows.append(
                {"type": ty, "ntok": n, "insns": {t: insns[(ty, n, t)] for t in TABLES}, "ratio": ratios}
            )
            print(f"{ty:<7} {n:>4} {s:>18.0f}" + "".join(f" {ratios[t]:>15.2f}" for t in TABLES[1:]))
    if a.json:
        a.json.write_text(json.dumps({"rows": a.rows, "cols": a.cols, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
