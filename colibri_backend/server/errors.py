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

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


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
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

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
        return APIError(exc.status_code, message, "invalid_request_error", None, code).response()
