"""Colibri models in Simon Willison's `llm` tool (entry-point group ``llm``).

Every alias of the Colibri configuration (colibri.toml or $COLIBRI_CONFIG, with the COLIBRI_* environment
overrides; without a file, the default ``smollm2``) becomes an `llm` model ``colibri/ALIAS``, run by the
backend the alias names (Colibri's native engine by default, or llama_cpp / transformers)::

    llm -m colibri/smollm2 "Name three rivers in France"
    llm -m colibri/smollm2 -o temperature 0.7 -o max_tokens 64 -o seed 1 "Write a haiku"
    llm -c "And in Spain?"                      # continue the conversation
    llm colibri models                          # the aliases, their backends and files

Prompts go through the model's chat template (system prompt, earlier turns of the conversation, then the
new prompt); a model without a template gets the plain text. Options: temperature (default 0: greedy),
max_tokens, top_p, seed, memory_budget (e.g. "1.5G"; kept for backends that honour budgets). Output streams
token by token, and the usage (input / output tokens) is recorded in llm's log.

The plugin module is imported by every `llm` command, so it imports nothing heavy at the top: the
configuration is read when llm asks for the models, and a model is loaded on its first prompt (then kept for
the rest of the process, which matters in `llm chat`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import click
import llm
from pydantic import Field, field_validator

MODEL_PREFIX = "colibri/"
DEFAULT_MAX_TOKENS = 512


def _load_config() -> Any:
    from colibri_backend.config import load_config

    return load_config()


def _aliases() -> tuple[Any, list[Any], str | None]:
    """(config or None, model configs, error message or None). A broken colibri.toml must not break llm."""
    try:
        cfg = _load_config()
    except Exception as exc:  # reported, and the default model is still offered
        from colibri_backend.config import Config, apply_env

        message = f"llm-colibri: ignoring the Colibri configuration: {exc}"
        try:
            cfg = apply_env(Config(), {})
        except Exception:
            return None, [], message
        return cfg, [cfg.model()], message
    models = dict(cfg.models)
    if cfg.default_model not in models:
        default = cfg.model()
        models[default.alias] = default
    return cfg, list(models.values()), None


class ColibriOptions(llm.Options):
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description="Sampling temperature; 0 (the default) is greedy decoding"
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description=f"Maximum tokens to generate (default {DEFAULT_MAX_TOKENS})"
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling probability mass")
    seed: int | None = Field(default=None, ge=0, description="Random seed: same seed, same output")
    memory_budget: str | None = Field(
        default=None, description="Memory budget of the model, e.g. 1.5G or 800M (backends that support it)"
    )

    @field_validator("memory_budget")
    @classmethod
    def _valid_budget(cls, value: str | None) -> str | None:
        if value is not None:
            from colibri_backend.config import parse_size

            parse_size(value, "memory_budget")  # raises a ValueError naming the option
        return value


class ColibriLLMModel(llm.Model):
    """One alias of the Colibri configuration as an `llm` model."""

    can_stream = True
    supports_conversation = True
    Options = ColibriOptions

    _loaded: dict[tuple[str, int | None], Any] = {}
    _load_lock = threading.Lock()

    def __init__(self, model_config: Any) -> None:
        self.model_config = model_config
        self.model_id = MODEL_PREFIX + model_config.alias

    def __str__(self) -> str:
        return f"Colibri: {self.model_id} ({self.model_config.backend}: {self.model_config.path})"

    # ---- loading -----------------------------------------------------------------------------------------

    def loaded(self, memory_budget: int | None = None) -> Any:
        """The backend's loaded model for this alias (loaded once per process and budget)."""
        from colibri_backend.registry import load_model

        cfg = self.model_config
        if memory_budget is not None:
            cfg = replace(cfg, memory_budget=memory_budget)
        key = (cfg.alias, cfg.memory_budget)
        with self._load_lock:
            model = self._loaded.get(key)
            if model is None:
                model = load_model(cfg)
                self._loaded[key] = model
            return model

    # ---- prompting ---------------------------------------------------------------------------------------

    def execute(self, prompt: Any, stream: bool, response: Any, conversation: Any) -> Iterator[str]:
        from colibri_backend.adapters.sampling import SamplingParams
        from colibri_backend.config import parse_size

        opts = prompt.options
        budget = parse_size(opts.memory_budget, "memory_budget") if opts.memory_budget else None
        model = self.loaded(budget)
        messages = conversation_messages(prompt, conversation)
        if getattr(model.capabilities, "chat", False):
            text = model.render_chat(messages, add_generation_prompt=True)
            ids = model.tokenize(text, add_special_tokens=False)
        else:
            ids = model.tokenize(plain_text(messages), add_special_tokens=True)
        sampling = SamplingParams.from_llm_options(
            temperature=opts.temperature,
            top_p=opts.top_p,
            seed=opts.seed,
        )
        max_tokens = opts.max_tokens or DEFAULT_MAX_TOKENS
        n_out = 0
        try:
            for event in model.generate_tokens(ids, max_tokens=max_tokens, sampling=sampling):
                if event.token_id >= 0:
                    n_out += 1
                if event.text:
                    yield event.text
        finally:
            response.set_usage(input=len(ids), output=n_out)


