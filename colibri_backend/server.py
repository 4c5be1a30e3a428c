"""OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of any registered backend.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or SSE streaming ending in ``data: [DONE]``), ``GET /health``,
``GET /metrics`` (Prometheus text format).

Concurrency model: each served model has one generation thread, so requests to a model run one
at a time, in arrival order, and their outputs cannot mix. Requests beyond the one running wait in
a bounded queue (``max_queue`` per model; the next one gets 429). A client that disconnects, while
waiting or while generating, cancels its request: the generation stops at the next token.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 bad value or
invalid JSON, 401 missing / wrong API key, 404 unknown model or route, 413 prompt longer than the
context, 422 wrong types, 429 queue full, 503 model not loaded / server shutting down.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from colibri_backend.backends import LoadedModel
from colibri_backend.config import Config, ModelConfig
from colibri_backend.errors import ColibriError, ContextFullError

MAX_N = 8  # choices per request (n); generated one after another
MAX_TOP_LOGPROBS = 20

# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad_value(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


def _param_of(message: str, candidates: Sequence[str]) -> str | None:
    for name in candidates:
        if message.startswith(name) or f" {name} " in message or message.startswith(f"{name}["):
            return name
    return None


# --------------------------------------------------------------------------- request schemas


def _schemas() -> tuple[type, type]:
    """Pydantic request models (built lazily so importing this module stays cheap)."""
    from pydantic import BaseModel, ConfigDict, Field

    class _Strict(BaseModel):
        # strict: "0.5" is not a number and 1 is not a boolean, as in OpenAI's API; unknown fields
        # are ignored (clients send vendor extensions) unless a handler refuses them explicitly.
        model_config = ConfigDict(strict=True, extra="allow")

    class ChatMessage(_Strict):
        role: str
        content: str | list[dict[str, Any]] | None = None
        name: str | None = None

    class _Common(_Strict):
        model: str
        max_tokens: int | None = None
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None
        min_p: float | None = None
        repetition_penalty: float | None = None
        n: int | None = None
        stream: bool | None = False
        stream_options: dict[str, Any] | None = None
        stop: str | list[str] | None = None
        seed: int | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        logit_bias: dict[str, float] | None = None
        user: str | None = None

    class ChatRequest(_Common):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = None
        logprobs: bool | None = None
        top_logprobs: int | None = None
        tools: list[Any] | None = None
        functions: list[Any] | None = None
        response_format: dict[str, Any] | None = None

    class CompletionRequest(_Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        logprobs: int | None = None
        echo: bool | None = False
        suffix: str | None = None
        best_of: int | None = None

    return ChatRequest, CompletionRequest


# --------------------------------------------------------------------------- metrics


@dataclass
class Metrics:
    """Counters for /metrics. Updated on the event loop only, so no locking."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)  # (endpoint, status) -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generation_seconds: float = 0.0
    cancelled: int = 0
    last_tokens_per_second: float = 0.0
    started: float = field(default_factory=time.time)

    def count(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1


def _metric_name(key: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in key.lower())
    return out.strip("_") or "value"


def _flatten(prefix: str, value: Any, out: list[tuple[str, float]]) -> None:
    if isinstance(value, bool):
        out.append((prefix, int(value)))
    elif isinstance(value, (int, float)):  # ints stay ints: byte counts print exactly
        out.append((prefix, value))
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}_{_metric_name(str(k))}" if prefix else _metric_name(str(k)), v, out)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# --------------------------------------------------------------------------- model slots


