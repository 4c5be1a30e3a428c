"""OpenAI-shaped error objects, ``{"error": {"message", "type", "param", "code"}}``, and the handlers that
turn every failure (ours, Starlette's 404/405, an unexpected exception) into one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The same error as Anthropic's API shapes it (for /v1/messages)."""
        kind = ANTHROPIC_ERROR_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"
        )
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str | None = None) -> JSONResponse:
        """The error as a response; ``path`` picks the API's error shape (Anthropic's under /v1/messages)."""
        headers = dict(self.headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers or None)


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def is_anthropic_path(path: str | None) -> bool:
    return bool(path) and (path == "/v1/messages" or path.startswith("/v1/messages/"))  # type: ignore[union-attr]


def bad_value(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


def param_of(message: str, candidates: Sequence[str]) -> str | None:
    """The request field a validation message is about, when it starts with (or names) one."""
    for name in candidates:
        if message.startswith(name) or f" {name} " in message or message.startswith(f"{name}["):
            return name
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
        return err.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message, code = f"Unknown route {request.method} {request.url.path}", "unknown_url"
        elif exc.status_code == 405:
            message, code = (
                f"Method {request.method} is not allowed on {request.url.path}",
                "method_not_allowed",
            )
        else:
            message, code = str(exc.detail), None
        err = APIError(exc.status_code, message, "invalid_request_error", None, code)
        return err.response(request.url.path)
