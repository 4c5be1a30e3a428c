"""The FastAPI application and :func:`serve`, which runs it under uvicorn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from colibri_backend.server import (
    routes_chat,
    routes_completions,
    routes_messages,
    routes_models,
    routes_responses,
    routes_system,
)
from colibri_backend.server.errors import install_error_handlers
from colibri_backend.server.schemas import (
    ChatCompletionChunk,
    ChatRequest,
    CompletionRequest,
    openapi_components,
)
from colibri_backend.server.schemas_messages import CountTokensRequest, MessagesRequest
from colibri_backend.server.schemas_responses import ResponsesRequest
from colibri_backend.server.security import LOOPBACK_HOSTS, Guard, is_loopback
from colibri_backend.server.state import ServerState

_ENDPOINTS = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
)


def _endpoint_label(path: str) -> str:
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return path if path in _ENDPOINTS else "other"


class _CountRequests:
    """Counts /v1 requests by endpoint and status (pure ASGI, so streaming is left alone)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.state.metrics.requests.labels(_endpoint_label(scope["path"]), str(status[0])).inc()


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state``'s models."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.load_on_startup:
            state.start_loading()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, state.close)

    app = FastAPI(title="Colibri", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.colibri = state
    install_error_handlers(app)
    for module in (
        routes_system,
        routes_models,
        routes_chat,
        routes_completions,
        routes_responses,
        routes_messages,
    ):
        app.include_router(module.router)
    # Outermost first: the guard refuses before anything is counted as a served request.
    app.add_middleware(_CountRequests, state=state)
    app.add_middleware(Guard, state=state)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            comps.update(
                openapi_components(
                    ChatRequest,
                    CompletionRequest,
                    ChatCompletionChunk,
                    ResponsesRequest,
                    MessagesRequest,
                    CountTokensRequest,
                )
            )
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def serve(
    state: ServerState,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run the server until SIGINT / SIGTERM. ``on_ready(port)`` is called once it listens.

    On a loopback address only loopback Host headers are accepted (DNS rebinding), unless the state's
    limits name their own allow-list."""
    from dataclasses import replace

    import uvicorn

    if is_loopback(host) and not state.limits.allowed_hosts:
        state.limits = replace(state.limits, allowed_hosts=(*LOOPBACK_HOSTS, host))
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