def _message_text(message: Any) -> str:
    parts = getattr(message, "parts", None)
    if parts is None:
        return str(getattr(message, "content", "") or "")
    return "".join(getattr(p, "text", "") or "" for p in parts if type(p).__name__ == "TextPart")


def conversation_messages(prompt: Any, conversation: Any) -> list[dict[str, str]]:
    """OpenAI-style messages for this turn: system, earlier turns, then the new prompt.

    llm 0.26+ gives the whole chain as prompt.messages; older versions only give the conversation's
    responses, from which the turns are rebuilt.
    """
    messages: list[dict[str, str]] = []
    chain = None
    try:
        chain = list(prompt.messages)
    except AttributeError:
        chain = None
    has_history = chain is not None and any(getattr(m, "role", "") == "assistant" for m in chain)
    earlier = list(getattr(conversation, "responses", None) or []) if conversation is not None else []
    if chain is not None and (has_history or not earlier):
        for m in chain:
            role = getattr(m, "role", "user")
            if role in ("system", "user", "assistant"):
                messages.append({"role": role, "content": _message_text(m)})
        return messages
    system = prompt.system or next((r.prompt.system for r in earlier if r.prompt.system), None)
    if system:
        messages.append({"role": "system", "content": system})
    for r in earlier:
        messages.append({"role": "user", "content": r.prompt.prompt or ""})
        messages.append({"role": "assistant", "content": r.text_or_raise()})
    messages.append({"role": "user", "content": prompt.prompt or ""})
    return messages


def plain_text(messages: list[dict[str, str]]) -> str:
    """A prompt for models without a chat template: the turns' texts, one after the other."""
    return "\n\n".join(m["content"] for m in messages if m["content"])


# ---- hooks -------------------------------------------------------------------------------------------------


@llm.hookimpl
def register_models(register: Any) -> None:
    cfg, models, problem = _aliases()
    if problem:
        print(problem, file=sys.stderr)
    default = cfg.default_model if cfg is not None else None
    for mc in models:
        register(ColibriLLMModel(mc), aliases=("colibri",) if mc.alias == default else ())


@llm.hookimpl
def register_commands(cli: Any) -> None:
    @cli.group(name="colibri")
    def colibri_group() -> None:
        "Colibri: mixture-of-experts models on a native engine"

    @colibri_group.command(name="models")
    def models_command() -> None:
        "List the models of the Colibri configuration, as llm model ids"
        cfg, models, problem = _aliases()
        if problem:
            click.echo(problem, err=True)
        source = getattr(cfg, "source", None)
        click.echo(f"# configuration: {source if source else 'defaults (no colibri.toml found)'}")
        for mc in models:
            mark = " (default, alias: colibri)" if cfg is not None and mc.alias == cfg.default_model else ""
            extra = []
            if mc.memory_budget:
                extra.append(f"memory_budget={mc.memory_budget}")
            if mc.threads:
                extra.append(f"threads={mc.threads}")
            if mc.context_length:
                extra.append(f"context_length={mc.context_length}")
            tail = f" [{', '.join(extra)}]" if extra else ""
            click.echo(f"{MODEL_PREFIX}{mc.alias}{mark}: backend={mc.backend} path={mc.path}{tail}")
