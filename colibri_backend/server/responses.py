"""The one response builder: generation events in, an OpenAI response out (one JSON object, or SSE
chunks ending in ``data: [DONE]``). Endpoints differ only in their choice builder (how an event becomes
a chunk's choice and how a finished choice looks) and their object names."""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from colibri_backend.backends import LoadedModel
from colibri_backend.server.errors import APIError
from colibri_backend.server.generation import Prepared, events
from colibri_backend.server.state import ServerState, Ticket


def token_text(model: LoadedModel, token_id: int) -> str:
    """The text of one token as logprobs show it (a backend's own spelling when it has one)."""
    fn = getattr(model, "token_text", None)
    if fn is not None:
        return fn(token_id)
    tok = getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "token_text"):
        return tok.token_text(token_id)
    return model.detokenize([token_id])


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class ChoiceBuilder(ABC):
    """One choice of a response, built from its events. ``KIND`` / ``CHUNK_KIND`` are the response's and
    a stream chunk's ``object``, ``ID_PREFIX`` starts the response's id."""

    KIND = ""
    CHUNK_KIND = ""
    ID_PREFIX = ""

    def __init__(self, index: int, model: LoadedModel, logprobs: int | None) -> None:
        self.index = index
        self.model = model
        self.logprobs = logprobs
        self.texts: list[str] = []
        self.finish_reason: str | None = None

    def add(self, ev: Any) -> list[dict[str, Any]]:
        """Take one event; return the streamed choices it makes (none, one or several chunks)."""
        self.texts.append(ev.text)
        if ev.finish_reason:
            self.finish_reason = ev.finish_reason
        return self.chunks(ev)

    @abstractmethod
    def chunks(self, ev: Any) -> list[dict[str, Any]]: ...

    @abstractmethod
    def final(self) -> dict[str, Any]: ...


