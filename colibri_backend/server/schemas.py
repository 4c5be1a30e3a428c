"""Request bodies: the pydantic models and :func:`parse_body`, the only place a body is parsed.

Parsing is pydantic's Rust JSON parser straight from the raw bytes, so a hostile body (nested 1,000 deep,
a 5,000-digit number, invalid UTF-8, not an object) is a ``ValidationError`` answered 400, never a
``RecursionError`` or ``ValueError`` escaping as a 500. The models are strict as OpenAI's API is ("0.5" is
not a number, 1 is not a boolean); unknown fields are kept (clients send vendor extensions) and a handler
refuses the ones it cannot honour.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from colibri_backend.server.errors import APIError

MAX_N = 8  # choices per request (n); generated one after another
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.get("include_usage"))


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


Schema = TypeVar("Schema", bound=BaseModel)


def parse_body(raw: bytes, schema: type[Schema]) -> Schema:
    """The request ``raw`` as ``schema``; an OpenAI error object (400 / 422) when it is not one."""
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        kind = first.get("type")
        if kind == "json_invalid" or (kind == "model_type" and not first.get("loc")):
            detail = first.get("msg", "") if kind == "json_invalid" else "the body must be a JSON object"
            raise APIError(
                400,
                f"The request body is not valid JSON: {detail}",
                "invalid_request_error",
                None,
                "invalid_json",
            ) from None
        loc = ".".join(str(p) for p in first.get("loc", ())) or None
        status, code = (400, "missing_required_parameter") if kind == "missing" else (422, "invalid_type")
        msg = f"{loc}: {first.get('msg')}" if loc else str(first.get("msg"))
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more problem(s))"
        raise APIError(
            status, msg, "invalid_request_error", loc.split(".")[0] if loc else None, code
        ) from None


def openapi_body(schema: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that parses its body with :func:`parse_body` (so FastAPI does not):
    the schema is listed in the components that :func:`openapi_components` adds."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}},
        }
    }


def openapi_components(*schemas: type[BaseModel]) -> dict[str, Any]:
    """JSON schemas of ``schemas`` and the models they use, referenced as OpenAPI components."""
    out: dict[str, Any] = {}
    for schema in schemas:
        js = schema.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(js.pop("$defs", {}))
        out[schema.__name__] = js
    return out