@dataclass(eq=False)
class _Job:
    """One request's generations, run on its model's thread, reported through an asyncio queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    runs: list[tuple[list[int], Any]]  # (prompt ids, SamplingParams) per choice
    max_tokens: int
    stop: list[str]
    logprobs: int | None
    cancel: threading.Event = field(default_factory=threading.Event)

    def post(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


class ModelSlot:
    """A served model alias: its loaded model, its generation thread and its queue accounting."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.model: LoadedModel | None = None
        self.state: Literal["loading", "ready", "error", "closed"] = "loading"
        self.error: str | None = None
        self.created = int(time.time())
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"colibri-{cfg.alias}")
        self.in_flight = 0  # requests admitted and not finished (running + waiting)
        self.jobs: set[_Job] = set()
        # stats() taken on the slot's thread between requests: a backend may hold its model lock for
        # a whole generation, and /metrics must never wait for one.
        self.stats: dict[str, Any] = {}

    def snapshot_stats(self) -> None:
        if self.model is not None:
            try:
                self.stats = dict(self.model.stats())
            except Exception as exc:  # best effort: a failing stats() must not fail requests
                self.stats = {"stats_error": 1, "_error": str(exc)}

    def load(self, loader: Callable[[ModelConfig], LoadedModel]) -> None:
        try:
            self.model = loader(self.cfg)
            self.snapshot_stats()
            self.state = "ready"
        except Exception as exc:  # reported by /health and as 503 on requests
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "error"

    def run(self, job: _Job) -> None:
        """Runs on the slot's thread."""
        model = self.model
        try:
            if job.cancel.is_set() or model is None:
                return
            for index, (prompt_ids, sampling) in enumerate(job.runs):
                gen = model.generate_tokens(
                    prompt_ids,
                    max_tokens=job.max_tokens,
                    sampling=sampling,
                    stop=job.stop or None,
                    logprobs=job.logprobs,
                )
                t0 = time.perf_counter()
                try:
                    for ev in gen:
                        if job.cancel.is_set():
                            return
                        job.post(("event", index, ev, time.perf_counter() - t0))
                finally:
                    close = getattr(gen, "close", None)
                    if close is not None:
                        close()
        except Exception as exc:
            job.post(("error", exc))
        finally:
            self.snapshot_stats()
            job.post(("end",))


class _Ticket:
    """A request's place in its model's queue; released exactly once, whichever way it ends."""

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.slot.in_flight -= 1


# --------------------------------------------------------------------------- the server


