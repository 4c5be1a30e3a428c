"""`colibri run PROMPT`: generate from a prompt, streaming text to stdout and speed to stderr."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from colibri_backend.commands._load_options import (
    add_context_length_argument,
    add_load_arguments,
    add_threads_argument,
    load_options,
)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by run and chat: which model, how to sample, memory and expert streaming."""
    p.add_argument(
        "--model",
        "-m",
        default=None,
        help="a .gguf file, a Hugging Face checkpoint directory, or a known name "
        "(colibri-moe, smollm2); default: the bundled colibri-moe",
    )
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="tokens to generate at most (256)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p(max) (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed, same output)")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop when this text is generated (repeatable)",
    )
    add_threads_argument(p)
    add_context_length_argument(p)
    p.add_argument(
        "--kv-cache-type",
        choices=("f16", "int8"),
        default=None,
        help="KV cache elements: f16, or int8 with per-head scales (about half the memory, slightly "
        "different logits); default f16 (f32 for an F32 model)",
    )
    add_load_arguments(p)


def load_model(args: argparse.Namespace) -> Any:
    import colibri_backend

    model = args.model if args.model else colibri_backend.default_model_path()
    return colibri_backend.load(model, load_options(args))


def sampling_from_args(args: argparse.Namespace) -> Any:
    from colibri_backend.adapters.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=list(args.stop or []),
    )


def stream_to_stdout(
    model: Any, prompt_ids: list[int], args: argparse.Namespace, parser: Any = None
) -> tuple[dict[str, Any], str]:
    """Generate, writing text as it comes; return the timing figures and the whole text.

    With ``parser`` (an output parser of colibri_backend.server.tool_calls) the model's reasoning goes to
    stderr and only the answer to stdout, and the text returned is the answer."""
    sp = sampling_from_args(args)
    t0 = time.perf_counter()
    t_first = t_end = t0
    n_gen = 0
    finish = None
    out = sys.stdout
    pieces: list[str] = []
    for ev in model.generate_tokens(prompt_ids, max_tokens=args.max_tokens, sampling=sp):
        if n_gen == 0:
            t_first = time.perf_counter()
        n_gen += 1
        if parser is None:
            if ev.text:
                out.write(ev.text)
                out.flush()
                pieces.append(ev.text)
        else:
            _write_parts(parser.feed(ev.token_id, ev.text), pieces)
        finish = ev.finish_reason
    if parser is not None:
        _write_parts(parser.finish(), pieces)
    t_end = time.perf_counter()
    last = model.stats()["last"]
    n_prompt_eval = last["prompt_tokens"] - last["cached_prompt_tokens"]
    fig = {
        "prompt_tokens": last["prompt_tokens"],
        "prompt_evaluated": n_prompt_eval,
        "prefill_seconds": last["prefill_seconds"],
        "ttft": (t_first - t0) if n_gen else None,  # None: no token was generated (--max-tokens 0)
        "generated": n_gen,
        "decode_seconds": t_end - t_first,
        "finish": finish or ("none (prefill only)" if not n_gen else ""),
    }
    return fig, "".join(pieces)


def _write_parts(parts: list[Any], answer: list[str]) -> None:
    for part in parts:
        if part.kind == "reasoning":
            sys.stderr.write(part.text)
            sys.stderr.flush()
        elif part.kind == "content":
            sys.stdout.write(part.text)
            sys.stdout.flush()
            answer.append(part.text)


def report_speed(fig: dict[str, Any]) -> None:
    prefill_rate = fig["prompt_evaluated"] / fig["prefill_seconds"] if fig["prefill_seconds"] > 0 else 0.0
    # The first token comes out of the prefill; the decode rate counts the ones after it.
    n_dec = max(int(fig["generated"]) - 1, 0)
    decode_rate = n_dec / fig["decode_seconds"] if fig["decode_seconds"] > 0 and n_dec else 0.0
    ttft = "none" if fig["ttft"] is None else f"{fig['ttft'] * 1000:.0f} ms"
    print(
        f"prompt: {int(fig['prompt_tokens'])} tokens, {prefill_rate:.1f} tok/s | "
        f"decode: {int(fig['generated'])} tokens, {decode_rate:.1f} tok/s | "
        f"time to first token: {ttft} | finish: {fig['finish']}",
        file=sys.stderr,
    )


def report_stats(model: Any) -> None:
    """The engine's counters, one `key: value` per line, on stderr."""
    stats = model.stats()
    last = stats.pop("last", {})
    plan = stats.pop("memory_plan", {})
    layers = stats.pop("expert_layers", [])
    for key, value in stats.items():
        print(f"stats.{key}: {value}", file=sys.stderr)
    for key, value in last.items():
        print(f"stats.last.{key}: {value}", file=sys.stderr)
    for key, value in plan.items():
        print(f"stats.memory_plan.{key}: {value}", file=sys.stderr)
    if layers:
        print(expert_table(layers), file=sys.stderr)


def expert_table(layers: list[dict[str, Any]]) -> str:
    """The expert store's counters, one row per layer."""
    head = (
        f"{'layer':>5} {'calls':>7} {'hits':>7} {'misses':>7} {'hit%':>6} {'pf.issued':>9} {'pf.used':>7} "
        f"{'pf.wasted':>9} {'MiB read':>9} {'stall ms':>9} {'resident':>8}"
    )
    rows = [head]
    for r in layers:
        rows.append(
            f"{r['layer']:>5} {r['calls']:>7} {r['hits']:>7} {r['misses']:>7} {100 * r['hit_rate']:>6.1f} "
            f"{r['prefetch_issued']:>9} {r['prefetch_used']:>7} {r['prefetch_wasted']:>9} "
            f"{r['bytes_read'] / 1048576:>9.1f} {1000 * r['stall_seconds']:>9.1f} {r['resident']:>8}"
        )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise ValueError("the prompt is empty")
    model = load_model(args)
    try:
        if args.chat:
            messages = []
            if args.system:
                messages.append({"role": "system", "content": args.system})
            messages.append({"role": "user", "content": prompt})
            ids = model.chat_prompt_ids(messages)
        else:
            ids = model.tokenize(prompt)
        fig, _ = stream_to_stdout(model, ids, args)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not args.quiet:
            report_speed(fig)
        if args.stats:
            report_stats(model)
    finally:
        model.close()
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="generate text from a prompt (streams to stdout, speed to stderr)",
        description="Generate text from PROMPT with a model, streaming it to stdout; prompt and decode "
        "speed and time to first token go to stderr.",
    )
    p.add_argument("prompt", nargs="?", default=None, help="the prompt ('-' or nothing: read stdin)")
    add_model_arguments(p)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template"
    )
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--quiet", "-q", action="store_true", help="do not print the speed line")
    p.add_argument(
        "--stats",
        action="store_true",
        help="print the engine's counters (tokens, timings, allocations, memory)",
    )
    p.set_defaults(func=run)
