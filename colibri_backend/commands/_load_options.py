"""The load options every command that loads a model accepts, and the one way a command loads:

    from colibri_backend.commands._load_options import add_load_arguments, load_options
    add_load_arguments(parser)                       # --memory-budget, --expert-slots, ...
    add_threads_argument(parser)                     # and add_context_length_argument, where it has them
    model = colibri_backend.load(args.model, load_options(args))

load_options(args) is the command line as a colibri_backend.LoadOptions (the one validated
object load(), replay_routing(), plan_memory() and the server take), from these flags and the
common --threads / --context-length / --batch-size / --kv-cache-type where the command has them.
Values are checked when the command line is parsed, by the same checks LoadOptions makes (a bad
--expert-slots is an argparse error, exit status 2); the ones that depend on the model ("40%" of its
experts, "auto" pinning) are resolved at load time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from colibri_backend.budget import parse_prefetch, parse_share, parse_size
from colibri_backend.load_options import (
    DEVICES,
    LoadOptions,
    check_expert_mass,
    check_expert_slots,
    check_lookahead_confidence,
    check_lookahead_depth,
    check_lowbit_experts,
    check_pin_experts,
    check_prefix_cache_size,
)

# Command-line options that set a LoadOptions field of the same name.
LOAD_KEYS = (
    "threads",
    "context_length",
    "batch_size",
    "kv_cache_type",
    "memory_budget",
    "expert_slots",
    "expert_policy",
    "prefetch",
    "lookahead_depth",
    "lookahead_confidence",
    "warmup_routing",
    "pin_experts",
    "route_prefilter_margin",
    "drop_cold_share",
    "expert_mass",
    "lowbit_experts",
    "verify",
    "prefix_cache_size",
    "kv_cache_dir",
    "max_concurrency",
    "device",
)


def _arg_type(check: Callable[[Any], Any], keep_text: bool = False) -> Callable[[str], Any]:
    """An argparse type from a LoadOptions check: its ValueError becomes a usage error; the value is
    what the check returns (or the text itself, with ``keep_text``)."""

    def parse(text: str) -> Any:
        try:
            value = check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text if keep_text else value

    return parse


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return n


def _lookahead(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    if n == 0:  # 0 means "the default" inside LoadOptions; on the command line it is a mistake
        raise ValueError("the lookahead depth must be between 1 and 8")
    return check_lookahead_depth(n)


def _concurrency(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    return int(LoadOptions(max_concurrency=n).max_concurrency or 1)


_size = _arg_type(parse_size, keep_text=True)
_slots = _arg_type(check_expert_slots)
_pin = _arg_type(check_pin_experts)
_prefetch = _arg_type(parse_prefetch, keep_text=True)
_depth = _arg_type(_lookahead)
_prefix_size = _arg_type(check_prefix_cache_size, keep_text=True)


def _share(upper: float | None) -> Callable[[str], float]:
    return _arg_type(lambda text: parse_share(text, "the value", upper))


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """--threads, as the commands that run the engine on this machine's CPUs spell it."""
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all CPUs)")


def add_context_length_argument(p: argparse.ArgumentParser, *aliases: str) -> None:
    """--context-length (and `aliases` of it), the context window load() gets."""
    p.add_argument(
        *aliases,
        "--context-length",
        dest="context_length",
        type=int,
        default=None,
        help="context window in tokens (default: min(trained length, 4096))",
    )


