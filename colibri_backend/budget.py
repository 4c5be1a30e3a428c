"""Memory budgets: parsing sizes ("512M", "1.5G", "2GiB", bytes) and the default budget from the
machine's available memory or the cgroup limit the process runs under.

Units are binary (K = 1024 bytes, M = 1024**2, ...), with an optional "B" or "iB" suffix.
The budget covers what the engine holds (see docs/memory.md); the Python interpreter and its
libraries come on top, which is why the default keeps a margin.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)

# Fraction of the available memory the default budget takes: the rest is left to the Python
# process itself (interpreter, numpy, tokenizer) and to the page cache of the resident weights.
DEFAULT_FRACTION = 0.85
UNLIMITED = ("0", "none", "unlimited", "off")


def parse_size(text: str | int) -> int:
    """Bytes of a size such as 512M, 1.5G, 2GiB, 1048576. 0 / "none" / "unlimited" mean no limit (0)."""
    if isinstance(text, bool):
        raise ValueError(f"not a memory size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a memory size cannot be negative: {text}")
        return text
    s = str(text).strip()
    if s.lower() in UNLIMITED:
        return 0
    m = _SIZE_RE.match(s)
    if not m:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 512M, 1.5G, 2GiB or a number of bytes)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 1 and value != 0:
        raise ValueError(f"memory size {text!r} is less than one byte")
    return int(value)


def format_size(n: int) -> str:
    """A byte count the way people read it: 1.50 GiB, 512.0 MiB, 900 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    if not raw or raw == "max":
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    # cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX * page size)
    return value if value < (1 << 60) else None


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_limit(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Memory the process's cgroup still allows (limit minus usage), cgroup v2 or v1; None if unlimited."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy: check this cgroup and its ancestors
            d = root / rel
            while True:
                limit = _read_int(d / "memory.max")
                if limit is not None:
                    used = _read_int(d / "memory.current") or 0
                    free = max(limit - used, 0)
                    best = free if best is None else min(best, free)
                if d == root or root not in d.parents:
                    break
                d = d.parent
        elif "memory" in controllers.split(","):
            d = root / "memory" / rel
            limit = _read_int(d / "memory.limit_in_bytes")
            if limit is not None:
                used = _read_int(d / "memory.usage_in_bytes") or 0
                free = max(limit - used, 0)
                best = free if best is None else min(best, free)
    return best


def default_budget() -> int:
    """The budget used when none is given: DEFAULT_FRACTION of what the machine or the cgroup still
    allows (whichever is smaller); 0 (unlimited) when neither can be read."""
    env = os.environ.get("COLIBRI_MEMORY_BUDGET")
    if env:
        return parse_size(env)
    candidates = [v for v in (mem_available(), cgroup_limit()) if v is not None]
    if not candidates:
        return 0
    return int(min(candidates) * DEFAULT_FRACTION)


def resolve_budget(value: str | int | None) -> int:
    """Bytes for a user's memory_budget argument: None -> default_budget(), else parse_size."""
    if value is None:
        return default_budget()
    return parse_size(value)


POLICIES = {"lfu": 0, "lru": 1, "reuse": 2}
PREFETCHERS = {"lookahead": 1, "temporal": 2, "hashed": 4}
HASHED = PREFETCHERS["hashed"]
# No prefetch by default: on the machines measured (docs/benchmarks.md, "Prefetch: hit rate is not
# speed"), the predictors raise the hit rate but a prefetch issued one layer ahead does not hide a read's
# latency, and the mispredicted ones spend the storage bandwidth demand reads need, so every capped run
# was faster without. `prefetch="lookahead,temporal,hashed"` turns them on.
DEFAULT_PREFETCH = "none"


def parse_policy(name: str) -> int:
    """colibri.h COLIBRI_POLICY_* value of "reuse" (predicted reuse, the default), "lfu" (frequency with
    decay) or "lru"."""
    key = name.strip().lower()
    if key not in POLICIES:
        raise ValueError(f"unknown expert cache policy {name!r} (choose from {', '.join(POLICIES)})")
    return POLICIES[key]


def parse_prefetch(spec: str) -> int:
    """COLIBRI_PREFETCH_* flags of a comma list of "lookahead", "temporal", "hashed" (the routing
    profile's token table), or "both" (= lookahead,temporal), "all" (all three), "none"."""
    key = spec.strip().lower()
    if key in ("none", "off", ""):
        return 0
    if key == "both":
        return PREFETCHERS["lookahead"] | PREFETCHERS["temporal"]
    if key == "all":
        return PREFETCHERS["lookahead"] | PREFETCHERS["temporal"] | PREFETCHERS["hashed"]
    flags = 0
    for part in key.split(","):
        part = part.strip()
        if part not in PREFETCHERS:
            raise ValueError(
                f"unknown predictor {part!r} (choose from lookahead, temporal, hashed, both, all, none)"
            )
        flags |= PREFETCHERS[part]
    return flags


def _whole_number(value: str | int, what: str) -> int:
    """A non-negative integer from an int or a decimal string; a clear error otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip()
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{what} must be a whole number, got {value!r}") from None
    if n < 0:
        raise ValueError(f"{what} cannot be negative, got {value!r}")
    return n


def parse_expert_slots(value: str | int | None, n_layer: int, n_expert: int, k: int) -> int:
    """Expert slots for colibri_context_params.expert_slots: None or 0 -> 0 (slots from the budget),
    an int -> that many, "40%" -> that share of the model's n_layer * n_expert routed experts,
    rounded up and at least top-k. More than the model has, or fewer than top-k, is refused."""
    if value is None:
        return 0
    total = n_layer * n_expert
    text = value.strip() if isinstance(value, str) else None
    if text is not None and text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"expert_slots {value!r} is not a percentage such as 40%") from None
        if not 0 < pct <= 100:
            raise ValueError(f"expert_slots {value!r} must be a percentage in (0%, 100%]")
        if total == 0:
            raise ValueError(
                "expert_slots is for mixture-of-experts models; this model has no routed experts"
            )
        # A share is rounded up so that "40%" never gives fewer slots than 40 percent of the experts.
        return max(k, min(total, math.ceil(total * pct / 100 - 1e-9)))
    n = _whole_number(value, "expert_slots")
    if n == 0:
        return 0
    if total == 0:
        raise ValueError("expert_slots is for mixture-of-experts models; this model has no routed experts")
    if n < k:
        raise ValueError(f"expert_slots {n} is fewer than the top-{k} experts one token needs")
    if n > total:
        raise ValueError(f"expert_slots {n} is more than the model's {total} routed experts")
    return n


def parse_pin_experts(value: str | int | None, n_slots: int, k: int) -> int:
    """Experts to pin: an int, or "auto" = half of the slots left after the top-k working set,
    (n_slots - k) // 2, so demand loads and prefetches keep at least as many slots as are pinned.
    None -> 0. With every expert resident (n_slots = 0: no store) nothing is pinned."""
    if value is None:
        return 0
    if isinstance(value, str) and value.strip().lower() == "auto":
        return max(0, (n_slots - k) // 2) if n_slots > 0 else 0
    n = _whole_number(value, "pin_experts")
    if n and n_slots > 0 and n > n_slots - k:
        raise ValueError(
            f"pin_experts {n} leaves fewer than the top-{k} free slots one token needs "
            f"({n_slots} slots; at most {max(n_slots - k, 0)} can be pinned)"
        )
    return n


def parse_share(value: float | str | None, what: str, upper: float | None = None) -> float:
    """A non-negative float option (0 = off); upper, when given, is an inclusive bound."""
    if value is None:
        return 0.0
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    if upper is not None and x > upper:
        raise ValueError(f"{what} must be at most {upper:g}, got {value!r}")
    return x


KV_CACHE_TYPES = {"f16": 1, "int8": 2}


def parse_kv_cache_type(name: str | None) -> int:
    """colibri.h COLIBRI_KV_* value of a kv_cache_type: None (the engine's default: F16, or F32 for
    an F32 model), "f16" or "int8"."""
    if name is None:
        return 0
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in KV_CACHE_TYPES:
        choices = ", ".join(repr(k) for k in KV_CACHE_TYPES)
        raise ValueError(f"unknown kv_cache_type {name!r} (choose from None, {choices})")
    return KV_CACHE_TYPES[key]


def plan_to_dict(plan: object) -> dict[str, int]:
    """A colibri_memory_plan (ctypes struct) as a plain dict."""
    return {name: int(getattr(plan, name)) for name, _ in plan._fields_}  # type: ignore[attr-defined]


# Rows of the plan table: (field, label), in the order the bytes are added up.
PLAN_ROWS = (
    ("metadata_bytes", "GGUF metadata and tensor table"),
    ("resident_weight_bytes", "resident weights (attention, norms, routers, shared experts, embd, head)"),
    ("model_table_bytes", "model tables (f32 norms and biases, layer structs)"),
    ("kv_bytes", "KV cache"),
    ("state_bytes", "recurrent states (linear attention, short conv: live copy and checkpoint per sequence)"),
    ("scratch_bytes", "scratch arena"),
    ("context_bytes", "context (routing record, thread stacks, small tables)"),
    ("store_table_bytes", "expert store bookkeeping and predictors"),
    ("expert_bytes", "experts (slots, or all experts when resident)"),
    ("device_buffer_bytes", "OpenCL device buffers (activations and results of one job)"),
    ("device_staging_bytes", "OpenCL staging buffers (streamed experts: 3 x an expert's gate+up or down)"),
)
# the backend's rows are left out of a CPU plan, where they are 0
DEVICE_ROWS = ("device_buffer_bytes", "device_staging_bytes")


def format_plan(plan: dict[str, int]) -> str:
    """The plan as a table, with the verdict on the last line."""
    lines = []
    for key, label in PLAN_ROWS:
        if key in DEVICE_ROWS and not plan.get(key):
            continue
        lines.append(f"  {label:<82} {format_size(plan[key]):>12}")
    lines.append(f"  {'total':<82} {format_size(plan['total_bytes']):>12}")
    budget = plan["budget"]
    if plan["n_expert_total"]:
        mode = (
            "all experts resident (no streaming)"
            if plan["all_resident"]
            else f"{plan['n_expert_slots']} of {plan['n_expert_total']} experts in slots of "
            f"{format_size(plan['expert_slot_bytes'])} (streamed from the file)"
        )
        if not plan["all_resident"] and plan.get("max_expert_slots", 0) > plan["n_expert_slots"]:
            mode += (
                f"; up to {plan['max_expert_slots']} slots while fewer sequences are under way"
                " (a sequence's KV cache is taken when it starts)"
            )
        total = format_size(plan["expert_total_bytes"])
        lines.append(f"  experts: {mode}; routed experts in the file: {total}")
    lines.append(f"  minimum budget: {format_size(plan['min_budget'])} ({plan['min_budget']} bytes)")
    if plan.get("prefix_cache_bytes"):
        cache = format_size(plan["prefix_cache_bytes"])
        lines.append(f"  prefix cache: {cache} of KV states; the budget below is what is left")
    if budget == 0:
        lines.append("  budget: unlimited -> fits")
    elif plan["fits"]:
        lines.append(f"  budget: {format_size(budget)} -> fits")
    else:
        lines.append(
            f"  budget: {format_size(budget)} -> does NOT fit; at least {format_size(plan['min_budget'])} "
            f"({plan['min_budget']} bytes) is needed"
        )
    return "\n".join(lines)
