"""What a request must satisfy before any route sees it: the API key (a dependency of the /v1 routers)
and the guard in front of the app (Host allow-list, JSON-only bodies, a size limit)."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Request

from colibri_backend.server.errors import APIError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_BODY_METHODS = {"POST", "PUT", "PATCH"}


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def require_api_key(request: Request) -> None:
    """The /v1 routers' dependency: ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``, as Anthropic's
    clients send it) when the server has a key."""
    key = request.app.state.colibri.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if request.headers.get("x-api-key") and not token:
        scheme, token = "bearer", request.headers["x-api-key"]
    if scheme.lower() != "bearer" or not token:
        raise APIError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'",
            "invalid_request_error",
            None,
            "missing_api_key",
        )
    if not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided", "invalid_request_error", None, "invalid_api_key")


def _host_name(value: str) -> str:
    """The host part of a Host header: ``[::1]:8000`` -> ``::1``, ``localhost:80`` -> ``localhost``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class Guard:
    """Pure ASGI middleware (streaming responses pass untouched). Refuses, before routing:

    * a Host header outside ``allowed_hosts`` (when set: a loopback bind, so a web page on another
      origin that resolves its name to 127.0.0.1 cannot reach the server): 400 ``invalid_host``;
    * a body-carrying request whose Content-Type is not JSON (a form or ``text/plain`` POST is what a
      browser sends cross-origin without asking): 415 ``unsupported_media_type``;
    * a body larger than ``max_body_bytes``: 413 at once when Content-Length says so, otherwise as
      soon as that many bytes have arrived.
    """

    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check(scope)
        except APIError as err:
            await err.response(scope.get("path"))(scope, receive, send)
            return
        limit = self.state.limits.max_body_bytes
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _too_large(limit)
            return message

        await self.app(scope, limited_receive, send)

    def _check(self, scope: Any) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        allowed = self.state.limits.allowed_hosts
        if allowed and _host_name(headers.get("host", "")) not in allowed:
            raise APIError(
                400,
                f"Host {headers.get('host', '')!r} is not served here (allowed: {', '.join(allowed)})",
                "invalid_request_error",
                None,
                "invalid_host",
            )
        if scope["method"] not in _BODY_METHODS:
            return
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise APIError(
                415,
                f"Content-Type must be application/json, got {media or 'none'!r}",
                "invalid_request_error",
                None,
                "unsupported_media_type",
            )
        length = headers.get("content-length")
        limit = self.state.limits.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than {limit} bytes",
        "invalid_request_error",
        None,
        "request_too_large",
    )
