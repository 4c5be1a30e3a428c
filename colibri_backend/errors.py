"""Exceptions raised by colibri_backend."""

from __future__ import annotations


class ColibriError(Exception):
    """Base class of every error Colibri raises on purpose."""


class EngineError(ColibriError):
    """The native engine reported a failure; `status` is its colibri_status name."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{message} [{status}]" if message else status)
        self.status = status
        self.message = message


class ModelFormatError(EngineError):
    """The model file is corrupt, truncated or inconsistent."""


class UnsupportedModelError(EngineError):
    """The file is valid but uses an architecture or tensor type Colibri does not run."""


class ContextFullError(EngineError):
    """The tokens do not fit in the context window."""


class BudgetError(EngineError):
    """The memory budget cannot hold the minimum working set."""
