"""`colibri quantize IN.gguf OUT.gguf --type TYPE [--imatrix FILE] [--threads N] [--allow-requantize]
[--lowbit-sidecar q2_k|iq4_xs] [--expert-outliers F [--outlier-corpus TEXT]]`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from types import FrameType

_TYPES_HELP = (
    "q8_0, q6_k, q5_k_m, q5_k_s, q4_k_m, q4_k_s, q3_k_l, q3_k_m, q3_k_s, q2_k, iq4_xs, iq4_nl, "
    "q5_1, q5_0, q4_1, q4_0, mxfp4, f16, bf16, f32"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="quantize a GGUF file (llama.cpp's type mixes: q4_k_m, q6_k, iq4_xs, ...)",
        description="Quantize an F32/F16/BF16 GGUF to a llama.cpp type mix. Each tensor's type follows "
        "llama.cpp's rules for the mix (router, norms and vectors keep their type; attn_v, ffn_down, output "
        "and the first/last layers' sensitive tensors get more bits where the mix says so). The output "
        "loads in Colibri and in llama.cpp. It is written to a temporary file and renamed when complete.",
    )
    p.add_argument("input", metavar="IN.gguf", help="source GGUF (F32, F16 or BF16 weights)")
    p.add_argument("output", metavar="OUT.gguf", help="quantized GGUF to write")
    p.add_argument("--type", dest="qtype", required=True, metavar="TYPE", help=f"target mix: {_TYPES_HELP}")
    p.add_argument(
        "--imatrix",
        metavar="FILE",
        help="importance matrix from `colibri imatrix` or llama.cpp's llama-imatrix (GGUF or legacy .dat)",
    )
    p.add_argument("--threads", type=int, default=None, metavar="N", help="worker threads (default: all)")
    p.add_argument(
        "--allow-requantize",
        action="store_true",
        help="accept an input whose weights are already quantized (the errors of both quantizations add up)",
    )
    p.add_argument(
        "--lowbit-sidecar",
        choices=("q2_k", "iq4_xs"),
        type=str.lower,
        default=None,
        metavar="TYPE",
        help="also write OUT.gguf.lowbit: every routed expert at q2_k or iq4_xs, for the lossy "
        "--lowbit-experts W load option (docs/memory.md)",
    )
    p.add_argument(
        "--expert-outliers",
        type=float,
        default=0.0,
        metavar="F",
        help="lossy, opt-in: keep the fraction F (0 < F <= 0.25, e.g. 0.01) of every routed expert's input "
        "columns with the largest importance x weight energy exact to F16, as extra colibri_outlier tensors; "
        "the file then loads in Colibri only (docs/memory.md)",
    )
    p.add_argument(
        "--outlier-corpus",
        default=None,
        metavar="TEXT",
        help="the calibration text behind --imatrix, recorded as colibri.outliers.corpus",
    )
    p.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from colibri_backend.quantize import quantize

    src, dst = Path(args.input), Path(args.output)
    if not src.is_file():
        raise FileNotFoundError(f"input model {src} does not exist")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if not (0.0 <= args.expert_outliers <= 0.25):  # NaN fails too
        raise ValueError(f"--expert-outliers must be in (0, 0.25] (0: off), got {args.expert_outliers}")
    bar = None
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=src.stat().st_size, unit="B", unit_scale=True, desc=f"quantize {dst.name}")

    stop: list[int] = []

    def progress(done: int, total: int, tensor: str) -> None:
        if stop:
            raise KeyboardInterrupt  # the engine cancels and removes its temporary file
        if bar is not None:
            bar.total = total
            bar.n = done
            bar.set_postfix_str(tensor, refresh=False)
            bar.refresh()

    def terminate(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)  # acted on at the next progress call, inside the engine's callback

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        quantize(
            src,
            dst,
            args.qtype,
            imatrix=args.imatrix,
            threads=args.threads or os.cpu_count() or 1,
            allow_requantize=args.allow_requantize,
            progress=progress,
            expert_outliers=args.expert_outliers,
            outlier_corpus=args.outlier_corpus,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
        if bar is not None:
            bar.close()
    size = dst.stat().st_size
    print(f"wrote {dst} ({size / 2**20:.1f} MiB, {args.qtype.lower()})", file=sys.stderr)
    if args.lowbit_sidecar:
        from colibri_backend.quantize import write_lowbit_sidecar

        side = write_lowbit_sidecar(dst, args.lowbit_sidecar, threads=args.threads)
        print(f"wrote {side} ({side.stat().st_size / 2**20:.1f} MiB, {args.lowbit_sidecar})", file=sys.stderr)
    return 0
