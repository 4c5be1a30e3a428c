"""`colibri trace`: record which experts a mixture-of-experts model routes each token to.

    colibri trace --text "def fibonacci(n):" -o fib.npz
    colibri trace --model smollm2-moe.gguf --file some.py -o some.jsonl

The file format is described in docs/routing_traces.md; read it back with
colibri_backend.trace.load_trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from colibri_backend.commands._load_options import (
    add_context_length_argument,
    add_load_arguments,
    add_threads_argument,
    load_options,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace",
        help="record the experts chosen for every token and layer of a text",
        description="Evaluate a text with a mixture-of-experts model and write, for every token position "
        "and layer, the expert ids and routing weights, with the token ids and the model's identity "
        "(path, SHA-256). Output format by suffix: .npz (NumPy) or .jsonl (one JSON object per token).",
    )
    p.add_argument(
        "--model",
        "-m",
        default=None,
        help="a .gguf file, a Hugging Face checkpoint directory, or a known name; "
        "default: the built-in default model",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", "-t", help="the text to trace")
    src.add_argument("--file", "-f", type=Path, help="a UTF-8 text file to trace")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="OUT.npz|OUT.jsonl")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="tokens per evaluation; longer texts are traced in consecutive windows, each from an "
        "empty cache (default: the context length)",
    )
    p.add_argument(
        "--add-special-tokens",
        action="store_true",
        help="tokenize with the model's special tokens (e.g. BOS) added",
    )
    p.add_argument(
        "--record-lookahead",
        type=int,
        default=None,
        metavar="D",
        help="also record the lookahead predictor's guesses D layers ahead (1-8), which `colibri replay "
        "--prefetch lookahead` prefetches as a live decode step's lookahead does; 0: none (default: the "
        "engine's own depth, min(8, layers - 1))",
    )
    add_threads_argument(p)
    add_context_length_argument(p)
    add_load_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import colibri_backend
    from colibri_backend.trace import SUFFIXES, record_trace

    out: Path = args.output
    if out.suffix.lower() not in SUFFIXES:
        raise ValueError(f"the output must end in .npz or .jsonl, not {out.name!r}")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the output directory {out.parent} does not exist")
    if args.file is not None:
        if not args.file.is_file():
            raise FileNotFoundError(f"text file not found: {args.file}")
        try:
            text = args.file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{args.file} is not UTF-8 text ({exc})") from exc
        source = str(args.file)
    else:
        text, source = args.text, "text"
    model_ref = args.model if args.model else colibri_backend.default_model_path()
    if args.record_lookahead is not None and not 0 <= args.record_lookahead <= 8:
        raise ValueError(f"--record-lookahead must be between 0 and 8, got {args.record_lookahead}")
    with colibri_backend.load(model_ref, load_options(args)) as model:
        depth = args.record_lookahead
        if depth is None:
            depth = max(0, min(8, model.info.n_layer - 1)) if model.info.n_expert > 0 else 0
        trace = record_trace(
            model,
            text=text,
            add_special_tokens=args.add_special_tokens,
            window=args.window,
            source=source,
            lookahead_depth=depth,
        )
        pieces = (
            [model.tokenizer.token_text(int(t)) for t in trace.tokens]
            if out.suffix.lower() == ".jsonl"
            else None
        )
    trace.save(out, pieces=pieces)
    m = trace.meta
    print(
        f"traced {trace.n_tokens} tokens x {trace.n_layer} layers x top-{trace.k} of {m['n_expert']} experts "
        f"({m['model_name']}, sha256 {m['model_sha256'][:12]}) in {m['eval_seconds']:.2f} s -> {out}",
        file=sys.stderr,
    )
    return 0