class ServerState:
    """Everything the app needs: served models, limits, metrics."""

    def __init__(
        self,
        config: Config,
        aliases: Sequence[str] | None = None,
        api_key: str | None = None,
        max_queue: int | None = None,
        loader: Callable[[ModelConfig], LoadedModel] | None = None,
    ) -> None:
        self.config = config
        names = list(aliases) if aliases else list(config.models) or [config.default_model]
        self.slots: dict[str, ModelSlot] = {n: ModelSlot(config.model(n)) for n in names}
        self.api_key = api_key if api_key is not None else config.server.api_key
        self.max_queue = max_queue if max_queue is not None else config.server.max_queue
        if loader is None:
            from colibri_backend.registry import load_model

            loader = load_model
        self.loader = loader
        self.metrics = Metrics()
        self.shutting_down = False
        # serve() starts loading itself, after announcing the port: some backends (llama-cpp-python)
        # point the process's stderr at /dev/null while they load, which would swallow the line.
        self.load_on_startup = True
        self._loader_thread: threading.Thread | None = None

    def start_loading(self) -> None:
        """Load every served model in a background thread (once; later calls do nothing)."""
        if self._loader_thread is not None:
            return

        def load_all() -> None:
            for slot in self.slots.values():
                if self.shutting_down:
                    break
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
            if slot.model is not None:
                try:
                    slot.model.close()
                finally:
                    slot.model = None
                    slot.state = "closed"

    # -- request plumbing
    def slot_for(self, name: Any) -> ModelSlot:
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
                503, f"model '{name}' is still loading; retry shortly", "server_error", None, "model_loading"
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

    def admit(self, slot: ModelSlot) -> _Ticket:
        # in_flight counts the running request too: max_queue is how many may wait behind it.
        if slot.in_flight >= self.max_queue + 1:
            raise APIError(
                429,
                f"too many requests queued for model '{slot.cfg.alias}' "
                f"({self.max_queue} waiting); retry later",
                "rate_limit_error",
                None,
                "queue_full",
            )
        slot.in_flight += 1
        return _Ticket(slot)

    def render_metrics(self) -> str:
        m = self.metrics
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                text = f"{value:.10g}" if isinstance(value, float) else str(value)
                lines.append(f"{name}{labels} {text}")

        metric(
            "colibri_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status.",
            [(f'{{endpoint="{_label(e)}",status="{s}"}}', c) for (e, s), c in sorted(m.requests.items())],
        )
        metric("colibri_prompt_tokens_total", "counter", "Prompt tokens processed.", [("", m.prompt_tokens)])
        metric("colibri_completion_tokens_total", "counter", "Tokens generated.", [("", m.completion_tokens)])
        metric(
            "colibri_generation_seconds_total",
            "counter",
            "Seconds spent generating.",
            [("", float(m.generation_seconds))],
        )
        metric(
            "colibri_cancelled_requests_total",
            "counter",
            "Requests cancelled by a client disconnect.",
            [("", m.cancelled)],
        )
        overall = m.completion_tokens / m.generation_seconds if m.generation_seconds > 0 else 0.0
        metric(
            "colibri_tokens_per_second",
            "gauge",
            'Generation speed: tokens / generation seconds over the server\'s life (window="all") and '
            'of the last request (window="last").',
            [('{window="all"}', float(overall)), ('{window="last"}', float(m.last_tokens_per_second))],
        )
        metric(
            "colibri_queue_depth",
            "gauge",
            "Requests waiting for a model (not counting the running one).",
            [(f'{{model="{_label(a)}"}}', max(0, s.in_flight - 1)) for a, s in self.slots.items()],
        )
        metric(
            "colibri_requests_in_flight",
            "gauge",
            "Requests admitted and not finished, per model.",
            [(f'{{model="{_label(a)}"}}', s.in_flight) for a, s in self.slots.items()],
        )
        metric(
            "colibri_model_ready",
            "gauge",
            "1 when the model is loaded and serving.",
            [
                (f'{{model="{_label(a)}",backend="{_label(s.cfg.backend)}"}}', int(s.state == "ready"))
                for a, s in self.slots.items()
            ],
        )
        # Engine counters (expert cache hits / misses, bytes read, memory plan, ...) as the backend
        # reports them in stats(); numeric leaves only, nested keys joined with "_".
        engine: dict[str, list[tuple[str, float]]] = {}
        for alias, slot in self.slots.items():
            if slot.model is None or slot.state != "ready":
                continue
            flat: list[tuple[str, float]] = []
            _flatten("", slot.stats, flat)
            for key, value in flat:
                engine.setdefault(key, []).append((f'{{model="{_label(alias)}"}}', value))
        for key in sorted(engine):
            metric(
                f"colibri_engine_{key}",
                "gauge",
                f"Engine statistic '{key}' from the backend's stats().",
                engine[key],
            )
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- helpers


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad_value(
                f"messages[{index}].content[{j}]: only text parts are supported "
                f"(got type {part.get('type')!r})",
                "messages",
            )
        parts.append(part["text"])
    return "".join(parts)


def _token_text(model: LoadedModel, token_id: int) -> str:
    fn = getattr(model, "token_text", None)
    if fn is not None:
        return fn(token_id)
    tok = getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "token_text"):
        return tok.token_text(token_id)
    return model.detokenize([token_id])


def _sampling(body: dict[str, Any]) -> Any:
    from colibri_backend.adapters.sampling import SamplingParams

    try:
        return SamplingParams.from_openai(body)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        raise _bad_value(
            msg,
            _param_of(
                msg,
                (
                    "temperature",
                    "top_p",
                    "top_k",
                    "min_p",
                    "presence_penalty",
                    "frequency_penalty",
                    "repetition_penalty",
                    "logit_bias",
                    "seed",
                    "max_tokens",
                    "stop",
                ),
            ),
        ) from None


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


