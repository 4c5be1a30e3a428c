"""How a model is loaded on Colibri's engine: one immutable, validated object.

    from colibri_backend import LoadOptions, load
    opts = LoadOptions(threads=2, memory_budget="1.5G", expert_slots="40%")
    model = load("smollm2", opts)                     # or load("smollm2", threads=2, ...)

``load()``, ``Model``, ``replay_routing()``, ``colibri plan``, the CLI (commands/_load_options.py), the
configuration file (a colibri alias's ``[models.X.options]``) and the server all take a LoadOptions;
each value is checked once, when the object is made (a ``ValueError`` naming the option). What depends
on the model ("40%" of its experts, "auto" pinning, whether a routing profile exists next to it) is
resolved when it is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from colibri_backend.budget import parse_kv_cache_type, parse_policy, parse_prefetch, parse_share, parse_size

MAX_LOOKAHEAD_DEPTH = 8  # colibri.h: lookahead_depth 1..8
MAX_SEQUENCES = 256  # colibri.h: n_seq_max 1..256
DEVICES = ("cpu", "opencl")  # colibri.h COLIBRI_BACKEND_CPU, _OPENCL


def check_device(value: Any) -> str:
    """The compute backend: "cpu" or "opencl" (case-insensitive)."""
    if not isinstance(value, str) or value.strip().lower() not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {value!r}")
    return value.strip().lower()


def check_count(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_expert_slots(value: Any) -> int | str:
    """A number of experts (>= 0) or a share of the model's routed experts such as "40%"."""
    if isinstance(value, str):
        s = value.strip()
        body = s[:-1] if s.endswith("%") else s
        try:
            number = float(body) if s.endswith("%") else int(body)
        except ValueError:
            raise ValueError(
                f"expert_slots: {value!r} is not a whole number of experts or a percentage such as 40%"
            ) from None
        if s.endswith("%"):
            if not 0 < number <= 100:
                raise ValueError(f"expert_slots: {value!r}: a percentage must be in (0%, 100%]")
            return s
        value = int(number)
    return check_count(value, "expert_slots")


def check_pin_experts(value: Any) -> int | str:
    """A number of experts (>= 0) or "auto"."""
    if isinstance(value, str):
        s = value.strip().lower()
        if s == "auto":
            return "auto"
        try:
            value = int(s)
        except ValueError:
            raise ValueError(f"pin_experts: {value!r} is not a number of experts or 'auto'") from None
    return check_count(value, "pin_experts")


def check_lookahead_depth(value: Any) -> int:
    n = check_count(value, "lookahead_depth")
    if n != 0 and not 1 <= n <= MAX_LOOKAHEAD_DEPTH:
        raise ValueError(f"lookahead_depth must be between 1 and {MAX_LOOKAHEAD_DEPTH}, got {n}")
    return n


