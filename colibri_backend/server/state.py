"""What the server serves: one slot per model alias (its loaded model, its generation thread, its queue
accounting) and :class:`ServerState`, which admits requests and knows the limits.

Concurrency model: a model loaded with one sequence (the default) has one generation thread, so its
requests run one at a time, in arrival order. A colibri model loaded with ``max_concurrency`` N > 1
runs up to N requests at once, each on its own thread with its own sequence of the engine context,
their forward steps batched together by the model's scheduler (scheduler.py); outputs are the same
as served alone. Requests beyond the running ones wait in a bounded queue (``max_queue`` per model; the
next one gets 429 with ``Retry-After``). A client that disconnects, while waiting or while generating
(its prompt included), cancels its request: the generation stops at the next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from colibri_backend.backends import LoadedModel
from colibri_backend.config import Config, ModelConfig
from colibri_backend.server.errors import APIError
from colibri_backend.server.metrics import Metrics
from colibri_backend.server.scheduler import BatchScheduler, Cancelled
from colibri_backend.server.thread_names import REQUEST_THREAD, name_this_thread

# Seconds a client told 429 should wait: one short generation on two cores.
RETRY_AFTER_S = 2


@dataclass(eq=False)
class Job:
    """One request's generations, run on its model's thread, reported through an asyncio queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    runs: list[tuple[list[int], Any]]  # (prompt ids, SamplingParams) per choice
    max_tokens: int
    stop: list[str]
    logprobs: int | None
    # Makes each choice's grammar constraint (structured output, forced tool calls); None: unconstrained.
    constraint: Callable[[], Any] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def post(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


class ModelSlot:
    """A served model alias: its loaded model, its generation thread and its queue accounting."""

    def __init__(self, cfg: ModelConfig, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.model: LoadedModel | None = None
        self.state: Literal["loading", "ready", "error", "closed"] = "loading"
        self.error: str | None = None
        self.created = int(time.time())
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"colibri-{cfg.alias}",
            initializer=name_this_thread,
            initargs=(REQUEST_THREAD,),
        )
        self.in_flight = 0  # requests admitted and not finished (running + waiting)
        self.running = 0  # sequences being decoded now (the batch size)
        self.concurrency = 1  # requests that run at once (the others wait)
        self.scheduler: BatchScheduler | None = None  # batches the requests' steps when concurrency > 1
        self._count_lock = threading.Lock()
        self.jobs: set[Job] = set()
        # stats() taken on the slot's thread between requests: a backend may hold its model lock for
        # a whole generation, and /metrics must never wait for one.
        self.stats: dict[str, Any] = {}

    def snapshot_stats(self) -> None:
        if self.model is not None:
            try:
                self.stats = dict(self.model.stats())
            except Exception as exc:  # best effort: a failing stats() must not fail requests
                self.stats = {"stats_error": 1, "_error": str(exc)}

    def load(self, loader: Callable[[ModelConfig], LoadedModel], raise_errors: bool = False) -> None:
        """Load the model; a failure is kept (for /health and 503s) or, with ``raise_errors``, raised."""
        try:
            self.model = loader(self.cfg)
            self.snapshot_stats()
            n = int(getattr(self.model, "max_concurrency", 1))
            if n > 1 and hasattr(self.model, "eval_batch"):
                self.scheduler = BatchScheduler(self.model)
                self.concurrency = n
                old, self.executor = (
                    self.executor,
                    ThreadPoolExecutor(
                        max_workers=n,
                        thread_name_prefix=f"colibri-{self.cfg.alias}",
                        initializer=name_this_thread,
                        initargs=(REQUEST_THREAD,),
                    ),
                )
                old.shutdown(wait=False)
            self.state = "ready"
        except Exception as exc:  # reported by /health and as 503 on requests
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "error"
            if raise_errors:
                raise

    def run(self, job: Job) -> None:
        """Runs on the slot's thread."""
        model = self.model
        if self.metrics is not None:
            self.metrics.queue_seconds.labels(self.cfg.alias).observe(time.perf_counter() - job.submitted)
        try:
            if job.cancel.is_set() or model is None:
                return
            for index, (prompt_ids, sampling) in enumerate(job.runs):
                self._run_one(model, job, index, prompt_ids, sampling)
                if job.cancel.is_set():
                    return
        except Exception as exc:
            job.post(("error", exc))
        finally:
            self.snapshot_stats()
            job.post(("end",))

    def _run_one(
        self, model: LoadedModel, job: Job, index: int, prompt_ids: list[int], sampling: Any
    ) -> None:
        extra: dict[str, Any] = {"constraint": job.constraint()} if job.constraint is not None else {}
        if self.scheduler is None:
            self._generate(model, job, index, prompt_ids, sampling, extra)
            return
        with self.scheduler.sequence(job.cancel) as seq:
            try:
                self._generate(model, job, index, prompt_ids, sampling, {**extra, "steps": seq})
            except Cancelled:
                job.cancel.set()

    def _generate(
        self, model: LoadedModel, job: Job, index: int, prompt_ids: list[int], sampling: Any, extra: dict
    ) -> None:
        gen = model.generate_tokens(
            prompt_ids,
            max_tokens=job.max_tokens,
            sampling=sampling,
            stop=job.stop or None,
            logprobs=job.logprobs,
            **extra,
        )
        t0 = time.perf_counter()
        first = True
        with self._count_lock:
            self.running += 1
        try:
            for ev in gen:
                if job.cancel.is_set():
                    return
                secs = time.perf_counter() - t0
                if first and self.metrics is not None:
                    self.metrics.first_token_seconds.labels(self.cfg.alias).observe(secs)
                first = False
                job.post(("event", index, ev, secs))
        finally:
            with self._count_lock:
                self.running -= 1
            close = getattr(gen, "close", None)
            if close is not None:
                close()
            # Prefix reuse of the KV cache, for backends that report it (the colibri engine does).
            last = getattr(model, "last_request", None)
            if self.metrics is not None and isinstance(last, dict) and last.get("cached_prompt_tokens"):
                self.metrics.cached_prompt_tokens.labels(self.cfg.alias).inc(last["cached_prompt_tokens"])


class Ticket:
    """A request's place in its model's queue; released exactly once, whichever way it ends."""

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.slot.in_flight -= 1


@dataclass(frozen=True)
class Limits:
    """What a client may send. Checked before any body is parsed or any prompt is tokenized."""

    max_body_bytes: int = 4 << 20  # a whole request body
    max_prompt_chars: int = 1 << 20  # characters of prompt text (all messages, all prompts) per request
    # Host header values accepted on a loopback bind (DNS rebinding); empty: any host.
    allowed_hosts: tuple[str, ...] = ()


class ServerState:
    """Everything the app needs: served models, limits, metrics."""

    def __init__(
        self,
        config: Config,
        aliases: Sequence[str] | None = None,
        api_key: str | None = None,
        max_queue: int | None = None,
        loader: Callable[[ModelConfig], LoadedModel] | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.config = config
        self.metrics = Metrics(self)
        names = list(aliases) if aliases else list(config.models) or [config.default_model]
        self.slots: dict[str, ModelSlot] = {n: ModelSlot(config.model(n), self.metrics) for n in names}
        self.api_key = api_key if api_key is not None else config.server.api_key
        self.max_queue = max_queue if max_queue is not None else config.server.max_queue
        self.limits = limits or Limits()
        if loader is None:
            from colibri_backend.registry import load_model

            loader = load_model
        self.loader = loader
        self.shutting_down = False
        # serve() starts loading itself, after announcing the port: some backends (llama-cpp-python)
        # point the process's stderr at /dev/null while they load, which would swallow the line.
        self.load_on_startup = True
        self._loader_thread: threading.Thread | None = None

    def start_loading(self) -> None:
        """Load every served model not loaded yet in a background thread (once; later calls do nothing)."""
        if self._loader_thread is not None:
            return

        def load_all() -> None:
            for slot in self.slots.values():
                if self.shutting_down:
                    break
                if slot.state == "loading":
                    slot.load(self.loader)

        self._loader_thread = threading.Thread(target=load_all, name="colibri-loader", daemon=True)
        self._loader_thread.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        if self._loader_thread is not None:
            self._loader_thread.join(timeout)

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        for slot in self.slots.values():
            for job in list(slot.jobs):
                job.cancel.set()

    def close(self) -> None:
        self.begin_shutdown()
        self.wait_loaded(timeout=60)
        for slot in self.slots.values():
            slot.executor.shutdown(wait=True, cancel_futures=True)
            if slot.scheduler is not None:
                slot.scheduler.close()
            if slot.model is not None:
                try:
                    slot.model.close()
                finally:
                    slot.model = None
                    slot.state = "closed"

    def slot_for(self, name: Any) -> ModelSlot:
        """The ready slot serving ``name``, or the 404 / 503 that says why there is none."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", "server_error", None, "shutting_down")
        slot = self.slots.get(name) if isinstance(name, str) else None
        if slot is None:
            known = ", ".join(self.slots)
            raise APIError(
                404,
                f"The model '{name}' does not exist (served: {known})",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        if slot.state == "loading":
            raise APIError(
                503,
                f"model '{name}' is still loading; retry shortly",
                "server_error",
                None,
                "model_loading",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if slot.state != "ready" or slot.model is None:
            raise APIError(
                503,
                f"model '{name}' is not available: {slot.error or slot.state}",
                "server_error",
                None,
                "model_unavailable",
            )
        return slot

    def admit(self, slot: ModelSlot) -> Ticket:
        # in_flight counts the running requests too: max_queue is how many may wait behind them.
        if slot.in_flight >= self.max_queue + slot.concurrency:
            self.metrics.rejected.labels(slot.cfg.alias).inc()
            raise APIError(
                429,
                f"too many requests queued for model '{slot.cfg.alias}' "
                f"({self.max_queue} waiting); retry later",
                "rate_limit_error",
                None,
                "queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        slot.in_flight += 1
        return Ticket(slot)
