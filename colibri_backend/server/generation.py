"""From a parsed request to generation events: the checks every generation endpoint shares, the
prompt's admission (lengths checked before tokenizing, tokenizing off the event loop) and the async
stream of events from the model's thread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from colibri_backend.backends import LoadedModel
from colibri_backend.errors import ColibriError, ContextFullError
from colibri_backend.generation import token_room
from colibri_backend.server.errors import APIError, bad_value, param_of
from colibri_backend.server.schemas import MAX_N, GenerationRequest
from colibri_backend.server.state import Job, ModelSlot, ServerState, Ticket

# A prompt with more characters than this many per token of context cannot fit, whatever the
# tokenizer: refused before tokenizing, so a huge body costs no tokenizer time.
MAX_CHARS_PER_TOKEN = 64

_SAMPLING_FIELDS = (
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
)


@dataclass
class Checked:
    """A generation request that passed the shared checks, before its prompt is tokenized."""

    slot: ModelSlot
    model: LoadedModel
    sampling: Any  # SamplingParams
    n: int
    max_tokens: int | None  # as requested; None: as many as the context allows
    prompt_param: str  # "messages" or "prompt": the field errors about the prompt name


@dataclass
class Prepared:
    """An admitted request: its choices' prompts, limits and queue ticket."""

    slot: ModelSlot
    model: LoadedModel
    runs: list[tuple[list[int], Any]]  # (prompt ids, SamplingParams) per choice
    prompt_tokens: int
    max_tokens: int
    stop: list[str]
    logprobs: int | None
    stream: bool
    include_usage: bool
    ticket: Ticket
    constraint: Callable[[], Any] | None = None  # a fresh grammar constraint per choice


def check_request(state: ServerState, req: GenerationRequest, prompt_param: str) -> Checked:
    """The checks every generation endpoint makes, in the order a client's mistakes are reported."""
    slot = state.slot_for(req.model)
    model = slot.model
    assert model is not None  # slot_for answers 503 otherwise
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_value(f"n must be between 1 and {MAX_N}, got {n}", "n")
    from colibri_backend.adapters.sampling import SamplingParams

    try:
        sampling = SamplingParams.from_openai(req.model_dump())
    except (ValueError, TypeError) as exc:
        raise bad_value(str(exc), param_of(str(exc), _SAMPLING_FIELDS)) from None
    requested = getattr(req, "max_completion_tokens", None)
    if requested is None:
        requested = req.max_tokens
    if requested is not None and requested < 1:
        raise bad_value(f"max_tokens must be at least 1, got {requested}", "max_tokens")
    if req.stream_options is not None and not req.stream:
        raise bad_value("stream_options is only allowed when stream is true", "stream_options")
    return Checked(slot, model, sampling, n, requested, prompt_param)


def check_prompt_chars(state: ServerState, r: Checked, chars: int) -> None:
    """Refuse a prompt that is too long before spending tokenizer time on it."""
    limit = min(state.limits.max_prompt_chars, r.model.context_length * MAX_CHARS_PER_TOKEN)
    if chars > limit:
        raise APIError(
            413,
            f"The prompt has {chars} characters; this server accepts at most {limit} for this model "
            f"(context length {r.model.context_length} tokens)",
            "invalid_request_error",
            r.prompt_param,
            "context_length_exceeded",
        )


async def tokenize_off_loop(fn: Callable[[], list[list[int]]]) -> list[list[int]]:
    """Run a tokenizing (or template-rendering) step on a worker thread, never on the event loop."""
    return await run_in_threadpool(fn)


def admit(
    state: ServerState,
    r: Checked,
    prompts: list[list[int]],
    logprobs: int | None,
    req: GenerationRequest,
    constraint: Callable[[], Any] | None = None,
) -> Prepared:
    """Check the tokenized prompts against the context and take a place in the model's queue."""
    model = r.model
    for ids in prompts:
        if not ids:
            raise bad_value("the prompt is empty", "prompt")
        if len(ids) > model.context_length:
            raise APIError(
                413,
                f"This model's maximum context length is {model.context_length} tokens; "
                f"the prompt has {len(ids)} tokens",
                "invalid_request_error",
                r.prompt_param,
                "context_length_exceeded",
            )
    room = token_room(model.context_length, max(len(p) for p in prompts))
    max_tokens = room if r.max_tokens is None else min(r.max_tokens, room)
    runs: list[tuple[list[int], Any]] = []
    for ids in prompts:
        for i in range(r.n):
            # Distinct choices need distinct random streams: choice i uses seed + i.
            s = (
                r.sampling
                if i == 0 or r.sampling.seed is None
                else replace(r.sampling, seed=r.sampling.seed + i)
            )
            runs.append((ids, s))
    ticket = state.admit(r.slot)
    return Prepared(
        r.slot,
        model,
        runs,
        sum(len(p) for p in prompts),
        max_tokens,
        list(r.sampling.stop or []),
        logprobs,
        bool(req.stream),
        req.include_usage,
        ticket,
        constraint,
    )


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, ContextFullError):
        return APIError(413, str(exc), "invalid_request_error", None, "context_length_exceeded")
    if isinstance(exc, (ValueError, ColibriError)):
        return bad_value(str(exc))
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")


async def events(state: ServerState, p: Prepared, request: Request) -> AsyncIterator[tuple[int, Any, float]]:
    """Submits the job and yields ``(choice, GenerationEvent, seconds)``; cancels the generation if the
    consumer goes away (client disconnect) before the end."""
    loop = asyncio.get_running_loop()
    job = Job(loop, asyncio.Queue(), p.runs, p.max_tokens, p.stop, p.logprobs, p.constraint)
    p.slot.jobs.add(job)
    finished = False
    try:
        p.slot.executor.submit(p.slot.run, job)
        while True:
            if p.stream:
                # A streamed response's disconnect listener cancels this await. No timeout: wait_for
                # makes a task per event, a third of the event loop's time per streamed token.
                item = await job.queue.get()
            else:
                try:
                    item = await asyncio.wait_for(job.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    # Non-streaming requests have no send() to fail on, so poll for a disconnect.
                    if await request.is_disconnected():
                        return
                    continue
            if item[0] == "end":
                finished = True
                return
            if item[0] == "error":
                finished = True
                raise _as_api_error(item[1])
            yield item[1], item[2], item[3]
    finally:
        if not finished:
            job.cancel.set()
            state.metrics.cancelled.inc()
        p.slot.jobs.discard(job)
        p.ticket.release()
