"""`colibri profile MODEL CORPUS...`: learn a routing profile (which experts each token routes to).

    colibri profile colibri-moe ~/src/project/ -o project.routing
    colibri profile model.gguf --files-from train_files.txt --max-tokens 300000 --held-out test.py

The corpus is run teacher-forced through the engine in chunks; the profile (format:
native/src/profile.h, writer: colibri_backend/profile.py) goes next to the model as MODEL.routing
unless -o says otherwise. Load it with `--warmup-routing` (or warmup_routing=True).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from colibri_backend.commands._load_options import add_load_arguments, add_threads_argument, load_options


def read_file_list(path: Path) -> list[str]:
    """Paths from a list file, one per line; blank lines and lines starting with # are skipped."""
    if not path.is_file():
        raise FileNotFoundError(f"file list not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def report(prof: Any, tokens: Any, ids: Any, label: str, explain: bool = True) -> str:
    """The profile's hottest experts per layer and the table's recall on a routing, as a text table."""
    from colibri_backend.profile import static_recall, table_recall

    k, c = prof.n_expert_used, prof.n_cand
    at_k = table_recall(prof, tokens, ids, k)
    at_c = table_recall(prof, tokens, ids, c)
    static = static_recall(prof, ids)
    n_show = min(prof.n_expert, 2 * k, 8)
    lines = [f"{label}: {tokens.size} tokens"]
    if explain:
        lines.append(
            f"recall@{k}: share of the routed experts among the first {k} candidates of the token; "
            f"recall@{c}: among all {c}; static: the layer's {k} hottest experts for every token"
        )
    lines += [
        f"{'layer':>5}  {'hottest experts (share of tokens)':<{12 * n_show}} {'recall@' + str(k):>9} "
        f"{'recall@' + str(c):>9} {'static':>7}",
    ]
    for layer in range(prof.n_layer):
        hot = prof.hottest(layer)[:n_show]
        cells = "".join(f"{int(e):>3} {100 * prof.share[layer, e]:5.1f}%  " for e in hot)
        lines.append(
            f"{layer:>5}  {cells:<{12 * n_show}} {_pct(at_k[layer]):>9} {_pct(at_c[layer]):>9} "
            f"{_pct(static[layer]):>7}"
        )
    lines.append(
        f"{'all':>5}  {'':<{12 * n_show}} {_pct(at_k.mean()):>9} {_pct(at_c.mean()):>9} "
        f"{_pct(static.mean()):>7}"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import colibri_backend
    from colibri_backend.profile import (
        Progress,
        corpus_files,
        profile_for_model,
        profile_path,
        route_corpus,
        tokenize_corpus,
        write_profile,
    )

    corpus = list(args.corpus)
    if args.files_from is not None:
        corpus += read_file_list(args.files_from)
    if not corpus:
        raise ValueError("no corpus: give text files or directories (or --files-from LIST)")
    files = corpus_files(corpus)  # missing paths fail here, before the model loads
    if not files:
        raise ValueError(f"the corpus has no text files (directories are searched for {_extensions()})")
    held = corpus_files(args.held_out) if args.held_out else []
    if args.held_out and not held:
        raise ValueError("--held-out names no text files")
    for name, value, lo in (("--max-tokens", args.max_tokens, 1), ("--context", args.context, 1)):
        if value is not None and value < lo:
            raise ValueError(f"{name} must be at least {lo}, got {value}")

    # A --context longer than the default context window needs a KV cache that long.
    with colibri_backend.load(args.model, load_options(args, context_length=args.context)) as model:
        info = model.info
        if info.n_expert <= 0:
            raise ValueError(f"{model.path} is a dense model (no experts): there is no routing to profile")
        out = Path(args.output) if args.output else profile_path(model.path)
        if not out.parent.is_dir():
            raise FileNotFoundError(f"the output directory {out.parent} does not exist")
        print(f"colibri profile: {len(files)} corpus files, model {model.name}", file=sys.stderr)
        t0 = time.perf_counter()
        docs = tokenize_corpus(model, files)
        skipped = len(files) - len(docs)
        tokens, ids = route_corpus(
            model,
            docs,
            context=args.context,
            max_tokens=args.max_tokens,
            progress=None if args.quiet else Progress("routing the corpus"),
        )
        prof = profile_for_model(model, tokens, ids, n_buckets=args.buckets, n_cand=args.candidates)
        seconds = time.perf_counter() - t0
        try:
            write_profile(out, prof)
        except PermissionError as exc:
            raise ValueError(
                f"cannot write {out} ({exc.strerror}); choose another place with -o PATH"
            ) from None
        held_routing = None
        if held:
            held_routing = route_corpus(
                model,
                [str(f) for f in held],
                context=args.context,
                progress=None if args.quiet else Progress("routing the held-out text"),
            )
    size = out.stat().st_size
    print(
        f"profiled {tokens.size} tokens of {len(docs)} files in {seconds:.1f} s -> {out} "
        f"({size / 1024:.0f} KiB: {prof.n_buckets} buckets x {prof.n_layer} layers x "
        f"{prof.n_cand} candidates)"
    )
    if skipped:
        print(f"({skipped} of the {len(files)} corpus files were skipped: empty or binary)")
    print(report(prof, tokens, ids, "corpus"))
    if held_routing is not None:
        print(report(prof, held_routing[0], held_routing[1], f"held-out ({len(held)} files)", explain=False))
    return 0


def _extensions() -> str:
    from colibri_backend.profile import TEXT_EXTENSIONS

    return " ".join(TEXT_EXTENSIONS)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="learn a routing profile (which experts each token uses) from a text corpus",
        description="Run CORPUS teacher-forced through a mixture-of-experts MODEL and write a routing "
        "profile: per layer each expert's share of tokens, and per token bucket the experts its tokens "
        "route to most. The engine loads it with --warmup-routing (warm slots, pinning, the hashed "
        "predictor). CORPUS: text files, or directories searched recursively for text files (.py .pyi "
        ".txt .md .rst .c .h .cc .cpp .hpp .rs .go .java .js .ts .json .toml .yaml .yml .html .css .sh "
        ".sql .tex). Prints the tokens profiled, each layer's hottest experts and the table's recall on "
        "the corpus (and on --held-out text). Progress goes to stderr.",
    )
    p.add_argument("model", help="a .gguf file, a Hugging Face checkpoint directory, or a known name")
    p.add_argument("corpus", nargs="*", metavar="CORPUS", help="text files or directories")
    p.add_argument(
        "--files-from", type=Path, default=None, metavar="LIST", help="more corpus paths, one a line"
    )
    p.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="PATH",
        help="where to write (default: MODEL.routing beside it)",
    )
    p.add_argument(
        "--buckets",
        type=int,
        default=None,
        metavar="N",
        help="token buckets, a power of two (default: the next power of two >= the vocabulary, at most 2^20)",
    )
    p.add_argument(
        "--candidates",
        type=int,
        default=None,
        metavar="M",
        help="candidate experts per bucket and layer, top-k..min(experts, 64) (default: min(experts, 2k))",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="profile at most N tokens, chunks taken evenly over the whole corpus (default: all)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="tokens per evaluated chunk, each from an empty cache (default: min(context length, 512))",
    )
    p.add_argument(
        "--held-out",
        nargs="+",
        default=None,
        metavar="FILE",
        help="text files or directories to measure the table's recall on (not profiled)",
    )
    add_threads_argument(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    add_load_arguments(p)
    p.set_defaults(func=run)
