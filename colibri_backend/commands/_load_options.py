"""The memory and expert-store options every command that loads a model accepts.

One argparse helper (add_load_arguments) and one converter (load_options) so that run, chat,
serve, trace, profile, replay and plan spell and check them the same way. Values are checked when
the command line is parsed (a bad --expert-slots is an argparse error, exit status 2); the ones
that depend on the model ("40%" of its experts, "auto" pinning) are resolved at load time.
"""

from __future__ import annotations

import argparse
from typing import Any

from colibri_backend.budget import parse_prefetch, parse_size

# Option name on the command line -> keyword of colibri_backend.load().
LOAD_KEYS = (
    "memory_budget",
    "expert_slots",
    "expert_policy",
    "prefetch",
    "lookahead_depth",
    "warmup_routing",
    "pin_experts",
    "route_prefilter_margin",
    "drop_cold_share",
    "verify",
)


def _size(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _slots(text: str) -> str | int:
    s = text.strip()
    body = s[:-1] if s.endswith("%") else s
    try:
        value = float(body) if s.endswith("%") else int(body)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of experts or a percentage such as 40%"
        ) from None
    if s.endswith("%"):
        if not 0 < value <= 100:
            raise argparse.ArgumentTypeError(f"{text!r}: a percentage must be in (0%, 100%]")
        return s
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the number of expert slots cannot be negative")
    return int(value)


def _pin(text: str) -> str | int:
    s = text.strip().lower()
    if s == "auto":
        return "auto"
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of experts or 'auto'") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the number of pinned experts cannot be negative")
    return n


def _depth(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= 8:
        raise argparse.ArgumentTypeError(f"{text!r}: the lookahead depth must be between 1 and 8")
    return n


def _nonneg_float(upper: float | None) -> Any:
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not x >= 0 or x == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number >= 0")
        if upper is not None and x > upper:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at most {upper:g}")
        return x

    return parse


def _prefetch(text: str) -> str:
    try:
        parse_prefetch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


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
        choices=("lfu", "lru"),
        default=None,
        help="expert cache policy (default lfu, with decay)",
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
        type=_nonneg_float(None),
        default=None,
        metavar="MARGIN",
        help="approximate routing (lossy): score only the profile's candidate experts when the k-th and "
        "(k+1)-th candidate logits differ by at least MARGIN (needs --warmup-routing; 0 = off)",
    )
    g.add_argument(
        "--drop-cold",
        dest="drop_cold_share",
        type=_nonneg_float(1.0),
        default=None,
        metavar="SHARE",
        help="lossy: never route to experts whose share of tokens in the profile is below SHARE "
        "(needs --warmup-routing; 0 = off)",
    )
    p.add_argument(
        "--verify",
        action="store_const",
        const=True,
        default=None,
        help="check the model's resident tensors against its digests (MODEL.digests, `colibri verify`) "
        "at load and refuse a file that does not match",
    )


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The load() keywords the user set on the command line (unset ones are left out)."""
    out: dict[str, Any] = {}
    for key in LOAD_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            out[key] = value
    return out
