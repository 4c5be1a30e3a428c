"""Colibri: run mixture-of-experts language models from GGUF files with a native C engine.

    import colibri_backend
    model = colibri_backend.load("smollm2")          # or a GGUF path, or a Hugging Face checkpoint dir
    print(model.generate("def fibonacci(n):", max_tokens=64))

Importing the package is cheap: the native library and the tokenizer load on first use, and
neither torch nor transformers is ever imported here. ``import colibri_backend.transformers_glue``
registers ColibriConfig / ColibriForCausalLM with transformers' Auto classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colibri_backend.errors import (
    BudgetError,
    ColibriError,
    ContextFullError,
    EngineError,
    ModelFormatError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from colibri_backend.adapters.sampling import SamplingParams
    from colibri_backend.engine import Model, ModelInfo, load, plan_memory, replay_routing
    from colibri_backend.generation import GenerationEvent
    from colibri_backend.load_options import LoadOptions
    from colibri_backend.models import default_model_path, resolve_model

_LAZY = {
    "load": "colibri_backend.engine",
    "Model": "colibri_backend.engine",
    "ModelInfo": "colibri_backend.engine",
    "GenerationEvent": "colibri_backend.generation",
    "LoadOptions": "colibri_backend.load_options",
    "plan_memory": "colibri_backend.engine",
    "replay_routing": "colibri_backend.engine",
    "default_model_path": "colibri_backend.models",
    "resolve_model": "colibri_backend.models",
    "SamplingParams": "colibri_backend.adapters.sampling",
}

__all__ = [
    "BudgetError",
    "ColibriError",
    "ContextFullError",
    "EngineError",
    "GenerationEvent",
    "LoadOptions",
    "Model",
    "ModelFormatError",
    "ModelInfo",
    "SamplingParams",
    "UnsupportedModelError",
    "__version__",
    "default_model_path",
    "load",
    "plan_memory",
    "replay_routing",
    "resolve_model",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'colibri_backend' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
