"""`colibri imatrix MODEL CORPUS... -o FILE`: an importance matrix in llama.cpp's GGUF imatrix format.

    colibri imatrix model-f16.gguf calibration.txt -o model.imatrix.gguf --ctx 512 --chunks 100
    colibri quantize model-f16.gguf model-q4_k_m.gguf --type q4_k_m --imatrix model.imatrix.gguf

The corpus (text files, or directories searched as `colibri profile` searches them) is tokenized,
joined and cut into chunks of --ctx tokens (BOS first where the model uses one), as llama-imatrix
does. Every expert must be resident: a memory budget that streams experts is refused.
Format and statistics: colibri_backend/imatrix.py, docs/quantization.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from colibri_backend.commands._load_options import (
    add_load_arguments,
    add_threads_argument,
    load_options,
    positive_int,
)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    import colibri_backend
    from colibri_backend import quality
    from colibri_backend.imatrix import collect, write_imatrix
    from colibri_backend.profile import corpus_files, read_corpus_text

    files = corpus_files(args.corpus)  # missing paths fail here, before the model loads
    texts = [(f, t) for f, t in ((f, read_corpus_text(f)) for f in files) if t and t.strip()]
    if not texts:
        raise ValueError("the corpus has no text (empty or binary files only)")
    out = Path(args.output)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the output directory {out.parent} does not exist")
    n_ctx = args.ctx or 512
    options = load_options(args, threads=args.threads, context_length=n_ctx, batch_size=args.batch)
    if options.memory_budget is None:  # every expert resident unless the user asks otherwise
        options = dataclasses.replace(options, memory_budget=0)
    with colibri_backend.load(args.model, options) as model:
        if model.context_length < n_ctx:
            raise ValueError(f"--ctx {n_ctx} exceeds the model's context of {model.context_length}")
        tok = model.tokenizer
        ids: list[int] = []
        for i, (_, text) in enumerate(texts):
            ids.extend(tok.encode(text, add_special_tokens=i == 0))
        bos = tok.bos_token_id if tok.add_bos else None
        chunks = quality.make_chunks(ids, n_ctx, args.chunks, bos)
        nll: list[np.ndarray] = []

        def score(chunk: np.ndarray, logits: np.ndarray) -> None:
            rows, targets = quality.scored_logprobs(logits, chunk)
            nll.append(-rows[np.arange(rows.shape[0]), targets])

        bar = None
        if not args.quiet:
            from tqdm import tqdm

            bar = tqdm(total=len(chunks), unit="chunk", desc="imatrix", file=sys.stderr)
        try:
            im = collect(
                model,
                chunks,
                datasets=[str(f) for f, _ in texts],
                progress=(lambda i: bar.update(1)) if bar is not None else None,
                on_logits=score,
            )
        finally:
            if bar is not None:
                bar.close()
    written = write_imatrix(out, im)
    ppl = quality.ppl_summary(np.concatenate(nll))
    n_partial = sum(1 for e in im.entries.values() if (e.counts == 0).any())
    print(
        f"{len(im.entries)} tensors from {im.chunk_count} chunks of {im.chunk_size} tokens -> {written} "
        f"({written.stat().st_size / 1e6:.1f} MB)"
    )
    if n_partial:
        print(f"({n_partial} expert tensors have experts no token was routed to: their counts are 0)")
    print(quality.format_ppl(ppl))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "imatrix",
        help="compute an importance matrix (llama.cpp's GGUF imatrix format) for quantization",
        description="Run a corpus through MODEL and write, for every weight matrix of its layers (per expert "
        "for stacked expert tensors), the sum of squared input activations per column and the row "
        "counts, as llama.cpp's imatrix file (read by llama-quantize --imatrix and colibri quantize).",
    )
    p.add_argument("model", help="a .gguf file, a Hugging Face checkpoint directory, or a known name")
    p.add_argument("corpus", nargs="+", help="text files or directories")
    p.add_argument(
        "-o", "--output", required=True, help="the imatrix file to write (e.g. model.imatrix.gguf)"
    )
    p.add_argument("--ctx", type=positive_int, default=None, help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=positive_int, default=None, help="use at most N chunks (default: all)")
    p.add_argument(
        "--batch", type=positive_int, default=None, help="prefill chunk of the engine in tokens (512)"
    )
    add_threads_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_load_arguments(p)
    p.set_defaults(func=run)
