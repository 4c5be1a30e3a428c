"""The server's Prometheus metrics (``GET /metrics``), kept by ``prometheus-client`` in a registry of the
server's own, so two apps in one process (tests) do not share counters.

Counters and histograms are updated as requests end; per-model gauges (queue depth, requests in flight,
batch size, readiness) and the engine's own figures (expert cache hits and misses, bytes read, the
memory plan, KV prefix reuse, whatever the backend's ``stats()`` reports) are read when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from colibri_backend.server.state import ServerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: a first token on two CPU cores takes from tens of milliseconds to minutes (long prompts).
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _metric_name(key: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in key.lower())
    return out.strip("_") or "value"


def flatten_stats(prefix: str, value: Any, out: list[tuple[str, float]]) -> None:
    """Numeric leaves of a backend's ``stats()``, nested keys joined with ``_``; strings are dropped."""
    if isinstance(value, bool):
        out.append((prefix, int(value)))
    elif isinstance(value, (int, float)):
        out.append((prefix, value))
    elif isinstance(value, Mapping):
        for k, v in value.items():
            flatten_stats(f"{prefix}_{_metric_name(str(k))}" if prefix else _metric_name(str(k)), v, out)


class Metrics:
    """Everything /metrics exposes for one server."""

    def __init__(self, state: ServerState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "colibri_requests",
            "HTTP requests answered, by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("colibri_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.completion_tokens = Counter("colibri_completion_tokens", "Tokens generated.", registry=r)
        self.generation_seconds = Counter(
            "colibri_generation_seconds", "Seconds spent generating.", registry=r
        )
        self.cancelled = Counter(
            "colibri_cancelled_requests", "Requests cancelled by a client disconnect.", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "colibri_cached_prompt_tokens",
            "Prompt tokens the KV cache already held (prefix-cache hits), per model.",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            "colibri_rejected_requests",
            "Requests refused with 429 (queue full), per model.",
            ["model"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "colibri_request_duration_seconds",
            "Wall time of generation requests, from admission to the last byte, per endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "colibri_queue_wait_seconds",
            "Time a request waited for its model's generation thread.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token_seconds = Histogram(
            "colibri_time_to_first_token_seconds",
            "Time from the start of a generation (prefill included) to its first token, per model.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_tokens_per_second = Histogram(
            "colibri_request_tokens_per_second",
            "Generation speed of each finished request (tokens / generation seconds).",
            ["model"],
            buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500),
            registry=r,
        )
        r.register(_LiveCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _BatchSteps:
    """The batch scheduler's step figures (scheduler.BatchScheduler), per model."""

    FIELDS = (
        ("steps", "steps", "Batched forward steps run."),
        ("step_tokens", "step_tokens", "Tokens the batched steps evaluated (prompt and decode)."),
        ("engine_seconds", "step_engine_seconds", "Seconds the batched steps spent in the engine."),
        (
            "between_seconds",
            "step_between_seconds",
            "Seconds the engine sat idle between two batched steps while requests held sequences "
            "(sampling, detokenizing, sending, gathering the next step).",
        ),
        ("partial_steps", "partial_steps", "Decode steps that ran without every held sequence."),
        ("prompt_tokens", "step_prompt_tokens", "Prompt tokens the batched steps evaluated."),
        ("prefill_steps", "prefill_steps", "Batched steps that carried prompt tokens."),
        (
            "prefill_engine_seconds",
            "prefill_step_engine_seconds",
            "Seconds in the engine of the batched steps that carried prompt tokens.",
        ),
        (
            "decode_only_tokens",
            "decode_only_step_tokens",
            "Decode tokens of the batched steps that carried no prompt tokens.",
        ),
    )

    # The expert store during the steps (scheduler.BatchScheduler.store; zero where experts do not
    # stream), per kind of step: colibri_batch_{prefill,decode}_step_{counter}_total.
    STORE = (
        ("expert_misses", "Expert store misses"),
        ("expert_bytes_read", "Bytes the expert store read"),
        ("expert_stall_seconds", "Seconds waited for the expert store's reads"),
    )
    KINDS = (("prefill", "that carried prompt tokens"), ("decode", "with decode tokens only"))

    def __init__(self) -> None:
        self.families = [
            CounterMetricFamily(f"colibri_batch_{name}", doc, labels=["model"])
            for _, name, doc in self.FIELDS
        ]
        self.store_families = {
            (kind, key): CounterMetricFamily(
                f"colibri_batch_{kind}_step_{key}", f"{doc} in the batched steps {which}.", labels=["model"]
            )
            for kind, which in self.KINDS
            for key, doc in self.STORE
        }

    def add(self, alias: str, scheduler: Any) -> None:
        for family, (attr, _, _) in zip(self.families, self.FIELDS, strict=True):
            family.add_metric([alias], float(getattr(scheduler, attr)))
        for (kind, key), family in self.store_families.items():
            family.add_metric([alias], float(scheduler.store[kind][key]))


class _LiveCollector(Collector):
    """Gauges read at scrape time from the server's slots (never waiting on a generation)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def describe(self) -> list[Metric]:
        return []  # values only exist at scrape time; nothing to check for name clashes up front

    def collect(self) -> Iterator[Metric]:
        slots = self.state.slots
        depth = GaugeMetricFamily(
            "colibri_queue_depth",
            "Requests waiting for a model (not counting the running ones).",
            labels=["model"],
        )
        flight = GaugeMetricFamily(
            "colibri_requests_in_flight", "Requests admitted and not finished, per model.", labels=["model"]
        )
        batch = GaugeMetricFamily(
            "colibri_batch_size", "Sequences the model is decoding together right now.", labels=["model"]
        )
        ready = GaugeMetricFamily(
            "colibri_model_ready", "1 when the model is loaded and serving.", labels=["model", "backend"]
        )
        steps = _BatchSteps()
        engine: dict[str, list[tuple[str, float]]] = {}
        for alias, slot in slots.items():
            if slot.scheduler is not None:
                steps.add(alias, slot.scheduler)
            depth.add_metric([alias], max(0, slot.in_flight - slot.running))
            flight.add_metric([alias], slot.in_flight)
            batch.add_metric([alias], slot.running)
            ready.add_metric([alias, slot.cfg.backend], int(slot.state == "ready"))
            if slot.model is None or slot.state != "ready":
                continue
            flat: list[tuple[str, float]] = []
            flatten_stats("", slot.stats, flat)
            for key, value in flat:
                engine.setdefault(key, []).append((alias, value))
        yield from (depth, flight, batch, ready)
        yield from steps.families
        yield from steps.store_families.values()
        for key in sorted(engine):
            family = GaugeMetricFamily(
                f"colibri_engine_{key}",
                f"Engine statistic '{key}' from the backend's stats().",
                labels=["model"],
            )
            for alias, value in engine[key]:
                family.add_metric([alias], value)
            yield family
