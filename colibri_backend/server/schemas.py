"""Request and response bodies: the pydantic models, and :func:`parse_body`, the only place a body is
parsed.

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


class GenerationRequest(_Strict):
    """The fields every generation request shares (chat and completions)."""

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


class ChatRequest(GenerationRequest):
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


class CompletionRequest(GenerationRequest):
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


# Bodies larger than this are parsed on a worker thread, so a big body never holds the event loop.
PARSE_OFF_LOOP_BYTES = 64 << 10


async def parse_request(request: Any, schema: type[Schema]) -> Schema:
    """The request's body as ``schema`` (see :func:`parse_body`)."""
    from starlette.concurrency import run_in_threadpool

    raw = await request.body()
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        return await run_in_threadpool(parse_body, raw, schema)
    return parse_body(raw, schema)


# --------------------------------------------------------------------------- responses
# What the response builder (responses.py) writes, as models: the OpenAPI schema lists them, and
# tests/test_server_hardening.py validates built responses against them. Extra fields are allowed, as
# OpenAI adds fields over time.


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Open):
    error: ErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionMessage(_Open):
    role: str
    content: str | None


class ChatChoiceOut(_Open):
    index: int
    message: ChatCompletionMessage
    logprobs: dict[str, Any] | None
    finish_reason: str


class ChatCompletion(_Open):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoiceOut]
    usage: Usage


class ChatDelta(_Open):
    index: int
    delta: dict[str, Any]
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionChunk(_Open):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatDelta]
    usage: Usage | None = None


class CompletionChoiceOut(_Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(_Open):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoiceOut]
    usage: Usage | None = None


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str
    backend: str
    ready: bool
    context_length: int | None = None


class ModelList(_Open):
    object: str
    data: list[ModelCard]


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in (
        (400, "bad value, invalid JSON or Host"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "body or prompt too long"),
        (415, "not application/json"),
        (422, "a field of the wrong type"),
        (429, "queue full (Retry-After)"),
        (503, "model loading or unavailable, or shutting down"),
    )
}


def responses_for(schema: type[BaseModel], stream: type[BaseModel] | None = None) -> dict[int | str, Any]:
    """``responses`` of a generation route: ``schema`` as JSON, SSE chunks of ``stream``, the errors."""
    ok: dict[str, Any] = {
        "model": schema,
        "description": "the response (JSON), or with stream: true SSE chunks",
    }
    if stream is not None:
        ok["content"] = {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{stream.__name__}"}}}
    return {200: ok, **ERROR_RESPONSES}


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
