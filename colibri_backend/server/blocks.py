"""Output as a sequence of blocks (reasoning, text, tool call) for the APIs that stream items rather than
choices: ``/v1/responses`` (output items) and ``/v1/messages`` (content blocks). A :class:`BlockStream` turns
one generation's events into block operations; each API formats them as its own events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request

from colibri_backend.server.chat_output import ParsedOutput
from colibri_backend.server.chat_pipeline import ChatPlan
from colibri_backend.server.generation import Prepared, events
from colibri_backend.server.responses import _Usage
from colibri_backend.server.state import ServerState
from colibri_backend.server.tool_calls import ToolCall


@dataclass
class Block:
    kind: Literal["reasoning", "text", "tool_call"]
    text: str = ""
    call: ToolCall | None = None
    closed: bool = False


@dataclass
class Op:
    """``open`` a block, add a ``delta`` of text to it, or ``close`` it."""

    op: Literal["open", "delta", "close"]
    index: int
    block: Block
    text: str = ""


@dataclass
class BlockStream:
    out: ParsedOutput
    blocks: list[Block] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # tokens whose text went to reasoning

    def _open(self, kind: Any, call: ToolCall | None = None) -> list[Op]:
        ops = self.close()
        self.blocks.append(Block(kind, call=call))
        return ops + [Op("open", len(self.blocks) - 1, self.blocks[-1])]

    def close(self) -> list[Op]:
        if self.blocks and not self.blocks[-1].closed:
            self.blocks[-1].closed = True
            return [Op("close", len(self.blocks) - 1, self.blocks[-1])]
        return []

    def add(self, ev: Any) -> list[Op]:
        self.completion_tokens += 1
        ops: list[Op] = []
        last = bool(ev.finish_reason)
        for p in self.out.add(ev.token_id, ev.text, last):
            if p.kind == "tool_call":
                ops += self._open("tool_call", p.call)
                ops += self.close()
                continue
            kind = "reasoning" if p.kind == "reasoning" else "text"
            if not p.text:
                continue
            current = self.blocks[-1] if self.blocks else None
            if current is None or current.kind != kind or current.closed:
                ops += self._open(kind)
            self.blocks[-1].text += p.text
            if kind == "reasoning" and (
                not ops or ops[-1].block.kind != "reasoning" or ops[-1].op != "delta"
            ):
                self.reasoning_tokens += 1
            ops.append(Op("delta", len(self.blocks) - 1, self.blocks[-1], p.text))
        if last:
            self.finish_reason = self.out.finish_reason(ev.finish_reason)
            ops += self.close()
        return ops


async def block_ops(
    state: ServerState, p: Prepared, plan: ChatPlan, request: Request, endpoint: str
) -> AsyncIterator[tuple[BlockStream, list[Op], dict[str, Any] | None]]:
    """Run ``p`` (one choice) and yield ``(stream, ops, None)`` per event, then ``(stream, [], usage)``."""
    stream = BlockStream(ParsedOutput(plan.parser(), plan.parallel))
    usage = _Usage(state, p, endpoint)
    async with aclosing(events(state, p, request)) as evs:
        async for idx, ev, secs in evs:
            usage.add(idx, secs, ev)
            yield stream, stream.add(ev), None
    if stream.finish_reason is None:
        stream.finish_reason = "length"
    yield stream, stream.close(), usage.close()


async def final_blocks(
    state: ServerState, p: Prepared, plan: ChatPlan, request: Request, endpoint: str
) -> tuple[BlockStream, dict[str, Any] | None]:
    """The non-streamed answer: run ``p`` to its end and return the closed stream and its usage; the
    request's ticket is released however the run ends."""
    try:
        last = None
        async for stream, _ops, usage in block_ops(state, p, plan, request, endpoint):
            last = (stream, usage)
    finally:
        p.ticket.release()
    assert last is not None  # block_ops always yields its closing tuple
    return last
