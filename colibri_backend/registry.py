"""The plugin manager and the backend registry built from it.

Every backend, Colibri's own included, arrives through the ``colibri`` entry-point group and its
``colibri_register_backends`` hook (see :mod:`colibri_backend.hookspecs`). A plugin that fails to
import or to register is recorded with its error instead of breaking the others, so
``colibri backends`` can always show what is there and what is wrong.
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import pluggy

from colibri_backend.errors import ColibriError
from colibri_backend.hookspecs import PROJECT_NAME, ColibriSpecs

if TYPE_CHECKING:
    from colibri_backend.backends import Backend, LoadedModel
    from colibri_backend.config import ModelConfig

ENTRY_POINT_GROUP = "colibri"


class UnknownBackendError(ColibriError):
    """No registered backend has that name."""


class BackendUnavailableError(ColibriError):
    """The backend is registered but cannot run here (for example its package is missing)."""


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend and the plugin that registered it."""

    name: str
    backend: Backend
    plugin: str

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot run here, or None when it can."""
        try:
            return self.backend.unavailable_reason()
        except Exception as exc:  # a plugin's own probe failing is itself a reason
            return f"availability check failed: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class PluginProblem:
    """A plugin that could not be imported, or whose hook raised or registered badly."""

    plugin: str
    message: str


def make_plugin_manager(load_entry_points: bool = True) -> tuple[pluggy.PluginManager, list[PluginProblem]]:
    """A plugin manager with Colibri's hookspecs and, by default, every installed plugin."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(ColibriSpecs)
    problems: list[PluginProblem] = []
    if load_entry_points:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
                continue  # the same distribution seen twice on sys.path
            try:
                plugin = ep.load()
            except Exception as exc:
                why = f"cannot import {ep.value}: {type(exc).__name__}: {exc}"
                problems.append(PluginProblem(ep.name, why))
                continue
            pm.register(plugin, name=ep.name)
    return pm, problems


class Registry:
    """Backends by name, collected from a plugin manager's ``colibri_register_backends`` hooks."""

    def __init__(self, pm: pluggy.PluginManager, problems: list[PluginProblem] | None = None) -> None:
        self.plugin_manager = pm
        self.problems: list[PluginProblem] = list(problems or [])
        self._entries: dict[str, BackendEntry] = {}
        self._collect(pm)

    def _collect(self, pm: pluggy.PluginManager) -> None:
        """Call the hook through pluggy (so hook wrappers and tryfirst / trylast ordering apply). A
        registration is attributed to the plugin whose implementation made it; a plugin whose
        implementation raises is recorded, unregistered, and the hook called again without it, so it
        cannot hide the backends of the others."""
        hook = pm.hook.colibri_register_backends
        while True:
            impls = {
                impl.function.__code__: pm.get_name(impl.plugin) or repr(impl.plugin)
                for impl in hook.get_hookimpls()
            }
            found: list[tuple[str, Any]] = []  # (plugin, backend) in call order
            try:
                hook(register=_recorder(found, impls))
            except Exception as exc:
                culprit = _raising_plugin(exc, impls)
                for plugin_name, backend in found:
                    if plugin_name == culprit and not _is_backend(backend):
                        self._add(plugin_name, backend)  # records what it lacks
                why = f"colibri_register_backends raised {type(exc).__name__}: {exc}"
                self.problems.append(PluginProblem(culprit or "colibri_register_backends", why))
                plugin = pm.get_plugin(culprit) if culprit else None
                if plugin is None:
                    return
                pm.unregister(plugin)
                continue
            for plugin_name, backend in found:
                self._add(plugin_name, backend)
            return

    def _add(self, plugin_name: str, backend: Any) -> None:
        if not _is_backend(backend):
            missing = [a for a in ("name", "load", "unavailable_reason") if not hasattr(backend, a)]
            self.problems.append(
                PluginProblem(plugin_name, f"registered {backend!r}, which lacks {', '.join(missing)}")
            )
            return
        name = str(backend.name)
        if name in self._entries:
            kept = self._entries[name].plugin
            self.problems.append(
                PluginProblem(plugin_name, f"backend {name!r} is already registered by plugin {kept!r}")
            )
            return
        self._entries[name] = BackendEntry(name=name, backend=backend, plugin=plugin_name)

    def names(self) -> list[str]:
        """Registered backend names, sorted."""
        return sorted(self._entries)

    def entries(self) -> list[BackendEntry]:
        """Registered backends, sorted by name."""
        return [self._entries[n] for n in self.names()]

    def get(self, name: str) -> BackendEntry:
        """The backend called ``name``; raises UnknownBackendError listing the known ones."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise UnknownBackendError(f"unknown backend {name!r} (registered: {known})") from None

    def require(self, name: str) -> Backend:
        """The backend called ``name``, checked to be runnable here."""
        entry = self.get(name)
        reason = entry.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
        return entry.backend

    def load_model(self, model: ModelConfig) -> LoadedModel:
        """Load a configured model alias with its backend."""
        loaded = self.require(model.backend).load(model)
        caps = getattr(loaded, "capabilities", None)
        if model.memory_budget is not None and not getattr(caps, "memory_budget", False):
            warnings.warn(
                f"model {model.alias!r}: backend {model.backend!r} does not support memory_budget; "
                "the whole model is loaded",
                RuntimeWarning,
                stacklevel=2,
            )
        return loaded


def _recorder(found: list[tuple[str, Any]], impls: dict[Any, str]) -> Any:
    """The ``register`` callable handed to the hook: records each backend with its plugin."""
    return lambda backend: found.append((_calling_plugin(impls), backend))


def _is_backend(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("name", "load", "unavailable_reason"))


def _calling_plugin(impls: dict[Any, str]) -> str:
    """The plugin whose hook implementation is on the stack (innermost first)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = impls.get(frame.f_code)
        if name is not None:
            return name
        frame = frame.f_back
    return "unknown plugin"


def _raising_plugin(exc: BaseException, impls: dict[Any, str]) -> str | None:
    """The plugin whose hook implementation raised ``exc`` (the innermost one in its traceback)."""
    culprit = None
    tb = exc.__traceback__
    while tb is not None:
        culprit = impls.get(tb.tb_frame.f_code, culprit)
        tb = tb.tb_next
    return culprit


_lock = threading.Lock()
_default: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry of installed plugins (built once, on first use)."""
    global _default
    with _lock:
        if _default is None or refresh:
            pm, problems = make_plugin_manager()
            _default = Registry(pm, problems)
        return _default


def load_model(model: ModelConfig) -> LoadedModel:
    """Load a configured model with the backend it names, through the default registry."""
    return get_registry().load_model(model)


def open_model(name: str | None = None, config: str | None = None) -> LoadedModel:
    """Load a model the way an application should: by alias from the configuration.

    ``name`` is an alias from colibri.toml (default: the configured default model), or a path or
    known model name; ``config`` a colibri.toml path (default: $COLIBRI_CONFIG, ./colibri.toml, ...).
    The backend comes from the configuration and $COLIBRI_BACKEND, so the same code runs on any of
    them."""
    from colibri_backend.config import load_config

    return load_model(load_config(config).model(name))
