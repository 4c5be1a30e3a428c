"""The ``colibri`` backend: Colibri's own native engine.

It registers through the same entry-point group and hook as any third-party backend. The engine's
:class:`colibri_backend.engine.Model` is itself a loaded model of the backend protocol
(:class:`colibri_backend.backends.LoadedModel`), so loading an alias is one call: its ``options``
table, with the alias's threads, context length and memory budget, makes the LoadOptions.
"""

from __future__ import annotations

from typing import Any

from colibri_backend.config import ModelConfig
from colibri_backend.hookspecs import hookimpl


def alias_options(cfg: ModelConfig) -> Any:
    """The LoadOptions of a configured alias (its options table; threads, context_length and
    memory_budget from the alias itself)."""
    from colibri_backend.load_options import LoadOptions

    opts = LoadOptions.from_mapping(cfg.options, f"models.{cfg.alias}.options.")
    return opts.with_changes(
        threads=cfg.threads, context_length=cfg.context_length, memory_budget=cfg.memory_budget
    )


class ColibriBackend:
    name = "colibri"
    description = "Colibri's native C engine (GGUF; MoE and dense llama-family models)"

    def unavailable_reason(self) -> str | None:
        try:
            from colibri_backend import _native

            _native.load_library()
        except Exception as exc:  # the shared library is missing, or its ABI does not match
            return f"native library not loadable: {type(exc).__name__}: {exc}"
        return None

    def load(self, model: ModelConfig) -> Any:
        from colibri_backend.engine import load

        return load(model.path, alias_options(model), name=model.alias, chat_template=model.chat_template)


@hookimpl
def colibri_register_backends(register):
    register(ColibriBackend())