class ChatChoice(ChoiceBuilder):
    KIND, CHUNK_KIND, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, index: int, model: LoadedModel, logprobs: int | None) -> None:
        super().__init__(index, model, logprobs)
        self.entries: list[dict[str, Any]] = []

    def _entry(self, ev: Any) -> dict[str, Any]:
        text = token_text(self.model, ev.token_id)
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

    def chunks(self, ev: Any) -> list[dict[str, Any]]:
        out = []
        if len(self.texts) == 1:  # the first event opens the assistant's message
            out.append(self._choice({"role": "assistant", "content": ""}))
        lp = None
        if self.logprobs is not None:
            entry = self._entry(ev)
            self.entries.append(entry)
            lp = {"content": [entry]}
        if ev.text or lp is not None:
            out.append(self._choice({"content": ev.text}, lp))
        if ev.finish_reason:
            out.append(self._choice({}, None, ev.finish_reason))
        return out

    def _choice(self, delta: dict[str, Any], lp: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def final(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "message": {"role": "assistant", "content": "".join(self.texts)},
            "logprobs": {"content": self.entries} if self.logprobs is not None else None,
            "finish_reason": self.finish_reason or "length",
        }


class CompletionChoice(ChoiceBuilder):
    KIND, CHUNK_KIND, ID_PREFIX = "text_completion", "text_completion", "cmpl"

    def __init__(self, index: int, model: LoadedModel, logprobs: int | None) -> None:
        super().__init__(index, model, logprobs)
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top: list[dict[str, float]] = []
        self.offsets: list[int] = []
        self.offset = 0

    def chunks(self, ev: Any) -> list[dict[str, Any]]:
        lp = None
        if self.logprobs is not None:
            self.tokens.append(token_text(self.model, ev.token_id))
            self.token_logprobs.append(ev.logprob)
            self.top.append(dict(ev.top_logprobs or {}))
            self.offsets.append(self.offset)
            lp = self._logprobs(slice(-1, None))
        self.offset += len(ev.text)
        if not (ev.text or lp is not None or ev.finish_reason):
            return []
        return [{"index": self.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}]

    def _logprobs(self, part: slice) -> dict[str, Any]:
        return {
            "tokens": self.tokens[part],
            "token_logprobs": self.token_logprobs[part],
            "top_logprobs": self.top[part],
            "text_offset": self.offsets[part],
        }

    def final(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": "".join(self.texts),
            "logprobs": self._logprobs(slice(None)) if self.logprobs is not None else None,
            "finish_reason": self.finish_reason or "length",
        }


class _Stream(StreamingResponse):
    """An SSE response that always releases its queue ticket and closes its generator, also when the
    client disconnects before or during the stream."""

    def __init__(self, body: AsyncIterator[bytes], ticket: Ticket) -> None:
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


class _Usage:
    """Token counts of one response, added to the server's metrics once it ends."""

    def __init__(self, state: ServerState, p: Prepared, endpoint: str) -> None:
        self.state, self.p, self.endpoint = state, p, endpoint
        self.count = 0
        self.seconds: dict[int, float] = {}  # generation seconds per choice, at its last event
        self.cached: dict[int, int] = {}  # prompt tokens reused from the prefix cache, per choice
        self.t0 = time.perf_counter()

    def add(self, idx: int, secs: float, ev: Any) -> None:
        self.count += 1
        self.seconds[idx] = secs
        if ev.cached_tokens is not None:  # the first event of a backend that reports it
            self.cached[idx] = ev.cached_tokens

    def close(self) -> dict[str, Any]:
        """OpenAI's usage object; the other APIs reshape it (prompt_tokens_details.cached_tokens)."""
        m, p = self.state.metrics, self.p
        seconds = sum(self.seconds.values())
        m.prompt_tokens.inc(p.prompt_tokens)
        m.completion_tokens.inc(self.count)
        m.generation_seconds.inc(seconds)
        m.request_seconds.labels(self.endpoint).observe(time.perf_counter() - self.t0)
        if seconds > 0:
            m.decode_tokens_per_second.labels(p.slot.cfg.alias).observe(self.count / seconds)
        return {
            "prompt_tokens": p.prompt_tokens,
            "completion_tokens": self.count,
            "total_tokens": p.prompt_tokens + self.count,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


async def respond(
    state: ServerState, p: Prepared, request: Request, model_name: str, builder: type[ChoiceBuilder]
) -> Response:
    """Run ``p`` and answer it with ``builder``'s choices, under the builder's object names and ids."""
    kind = builder.KIND
    head = {
        "id": f"{builder.ID_PREFIX}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": f"colibri-{p.slot.cfg.backend}",
    }
    choices = [builder(i, p.model, p.logprobs) for i in range(len(p.runs))]
    usage = _Usage(state, p, request.url.path)

    if p.stream:
        chunk_head = {**head, "object": builder.CHUNK_KIND}

        def chunk(streamed: list[dict[str, Any]], counts: Any = None) -> bytes:
            obj = {**chunk_head, "choices": streamed}
            if p.include_usage:
                obj["usage"] = counts
            return sse(obj)

        async def body() -> AsyncIterator[bytes]:
            try:
                async with aclosing(events(state, p, request)) as stream:
                    async for idx, ev, secs in stream:
                        usage.add(idx, secs, ev)
                        for c in choices[idx].add(ev):
                            yield chunk([c])
            except APIError as err:
                yield sse(err.body())
                yield b"data: [DONE]\n\n"
                return
            counts = usage.close()
            if p.include_usage:
                yield chunk([], counts)
            yield b"data: [DONE]\n\n"

        return _Stream(body(), p.ticket)

    try:
        async with aclosing(events(state, p, request)) as stream:
            async for idx, ev, secs in stream:
                usage.add(idx, secs, ev)
                choices[idx].add(ev)
    finally:
        p.ticket.release()
    return JSONResponse({**head, "choices": [c.final() for c in choices], "usage": usage.close()})
