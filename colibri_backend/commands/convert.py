"""`colibri convert HF_DIR -o OUT.gguf --type TYPE`: Hugging Face checkpoint -> GGUF (f32, f16, q8_0, q4_0).

Any `colibri quantize` type (q4_k_m, q6_k, iq4_xs, ...) converts to F32 in a temporary file beside the
output, then quantizes it with the engine's quantizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from colibri_backend.convert import OUT_TYPES

    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint directory to a GGUF file",
        description="Convert a Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json) into a "
        "GGUF file that runs in Colibri and in llama.cpp. Architectures: llama, mixtral, qwen2_moe, "
        "qwen3_moe, olmoe, granitemoe.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="output GGUF path")
    p.add_argument(
        "--type",
        dest="out_type",
        default="f16",
        help=f"tensor type of the weight matrices: {', '.join(OUT_TYPES)}, or any `colibri quantize` type "
        "such as q4_k_m (norms and routers stay F32; default: f16)",
    )
    p.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    p.set_defaults(func=run)


def _convert_quantized(src: Path, out: Path, qtype: str, show: bool) -> Path:
    """Convert to F32 in a temporary file beside `out`, quantize it to `qtype`, remove the temporary."""
    import os

    from colibri_backend.convert import OUT_TYPES, convert
    from colibri_backend.quantize import quantize, quantize_types

    if qtype not in quantize_types():
        raise ValueError(f"unknown --type {qtype!r}; choose one of {', '.join(OUT_TYPES + quantize_types())}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.f32-{os.getpid()}.gguf")
    try:
        convert(src, tmp, out_type="f32", progress=show)
        return quantize(tmp, out, qtype, threads=os.cpu_count() or 1)
    finally:
        tmp.unlink(missing_ok=True)
        tmp.with_name(tmp.name + ".digests").unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    from colibri_backend.convert import OUT_TYPES, convert

    src = Path(args.hf_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    show = not args.no_progress and sys.stderr.isatty()
    if args.out_type.lower() in OUT_TYPES:
        out = convert(src, args.output, out_type=args.out_type, progress=show)
    else:
        out = _convert_quantized(src, Path(args.output), args.out_type.lower(), show)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB, {args.out_type})", file=sys.stderr)
    return 0