# --------------------------------------------------------------------------- app


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state``'s models."""
    from contextlib import asynccontextmanager

    from pydantic import ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    ChatRequest, CompletionRequest = _schemas()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.load_on_startup:
            state.start_loading()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, state.close)

    app = FastAPI(title="Colibri", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.colibri = state

    def error_response(err: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(
                404,
                f"Unknown route {request.method} {request.url.path}",
                "invalid_request_error",
                None,
                "unknown_url",
            )
        elif exc.status_code == 405:
            err = APIError(
                405,
                f"Method {request.method} is not allowed on {request.url.path}",
                "invalid_request_error",
                None,
                "method_not_allowed",
            )
        else:
            err = APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, None)
        return error_response(err)

    def endpoint_label(path: str) -> str:
        if path.startswith("/v1/models/"):
            return "/v1/models/{id}"
        if path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
            return path
        return "other"

    class _CountRequests:
        """Counts /v1 requests by endpoint and status (pure ASGI, so streaming is left alone)."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                await self.inner(scope, receive, send)
                return
            status = [500]

            async def send_status(message: Any) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await self.inner(scope, receive, send_status)
            finally:
                state.metrics.count(endpoint_label(scope["path"]), status[0])

    app.add_middleware(_CountRequests)

    class _Stream(StreamingResponse):
        """An SSE response that always releases its queue ticket and closes its generator, also
        when the client disconnects before or during the stream."""

        def __init__(self, body: AsyncIterator[bytes], ticket: _Ticket) -> None:
            super().__init__(
                body,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
            self._ticket = ticket

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                self._ticket.release()

    def check_key(request: Request) -> None:
        if not state.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                None,
                "missing_api_key",
            )
        if not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(
                401, "Incorrect API key provided", "invalid_request_error", None, "invalid_api_key"
            )

    async def parse(request: Request, schema: type) -> tuple[Any, dict[str, Any]]:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(
                400,
                f"The request body is not valid JSON: {exc}",
                "invalid_request_error",
                None,
                "invalid_json",
            ) from None
        if not isinstance(data, dict):
            raise APIError(
                400, "The request body must be a JSON object", "invalid_request_error", None, "invalid_json"
            )
        try:
            parsed = schema.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ())) or None
            status, code = (
                (400, "missing_required_parameter")
                if first.get("type") == "missing"
                else (422, "invalid_type")
            )
            msg = f"{loc}: {first.get('msg')}" if loc else str(first.get("msg"))
            if len(exc.errors()) > 1:
                msg += f" (and {len(exc.errors()) - 1} more problem(s))"
            raise APIError(
                status, msg, "invalid_request_error", loc.split(".")[0] if loc else None, code
            ) from None
        return parsed, data

    # ---------------------------------------------------------------- plain routes

    @app.get("/health")
    async def health() -> JSONResponse:
        models = {
            a: {"state": s.state, "backend": s.cfg.backend, **({"error": s.error} if s.error else {})}
            for a, s in state.slots.items()
        }
        if state.shutting_down:
            status = "shutting_down"
        elif all(s.state == "ready" for s in state.slots.values()):
            status = "ok"
        elif any(s.state == "loading" for s in state.slots.values()):
            status = "loading"
        else:
            status = "error"
        return JSONResponse({"status": status, "models": models}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.render_metrics(), media_type="text/plain; version=0.0.4")

    def model_card(alias: str, slot: ModelSlot) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": alias,
            "object": "model",
            "created": slot.created,
            "owned_by": "colibri",
            "backend": slot.cfg.backend,
            "ready": slot.state == "ready",
        }
        if slot.model is not None:
            card["context_length"] = slot.model.context_length
        return card

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        check_key(request)
        return JSONResponse({"object": "list", "data": [model_card(a, s) for a, s in state.slots.items()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        check_key(request)
        slot = state.slots.get(model_id)
        if slot is None:
            raise APIError(
                404,
                f"The model '{model_id}' does not exist",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return JSONResponse(model_card(model_id, slot))

    # ---------------------------------------------------------------- generation plumbing

    @dataclass
    class Prepared:
        slot: ModelSlot
        model: LoadedModel
        runs: list[tuple[list[int], Any]]
        prompt_tokens: int
        max_tokens: int
        stop: list[str]
        logprobs: int | None
        stream: bool
        include_usage: bool
        n: int
        ticket: _Ticket

    def common_checks(req: Any, data: dict[str, Any]) -> tuple[ModelSlot, LoadedModel, Any, int, int | None]:
        slot = state.slot_for(req.model)
        model = slot.model
        assert model is not None
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise _bad_value(f"n must be between 1 and {MAX_N}, got {n}", "n")
        sampling = _sampling(data)
        requested = getattr(req, "max_completion_tokens", None)
        if requested is None:
            requested = req.max_tokens
        if requested is not None and requested < 1:
            raise _bad_value(f"max_tokens must be at least 1, got {requested}", "max_tokens")
        if req.stream_options is not None and not req.stream:
            raise _bad_value("stream_options is only allowed when stream is true", "stream_options")
        return slot, model, sampling, n, requested

    def finish_prepare(
        slot: ModelSlot,
        model: LoadedModel,
        sampling: Any,
        n: int,
        requested: int | None,
        prompts: list[list[int]],
        logprobs: int | None,
        req: Any,
    ) -> Prepared:
        for ids in prompts:
            if not ids:
                raise _bad_value("the prompt is empty", "prompt")
            if len(ids) >= model.context_length:
                raise APIError(
                    413,
                    f"This model's maximum context length is {model.context_length} tokens; "
                    f"the prompt has {len(ids)} tokens",
                    "invalid_request_error",
                    "messages" if hasattr(req, "messages") else "prompt",
                    "context_length_exceeded",
                )
        room = model.context_length - max(len(p) for p in prompts)
        max_tokens = room if requested is None else min(requested, room)
        runs: list[tuple[list[int], Any]] = []
        from dataclasses import replace

        for ids in prompts:
            for i in range(n):
                # Distinct choices need distinct random streams: choice i uses seed + i.
                s = sampling if i == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + i)
                runs.append((ids, s))
        include_usage = bool(req.stream and req.stream_options and req.stream_options.get("include_usage"))
        ticket = state.admit(slot)
        return Prepared(
            slot,
            model,
            runs,
            sum(len(p) for p in prompts),
            max_tokens,
            list(sampling.stop or []),
            logprobs,
            bool(req.stream),
            include_usage,
            n,
            ticket,
        )

    async def events(p: Prepared, request: Request) -> AsyncIterator[tuple]:
        """Submits the job and yields ("event", choice, GenerationEvent, seconds) items; cancels the
        generation if the consumer goes away (client disconnect) before the end."""
        loop = asyncio.get_running_loop()
        job = _Job(loop, asyncio.Queue(), p.runs, p.max_tokens, p.stop, p.logprobs)
        p.slot.jobs.add(job)
        finished = False
        try:
            p.slot.executor.submit(p.slot.run, job)
            while True:
                try:
                    item = await asyncio.wait_for(job.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    # Non-streaming requests have no send() to fail on, so poll for a disconnect.
                    if not p.stream and await request.is_disconnected():
                        return
                    continue
                if item[0] == "end":
                    finished = True
                    return
                if item[0] == "error":
                    finished = True
                    exc = item[1]
                    if isinstance(exc, ContextFullError):
                        raise APIError(
                            413, str(exc), "invalid_request_error", None, "context_length_exceeded"
                        )
                    if isinstance(exc, (ValueError, ColibriError)):
                        raise _bad_value(str(exc))
                    raise APIError(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
                yield item
        finally:
            if not finished:
                job.cancel.set()
                state.metrics.cancelled += 1
            p.slot.jobs.discard(job)
            p.ticket.release()

    def account(p: Prepared, completion_tokens: int, seconds: float) -> dict[str, int]:
        m = state.metrics
        m.prompt_tokens += p.prompt_tokens
        m.completion_tokens += completion_tokens
        m.generation_seconds += seconds
        if seconds > 0:
            m.last_tokens_per_second = completion_tokens / seconds
        return {
            "prompt_tokens": p.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": p.prompt_tokens + completion_tokens,
        }

    def chat_logprob_entry(model: LoadedModel, ev: Any) -> dict[str, Any]:
        text = _token_text(model, ev.token_id)
        top = [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
            for t, lp in (ev.top_logprobs or {}).items()
        ]
        return {
            "token": text,
            "logprob": ev.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": top,
        }

    def fingerprint(p: Prepared) -> str:
        return f"colibri-{p.slot.cfg.backend}"

    # ---------------------------------------------------------------- chat completions

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        req, data = await parse(request, ChatRequest)
        slot, model, sampling, n, requested = common_checks(req, data)
        if req.tools or req.functions:
            raise _bad_value("tools / function calling are not supported by this server", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise _bad_value('only response_format {"type": "text"} is supported', "response_format")
        logprobs: int | None = None
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise _bad_value("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise _bad_value(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        if req.logprobs:
            if not model.capabilities.logprobs:
                raise _bad_value(f"backend {slot.cfg.backend!r} does not report logprobs", "logprobs")
            logprobs = req.top_logprobs or 0
        messages = []
        for i, m in enumerate(req.messages):
            msg = {"role": m.role, "content": _content_text(m.content, i)}
            if m.name:
                msg["name"] = m.name
            messages.append(msg)
        try:
            prompt_text = model.render_chat(messages)
        except (ValueError, ColibriError) as exc:
            raise _bad_value(str(exc), "messages") from None
        ids = model.tokenize(prompt_text, add_special_tokens=False)
        p = finish_prepare(slot, model, sampling, n, requested, [ids], logprobs, req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        if p.stream:

            async def body() -> AsyncIterator[bytes]:
                def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
                    obj: dict[str, Any] = {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": req.model,
                        "system_fingerprint": fingerprint(p),
                        "choices": choices,
                    }
                    if p.include_usage:
                        obj["usage"] = usage
                    return _sse(obj)

                started: set[int] = set()
                count = 0
                last_secs: dict[int, float] = {}
                try:
                    async with aclosing(events(p, request)) as stream:
                        async for _, idx, ev, secs in stream:
                            if idx not in started:
                                started.add(idx)
                                yield chunk(
                                    [
                                        {
                                            "index": idx,
                                            "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None,
                                            "finish_reason": None,
                                        }
                                    ]
                                )
                            count += 1
                            last_secs[idx] = secs
                            lp = None
                            if p.logprobs is not None:
                                lp = {"content": [chat_logprob_entry(model, ev)]}
                            if ev.text or lp is not None:
                                yield chunk(
                                    [
                                        {
                                            "index": idx,
                                            "delta": {"content": ev.text},
                                            "logprobs": lp,
                                            "finish_reason": None,
                                        }
                                    ]
                                )
                            if ev.finish_reason:
                                yield chunk(
                                    [
                                        {
                                            "index": idx,
                                            "delta": {},
                                            "logprobs": None,
                                            "finish_reason": ev.finish_reason,
                                        }
                                    ]
                                )
                except APIError as err:
                    yield _sse(err.body())
                    yield b"data: [DONE]\n\n"
                    return
                usage = account(p, count, sum(last_secs.values()))
                if p.include_usage:
                    yield chunk([], usage)
                yield b"data: [DONE]\n\n"

            return _Stream(body(), p.ticket)

        texts = [[] for _ in p.runs]
        lps: list[list[dict[str, Any]]] = [[] for _ in p.runs]
        finish: list[str | None] = [None for _ in p.runs]
        count = 0
        last_secs: dict[int, float] = {}
        try:
            async with aclosing(events(p, request)) as stream:
                async for _, idx, ev, secs in stream:
                    texts[idx].append(ev.text)
                    count += 1
                    last_secs[idx] = secs
                    if p.logprobs is not None:
                        lps[idx].append(chat_logprob_entry(model, ev))
                    if ev.finish_reason:
                        finish[idx] = ev.finish_reason
        finally:
            p.ticket.release()
        usage = account(p, count, sum(last_secs.values()))
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(texts[i])},
                "logprobs": {"content": lps[i]} if p.logprobs is not None else None,
                "finish_reason": finish[i] or "length",
            }
            for i in range(len(p.runs))
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": req.model,
                "system_fingerprint": fingerprint(p),
                "choices": choices,
                "usage": usage,
            }
        )

    # ---------------------------------------------------------------- completions

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        req, data = await parse(request, CompletionRequest)
        slot, model, sampling, n, requested = common_checks(req, data)
        if req.echo:
            raise _bad_value("echo is not supported", "echo")
        if req.suffix:
            raise _bad_value("suffix (insertion) is not supported", "suffix")
        if req.best_of is not None and req.best_of != n:
            raise _bad_value("best_of is not supported (use n)", "best_of")
        logprobs = req.logprobs
        if logprobs is not None:
            if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise _bad_value(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
            if not model.capabilities.logprobs:
                raise _bad_value(f"backend {slot.cfg.backend!r} does not report logprobs", "logprobs")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [model.tokenize(prompt)]
        elif prompt and all(isinstance(x, int) for x in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(x, str) for x in prompt):
            prompts = [model.tokenize(x) for x in prompt]
        elif prompt and all(isinstance(x, list) for x in prompt):
            prompts = [list(x) for x in prompt]
        else:
            raise _bad_value(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids, and not empty",
                "prompt",
            )
        vocab = getattr(getattr(model, "info", None), "n_vocab", None) or getattr(model, "n_vocab", None)
        if vocab:
            for ids in prompts:
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise _bad_value(
                        f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt"
                    )
        if len(prompts) * n > MAX_N:
            raise _bad_value(f"at most {MAX_N} completions per request (prompts x n)", "n")
        p = finish_prepare(slot, model, sampling, n, requested, prompts, logprobs, req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        class LogprobAcc:
            def __init__(self) -> None:
                self.tokens: list[str] = []
                self.token_logprobs: list[float | None] = []
                self.top: list[dict[str, float]] = []
                self.offsets: list[int] = []
                self.offset = 0

            def add(self, ev: Any) -> None:
                text = _token_text(model, ev.token_id)
                self.tokens.append(text)
                self.token_logprobs.append(ev.logprob)
                self.top.append(dict(ev.top_logprobs or {}))
                self.offsets.append(self.offset)
                self.offset += len(ev.text)

            def as_dict(self) -> dict[str, Any]:
                return {
                    "tokens": self.tokens,
                    "token_logprobs": self.token_logprobs,
                    "top_logprobs": self.top,
                    "text_offset": self.offsets,
                }

        if p.stream:

            async def body() -> AsyncIterator[bytes]:
                def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
                    obj: dict[str, Any] = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": req.model,
                        "system_fingerprint": fingerprint(p),
                        "choices": choices,
                    }
                    if p.include_usage:
                        obj["usage"] = usage
                    return _sse(obj)

                count = 0
                last_secs: dict[int, float] = {}
                offsets: dict[int, int] = {}
                try:
                    async with aclosing(events(p, request)) as stream:
                        async for _, idx, ev, secs in stream:
                            count += 1
                            last_secs[idx] = secs
                            lp = None
                            if p.logprobs is not None:
                                acc = LogprobAcc()
                                acc.offset = offsets.get(idx, 0)
                                acc.add(ev)
                                lp = acc.as_dict()
                            offsets[idx] = offsets.get(idx, 0) + len(ev.text)
                            if ev.text or lp is not None or ev.finish_reason:
                                yield chunk(
                                    [
                                        {
                                            "index": idx,
                                            "text": ev.text,
                                            "logprobs": lp,
                                            "finish_reason": ev.finish_reason,
                                        }
                                    ]
                                )
                except APIError as err:
                    yield _sse(err.body())
                    yield b"data: [DONE]\n\n"
                    return
                usage = account(p, count, sum(last_secs.values()))
                if p.include_usage:
                    yield chunk([], usage)
                yield b"data: [DONE]\n\n"

            return _Stream(body(), p.ticket)

        texts = [[] for _ in p.runs]
        accs = [LogprobAcc() for _ in p.runs]
        finish: list[str | None] = [None for _ in p.runs]
        count = 0
        last_secs: dict[int, float] = {}
        try:
            async with aclosing(events(p, request)) as stream:
                async for _, idx, ev, secs in stream:
                    texts[idx].append(ev.text)
                    count += 1
                    last_secs[idx] = secs
                    if p.logprobs is not None:
                        accs[idx].add(ev)
                    if ev.finish_reason:
                        finish[idx] = ev.finish_reason
        finally:
            p.ticket.release()
        usage = account(p, count, sum(last_secs.values()))
        choices = [
            {
                "index": i,
                "text": "".join(texts[i]),
                "logprobs": accs[i].as_dict() if p.logprobs is not None else None,
                "finish_reason": finish[i] or "length",
            }
            for i in range(len(p.runs))
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "system_fingerprint": fingerprint(p),
                "choices": choices,
                "usage": usage,
            }
        )

    return app


# --------------------------------------------------------------------------- running


def serve(
    state: ServerState,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run the server until SIGINT / SIGTERM. ``on_ready(port)`` is called once it listens."""
    import uvicorn

    state.load_on_startup = False
    app = create_app(state)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Refuse new work (503) at once, and stop running generations, before the graceful wait.
            state.begin_shutdown()
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if on_ready is not None and self.servers:
                bound = self.servers[0].sockets[0].getsockname()[1]
                on_ready(int(bound))
            state.start_loading()

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        access_log=log_level == "debug",
    )
    _Server(config).run()