def _number_in(
    value: Any, name: str, interval: str, inside: Callable[[float], bool], note: str
) -> float | None:
    """A float option checked against its interval (None: unset)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    try:
        p = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}") from None
    if not inside(p):
        raise ValueError(f"{name} must be in {interval} ({note}), got {value!r}")
    return p


def check_lookahead_confidence(value: Any) -> float | None:
    """The router probability P, 0 <= P < 1, below which a lookahead guess is not prefetched (0: all)."""
    return _number_in(value, "lookahead_confidence", "[0, 1)", lambda p: 0 <= p < 1, "0 = every guess")


def check_expert_mass(value: Any) -> float | None:
    """Fewer active experts (lossy): a routing-probability mass P with 0 < P <= 1 (1: every top-k expert)."""
    return _number_in(value, "expert_mass", "(0, 1]", lambda p: 0 < p <= 1, "1 = every top-k expert")


def check_lowbit_experts(value: Any) -> float | None:
    """Low-bit copies on a miss (lossy): the routing weight W > 0 below which a missing expert is
    computed from MODEL.lowbit."""
    if value is None:
        return None
    w = parse_share(value, "lowbit_experts")
    if w <= 0:
        raise ValueError(f"lowbit_experts must be a routing weight > 0, got {value!r}")
    return w


def check_prefix_cache_size(value: Any) -> int | str:
    """Bytes (an int or a size string; 0: no stored entries) or a share of the memory budget ("10%")."""
    if isinstance(value, str) and value.strip().endswith("%"):
        s = value.strip()
        try:
            share = float(s[:-1])
        except ValueError:
            raise ValueError(
                f"prefix_cache_size: {value!r} is not a size or a percentage such as 10%"
            ) from None
        if not 0 <= share < 100:
            raise ValueError(f"prefix_cache_size: {value!r}: a percentage must be in [0%, 100%)")
        return s
    if isinstance(value, str) and value.strip().lower() in ("0", "none", "off"):
        return 0
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"prefix_cache_size: {exc}") from None


@dataclass(frozen=True)
class LoadOptions:
    """Everything that configures a model's engine context. ``None`` means the engine's default.

    threads: worker threads (None or 0: every CPU this process may use).
    context_length: tokens in the context window (None or 0: min(trained length, 4096)).
    batch_size: prefill chunk in tokens (None: 512).
    memory_budget: bytes or a size string ("512M", "1.5G") for everything the engine holds; None: a
      share of the available memory or cgroup limit (colibri_backend.budget); 0: no limit. Experts
      that do not fit are streamed from the file; output is identical at any budget.
    expert_policy: "reuse" (predicted reuse, the default; docs/memory.md), "lfu" (with decay) or "lru".
    prefetch: expert predictors, "lookahead", "temporal", "hashed", comma lists, "all" or "none".
    kv_cache_type: None (F16, or F32 for an F32 model), "f16" or "int8".
    expert_slots: slots counted in experts: an int, or "40%" of the routed experts; None: from the budget.
    lookahead_depth: layers ahead the lookahead predictor looks (1..8; None: 1).
    lookahead_confidence: a lookahead guess is prefetched only when its layer's router gives it at least
      this probability, 0 <= P < 1 (None or 0: every guess).
    warmup_routing: a routing profile: True = MODEL.routing next to the model, or a path; False: none.
    pin_experts: keep this many of the profile's hottest experts in slots for good, or "auto".
    route_prefilter_margin, drop_cold_share (lossy, opt-in, need a profile): 0 or None = off.
    expert_mass (lossy, opt-in): 0 < P <= 1; each token keeps the fewest of its top-k experts whose
      share of the top-k routing weights reaches P (at least one), weights normalised again as the
      model's router does. None or 1: every top-k expert.
    lowbit_experts (lossy, opt-in): a routing weight W > 0; in a decode step an expert missing from
      the store whose weight is below W is computed from its low-bit copy in MODEL.lowbit (written by
      `colibri quantize --lowbit-sidecar TYPE`) instead of its full-precision read. None: off.
    max_concurrency: sequences the context holds at once, each with its own KV cache of
      context_length tokens (None: 1); the server decodes that many requests together.
    verify: check every resident tensor against the file's digests (MODEL.digests, `colibri verify`)
      before anything runs; streamed experts are checked when read whenever the digests exist.
    prefix_cache_size: bytes of KV states the prefix cache keeps (colibri_backend.prefix_cache), or a
      share of the memory budget ("10%"); taken out of the budget the engine plans with. None: 10% of
      the budget (dropped to 0 when the rest would not hold the engine's minimum), 1 GiB without a
      budget. 0: no stored prefixes (a prompt still reuses what the context holds from the last one).
    kv_cache_dir: a directory where the prefix cache keeps its entries too, so a restart keeps them.
    device: where the matrix products run, "cpu" or "opencl" (docs/portability.md); None: $COLIBRI_DEVICE,
      else the CPU. OpenCL without a platform and device is an error, never a silent fallback.
    """

    threads: int | None = None
    context_length: int | None = None
    batch_size: int | None = None
    memory_budget: int | str | None = None
    expert_policy: str = "reuse"
    prefetch: str | None = None
    kv_cache_type: str | None = None
    expert_slots: int | str | None = None
    lookahead_depth: int | None = None
    lookahead_confidence: float | None = None
    warmup_routing: bool | str | os.PathLike[str] | None = False
    pin_experts: int | str | None = None
    route_prefilter_margin: float | None = None
    drop_cold_share: float | None = None
    expert_mass: float | None = None
    lowbit_experts: float | None = None
    verify: bool = False
    prefix_cache_size: int | str | None = None
    kv_cache_dir: str | os.PathLike[str] | None = None
    max_concurrency: int | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)  # normalizing a frozen instance while it is made

        for name in ("threads", "context_length"):
            if getattr(self, name) is not None:
                check_count(getattr(self, name), name)
        if self.batch_size is not None:
            check_count(self.batch_size, "batch_size", 1)
        if self.max_concurrency is not None:
            check_count(self.max_concurrency, "max_concurrency", 1)
            if self.max_concurrency > MAX_SEQUENCES:
                raise ValueError(
                    f"max_concurrency must be at most {MAX_SEQUENCES}, got {self.max_concurrency}"
                )
        if self.memory_budget is not None:
            try:
                put("memory_budget", parse_size(self.memory_budget))
            except ValueError as exc:
                raise ValueError(f"memory_budget: {exc}") from None
        if not isinstance(self.expert_policy, str):
            raise ValueError(f"expert_policy must be 'reuse', 'lfu' or 'lru': {self.expert_policy!r}")
        parse_policy(self.expert_policy)
        if self.prefetch is not None:
            if not isinstance(self.prefetch, str):
                raise ValueError(
                    f"prefetch must be a string such as 'lookahead,temporal', got {self.prefetch!r}"
                )
            parse_prefetch(self.prefetch)
        if self.kv_cache_type is not None:
            parse_kv_cache_type(self.kv_cache_type)
        if self.expert_slots is not None:
            put("expert_slots", check_expert_slots(self.expert_slots))
        if self.lookahead_depth is not None:
            check_lookahead_depth(self.lookahead_depth)
        put("lookahead_confidence", check_lookahead_confidence(self.lookahead_confidence))
        if self.pin_experts is not None:
            put("pin_experts", check_pin_experts(self.pin_experts))
        routing = self.warmup_routing
        if routing is not None and not isinstance(routing, (bool, str, os.PathLike)):
            raise ValueError(f"warmup_routing must be True, False or a path, got {routing!r}")
        parse_share(self.route_prefilter_margin, "route_prefilter_margin")
        parse_share(self.drop_cold_share, "drop_cold_share", upper=1.0)
        put("expert_mass", check_expert_mass(self.expert_mass))
        put("lowbit_experts", check_lowbit_experts(self.lowbit_experts))
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True or False, got {self.verify!r}")
        if self.prefix_cache_size is not None:
            put("prefix_cache_size", check_prefix_cache_size(self.prefix_cache_size))
        if self.kv_cache_dir is not None:
            if not isinstance(self.kv_cache_dir, (str, os.PathLike)) or not os.fspath(self.kv_cache_dir):
                raise ValueError(f"kv_cache_dir must be a directory path, got {self.kv_cache_dir!r}")
            if os.path.exists(self.kv_cache_dir) and not os.path.isdir(self.kv_cache_dir):
                raise ValueError(f"kv_cache_dir: {self.kv_cache_dir} exists and is not a directory")
        if self.device is not None:
            put("device", check_device(self.device))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "") -> LoadOptions:
        """From a mapping (a config table, keyword arguments); an unknown key is an error naming the
        known ones. ``where`` prefixes messages ("models.big.options.")."""
        known = {f.name for f in fields(cls)}
        unknown = [k for k in values if k not in known]
        if unknown:
            names = ", ".join(sorted(known))
            raise ValueError(f"{where}{unknown[0]}: not a load option of the colibri engine (known: {names})")
        try:
            return cls(**dict(values))
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None

    def with_changes(self, **changes: Any) -> LoadOptions:
        """A copy with ``changes`` (validated again); keys whose value is None are left as they are."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return replace(self, **changes) if changes else self

    def changed(self) -> dict[str, Any]:
        """The options that differ from the defaults, as keyword arguments."""
        default = LoadOptions()
        return {k: v for k, v in asdict(self).items() if v != getattr(default, k)}
