"""`colibri convert HF_DIR -o OUT.gguf --type f32|f16|q8_0|q4_0`: Hugging Face checkpoint -> GGUF."""

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
        choices=OUT_TYPES,
        default="f16",
        help="tensor type of the weight matrices (norms and routers stay F32; default: f16)",
    )
    p.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from colibri_backend.convert import convert

    src = Path(args.hf_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    out = convert(
        src, args.output, out_type=args.out_type, progress=not args.no_progress and sys.stderr.isatty()
    )
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB, {args.out_type})", file=sys.stderr)
    return 0
