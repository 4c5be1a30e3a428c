"""Chat templates: render a model's Jinja chat template the way transformers does.

The template comes from the GGUF (tokenizer.chat_template) or from tokenizer_config.json
(chat_template, a string or a list of named templates). The environment matches
transformers' apply_chat_template: a sandboxed, immutable Jinja environment with trim_blocks
and lstrip_blocks, loop controls, a `tojson` filter that keeps non-ASCII text, the globals
raise_exception() and strftime_now(), and the {% generation %} block tag. The messages are prepared
as apply_chat_template prepares them: keys whose value is None are dropped, a message's reasoning
given as `reasoning_content`, `thinking` or `reasoning` is passed under both `reasoning_content` and
`thinking`, and `tools` and `documents` are always defined (None when not given).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from colibri_backend.errors import ColibriError


class ChatTemplateError(ColibriError, ValueError):
    """The model has no chat template, or its template failed on these messages."""


class _GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for training masks; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
    except RecursionError:
        # jinja2's parser and code generator recurse per nesting level: a template from a hostile
        # file ("((((...") exhausts the stack (found by tools/fuzz_python.py)
        raise ChatTemplateError("the chat template does not compile: it is nested too deeply") from None


def template_from_tokenizer_config(path: str | os.PathLike[str], name: str | None = None) -> str | None:
    """The chat template in a tokenizer_config.json (or a chat_template.jinja beside it)."""
    path = Path(path)
    jinja_file = path.with_name("chat_template.jinja")
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if isinstance(template, list):
        # A list of {"name": ..., "template": ...}; "default" unless a name is asked for.
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        return by_name.get(name or "default") or (next(iter(by_name.values()), None))
    return template if isinstance(template, str) else None


# The names a message's reasoning comes under; templates read `reasoning_content` (Qwen3, GLM, DeepSeek)
# or `thinking` (gpt-oss), so it is passed under both, as transformers does.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One message as apply_chat_template hands it to the template."""
    m = {k: v for k, v in message.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        if not source:
            raise ChatTemplateError("empty chat template")
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (OpenAI-style dicts with role and content)."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ChatTemplateError(f"message {i} must be a dict with a 'role'")
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": [_prepare_message(m) for m in messages],
            "tools": list(tools) if tools is not None else None,
            "documents": extra.get("documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
        except RecursionError:
            # a template that recurses without end (a macro calling itself)
            raise ChatTemplateError("the chat template failed: it recursed too deeply") from None
        except Exception as exc:
            # the template is a program from the model file: whatever its expressions raise
            # (TypeError from `undefined | tojson` or `1 + 'a'`, ZeroDivisionError, ...; found by
            # tools/fuzz_python.py) is that template failing on these messages
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc


def render_chat(
    source: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    model_name: str = "this model",
    **extra: Any,
) -> str:
    """Render `messages` with a template source; a clear error when there is none."""
    if not source:
        raise ChatTemplateError(
            f"{model_name} has no chat template (no tokenizer.chat_template in the GGUF and no "
            "tokenizer_config.json chat_template); use generate() with a plain prompt instead"
        )
    return ChatTemplate(source, bos_token, eos_token).render(
        messages, add_generation_prompt=add_generation_prompt, **extra
    )
