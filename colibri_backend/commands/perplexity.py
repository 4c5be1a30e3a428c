"""`colibri perplexity MODEL TEXT_FILE`: perplexity and KL divergence, as llama-perplexity measures them.

    colibri perplexity model-f32.gguf wiki.test.raw --ctx 512 --kl-divergence-base base.kld
    colibri perplexity model-q4_k_m.gguf --kl-divergence base.kld          # tokens come from base.kld
    colibri perplexity model.gguf wiki.test.raw --chunks 20 --json

Conventions and the base file's format: colibri_backend/quality.py and docs/quantization.md.
"""

from __future__ import annotations

import argparse
import json
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
    import colibri_backend
    from colibri_backend import quality as q

    if args.kl_divergence and args.kl_divergence_base:
        raise ValueError("--kl-divergence and --kl-divergence-base exclude each other (one run per file)")
    base = q.read_base(args.kl_divergence) if args.kl_divergence else None
    if base is None and args.text_file is None:
        raise ValueError("give a TEXT_FILE (only a --kl-divergence run takes its tokens from the base file)")
    text = None
    if args.text_file is not None:
        path = Path(args.text_file)
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {path}")
        text = path.read_text(encoding="utf-8", errors="replace")
    n_ctx = args.ctx
    if base is not None:
        if n_ctx is not None and n_ctx != base.n_ctx:
            raise ValueError(f"{args.kl_divergence} was made with --ctx {base.n_ctx}, not {n_ctx}")
        n_ctx = base.n_ctx
    n_ctx = n_ctx or 512
    if args.kl_divergence_base and not Path(args.kl_divergence_base).parent.is_dir():
        raise FileNotFoundError(f"the output directory {Path(args.kl_divergence_base).parent} does not exist")

    options = load_options(args, threads=args.threads, context_length=n_ctx, batch_size=args.batch)
    with colibri_backend.load(args.model, options) as model:
        if model.context_length < n_ctx:
            raise ValueError(f"--ctx {n_ctx} exceeds the model's context of {model.context_length}")
        n_vocab = model.info.n_vocab
        fingerprint = q.vocab_fingerprint(model.tokenizer)
        if base is not None:
            q.check_base_matches(base, n_vocab, fingerprint, str(args.kl_divergence))
            n = base.n_chunks if args.chunks is None else min(args.chunks, base.n_chunks)
            chunks = base.tokens[:n]
            if text is not None:
                bos = model.tokenizer.bos_token_id if model.tokenizer.add_bos else None
                mine = q.make_chunks(model.tokenize(text), n_ctx, n, bos)
                if mine.shape != chunks.shape or (mine != chunks).any():
                    raise ValueError(
                        f"{args.text_file} does not tokenize to the chunks stored in {args.kl_divergence} "
                        f"(another text, or another tokenizer): leave TEXT_FILE out to use the stored tokens"
                    )
        else:
            bos = model.tokenizer.bos_token_id if model.tokenizer.add_bos else None
            chunks = q.make_chunks(model.tokenize(text or ""), n_ctx, args.chunks, bos)
        writer = None
        if args.kl_divergence_base:
            top_k = min(args.kl_top_k or n_vocab, n_vocab)
            writer = q.BaseWriter(args.kl_divergence_base, n_vocab, fingerprint, chunks, top_k)
        bar = None
        if not args.quiet:
            from tqdm import tqdm

            name = Path(str(args.model)).name
            bar = tqdm(total=len(chunks), unit="chunk", desc=f"perplexity {name}", file=sys.stderr)
        try:
            stats = q.evaluate(
                model.logits,
                chunks,
                n_vocab=n_vocab,
                base=base,
                writer=writer,
                progress=(lambda i: bar.update(1)) if bar is not None else None,
            )
            written = writer.close() if writer is not None else None
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            if bar is not None:
                bar.close()

    result: dict[str, Any] = {"model": str(args.model), "ctx": n_ctx, "chunks": int(len(chunks))}
    result.update(q.ppl_summary(stats["nll"]))
    if base is not None:
        result["kl_divergence"] = q.kld_summary(
            stats["nll"], stats["base_nll"], stats["kld"], stats["dp"], stats["same_top"], stats["rest"]
        )
    if written is not None and writer is not None:
        result["kl_divergence_base"] = {
            "path": str(written),
            "bytes": written.stat().st_size,
            "top_k": writer.top_k,
            "full": writer.top_k >= writer.n_vocab,
        }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['chunks']} chunks of {n_ctx} tokens, {result['n_tokens']} tokens scored")
    print(q.format_ppl(result))
    if "kl_divergence" in result:
        print()
        print(q.format_kld(result["kl_divergence"]))
    if "kl_divergence_base" in result:
        b = result["kl_divergence_base"]
        what = "every token's log-probability" if b["full"] else f"the top {b['top_k']} log-probabilities"
        print(f"base: {what} at each scored position -> {b['path']} ({b['bytes'] / 1e6:.1f} MB)")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "perplexity",
        help="perplexity and KL divergence against a base model, in llama-perplexity's conventions",
        description="Chunked perplexity of MODEL on TEXT_FILE (only the second half of each chunk is "
        "scored), with its error; --kl-divergence-base stores this model's log-probabilities, "
        "--kl-divergence compares against them (mean KLD, percentiles, same top token, Δp, PPL ratio).",
    )
    p.add_argument("model", help="a .gguf file, a Hugging Face checkpoint directory, or a known name")
    p.add_argument("text_file", nargs="?", default=None, help="UTF-8 text (optional with --kl-divergence)")
    p.add_argument(
        "--ctx", type=positive_int, default=None, help="tokens per chunk (default 512, or the base file's)"
    )
    p.add_argument(
        "--batch", type=positive_int, default=None, help="prefill chunk of the engine in tokens (512)"
    )
    p.add_argument("--chunks", type=positive_int, default=None, help="use at most N chunks (default: all)")
    add_threads_argument(p)
    p.add_argument(
        "--kl-divergence-base",
        metavar="OUT",
        default=None,
        help="store this model's log-probabilities of the scored tokens in OUT (for --kl-divergence)",
    )
    p.add_argument(
        "--kl-divergence",
        metavar="BASE",
        default=None,
        help="compare with a base file and report KL divergence",
    )
    p.add_argument(
        "--kl-top-k",
        type=positive_int,
        default=None,
        metavar="K",
        help="store only the top K log-probabilities per token in a base file (default: all of them, "
        "float16, 2 bytes x vocabulary per token; with K the KLD is a lower bound, short by at most "
        "the mass outside the top K)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_load_arguments(p)
    p.set_defaults(func=run)