def add_load_arguments(p: argparse.ArgumentParser, budget_aliases: tuple[str, ...] = ()) -> None:
    """Add --memory-budget, --expert-slots, --expert-policy, --prefetch, --lookahead-depth,
    --warmup-routing [PATH], --pin-experts, --route-prefilter and --drop-cold to a parser. Every
    default is None: unset options keep colibri_backend.load()'s defaults."""
    g = p.add_argument_group("memory and expert streaming (docs/memory.md)")
    g.add_argument(
        "--memory-budget",
        *budget_aliases,
        type=_size,
        default=None,
        metavar="SIZE",
        help="memory for the engine: 512M, 1.5G, bytes, 0 = unlimited (default: a share of available "
        "memory or the cgroup limit); experts that do not fit are streamed from the file",
    )
    g.add_argument(
        "--expert-slots",
        type=_slots,
        default=None,
        metavar="N|P%",
        help="expert slots counted in experts instead of bytes: a number, or a share of the model's "
        "routed experts such as 40%% (rounded up, at least top-k)",
    )
    g.add_argument(
        "--expert-policy",
        choices=("lfu", "lru", "reuse"),
        default=None,
        help="expert cache policy (default reuse: predicted reuse; lfu with decay; lru)",
    )
    g.add_argument(
        "--prefetch",
        type=_prefetch,
        default=None,
        metavar="LIST",
        help="expert predictors feeding the loader: lookahead, temporal, hashed (needs a routing profile), "
        "comma lists of them, both (lookahead,temporal), all, none; default none (faster on the "
        "storage measured, docs/benchmarks.md)",
    )
    g.add_argument(
        "--lookahead-depth",
        type=_depth,
        default=None,
        metavar="N",
        help="layers ahead the lookahead predictor looks (1-8, default 1)",
    )
    g.add_argument(
        "--lookahead-confidence",
        type=_arg_type(check_lookahead_confidence),
        default=None,
        metavar="P",
        help="prefetch a lookahead guess only when its layer's router gives it probability >= P, "
        "0 <= P < 1 (default 0: every guess)",
    )
    g.add_argument(
        "--warmup-routing",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="load a routing profile (`colibri profile`): without PATH the MODEL.routing next to the model. "
        "It warms the expert slots and feeds the hashed predictor. A bare --warmup-routing takes "
        "the next word as PATH: put it after the positional arguments",
    )
    g.add_argument(
        "--pin-experts",
        type=_pin,
        default=None,
        metavar="N|auto",
        help="keep the profile's N hottest experts in slots for good; auto = half of the slots left "
        "after the top-k working set (needs --warmup-routing)",
    )
    g.add_argument(
        "--route-prefilter",
        dest="route_prefilter_margin",
        type=_share(None),
        default=None,
        metavar="MARGIN",
        help="approximate routing (lossy): score only the profile's candidate experts when the k-th and "
        "(k+1)-th candidate logits differ by at least MARGIN (needs --warmup-routing; 0 = off)",
    )
    g.add_argument(
        "--drop-cold",
        dest="drop_cold_share",
        type=_share(1.0),
        default=None,
        metavar="SHARE",
        help="lossy: never route to experts whose share of tokens in the profile is below SHARE "
        "(needs --warmup-routing; 0 = off)",
    )
    g.add_argument(
        "--expert-mass",
        dest="expert_mass",
        type=_arg_type(check_expert_mass),
        default=None,
        metavar="P",
        help="fewer active experts (lossy): each token keeps the fewest of its top-k experts whose share "
        "of the routing weight reaches P, 0 < P <= 1 (1 = off, every top-k expert)",
    )
    g.add_argument(
        "--lowbit-experts",
        dest="lowbit_experts",
        type=_arg_type(check_lowbit_experts),
        default=None,
        metavar="W",
        help="low-bit experts on a miss (lossy): a missing expert whose routing weight is below W is "
        "computed from its low-bit copy in MODEL.lowbit (colibri quantize --lowbit-sidecar) instead of "
        "waiting for its full read",
    )
    g.add_argument(
        "--max-concurrency",
        type=_arg_type(_concurrency),
        default=None,
        metavar="N",
        help="sequences the engine holds at once, each with its own KV cache (the KV memory grows N "
        "times); the server decodes up to N requests together in one batch (default 1)",
    )
    c = p.add_argument_group("prefix cache (docs/server.md)")
    c.add_argument(
        "--prefix-cache-size",
        type=_prefix_size,
        default=None,
        metavar="SIZE|P%",
        help="KV states of earlier prompts kept for reuse by prompts that start the same way: a size, "
        "or a share of --memory-budget (taken out of it); 0 = none (default 10%% of the budget)",
    )
    c.add_argument(
        "--kv-cache-dir",
        default=None,
        metavar="DIR",
        help="keep the prefix cache's entries in DIR too, so a restart keeps them",
    )
    p.add_argument(
        "--verify",
        action="store_const",
        const=True,
        default=None,
        help="check the model's resident tensors against its digests (MODEL.digests, `colibri verify`) "
        "at load and refuse a file that does not match",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="where the matrix products run: cpu, or opencl (loaded at run time; an error when no "
        "OpenCL platform and device exist); default $COLIBRI_DEVICE, else cpu (docs/portability.md)",
    )


def load_options(args: argparse.Namespace, **overrides: Any) -> LoadOptions:
    """The command line's LoadOptions: every LOAD_KEYS option the user set (unset ones keep the
    defaults); ``overrides`` (a command's own spelling, e.g. context_length=args.context) win."""
    values = {key: getattr(args, key) for key in LOAD_KEYS if getattr(args, key, None) is not None}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return LoadOptions.from_mapping(values)
