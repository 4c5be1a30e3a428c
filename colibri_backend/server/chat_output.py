"""The chat completion choice when the output is parsed: answer text as ``content``, reasoning as
``reasoning_content``, tool calls as ``tool_calls`` (streamed as deltas, each call once it is complete),
and ``finish_reason: tool_calls`` when the model called a tool."""

from __future__ import annotations

from typing import Any

from colibri_backend.backends import LoadedModel
from colibri_backend.server.responses import ChatChoice
from colibri_backend.server.tool_calls import OutputParser, Part, ToolCall


class ParsedOutput:
    """The parts of one choice's output so far, with the single-call rule of parallel_tool_calls false."""

    def __init__(self, parser: OutputParser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def add(self, token_id: int, text: str, last: bool) -> list[Part]:
        parts = (
            self.parser.feed(token_id, text) if token_id >= 0 else ([Part("content", text)] if text else [])
        )
        if last:
            parts += self.parser.finish()
        kept = []
        for p in parts:
            if p.kind == "tool_call":
                if self.calls and not self.parallel:
                    continue
                self.calls.append(p.call)  # type: ignore[arg-type]
            elif p.kind == "reasoning":
                self.reasoning.append(p.text)
            else:
                self.content.append(p.text)
            kept.append(p)
        return kept

    def finish_reason(self, reason: str | None) -> str:
        return "tool_calls" if self.calls and reason in ("stop", None) else (reason or "length")


class ParsedChatChoice(ChatChoice):
    """A chat choice whose output goes through a request's :class:`ChatPlan` parser; the response builder
    makes its choices from a class, so :meth:`for_plan` gives the one of a request."""

    plan: Any = None  # chat_pipeline.ChatPlan

    def __init__(self, index: int, model: LoadedModel, logprobs: int | None) -> None:
        super().__init__(index, model, logprobs)
        self.out = ParsedOutput(self.plan.parser(), self.plan.parallel)

    @classmethod
    def for_plan(cls, plan: Any) -> type[ParsedChatChoice]:
        return type(cls.__name__, (cls,), {"plan": plan})

    def chunks(self, ev: Any) -> list[dict[str, Any]]:
        chunks = []
        if len(self.texts) == 1:
            chunks.append(self._choice({"role": "assistant", "content": ""}))
        lp = None
        if self.logprobs is not None:
            entry = self._entry(ev)
            self.entries.append(entry)
            lp = {"content": [entry]}
        n_calls = len(self.out.calls)
        for p in self.out.add(ev.token_id, ev.text, bool(ev.finish_reason)):
            if p.kind == "tool_call":
                delta = {"tool_calls": [p.call.openai(index=n_calls)]}  # type: ignore[union-attr]
                n_calls += 1
            elif p.kind == "reasoning":
                delta = {"reasoning_content": p.text}
            else:
                delta = {"content": p.text}
            chunks.append(self._choice(delta, lp))
            lp = None
        if lp is not None:
            chunks.append(self._choice({"content": ""}, lp))
        if ev.finish_reason:
            chunks.append(self._choice({}, None, self.out.finish_reason(ev.finish_reason)))
        return chunks

    def final(self) -> dict[str, Any]:
        out = self.out
        message: dict[str, Any] = {"role": "assistant", "content": "".join(out.content)}
        if out.calls:
            message["content"] = message["content"] or None
            message["tool_calls"] = [c.openai() for c in out.calls]
        if out.reasoning:
            message["reasoning_content"] = "".join(out.reasoning)
        return {
            "index": self.index,
            "message": message,
            "logprobs": {"content": self.entries} if self.logprobs is not None else None,
            "finish_reason": out.finish_reason(self.finish_reason),
        }
