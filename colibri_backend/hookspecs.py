"""Hook specifications of Colibri's plugin system (pluggy project name ``colibri``).

A plugin is any module or object with functions decorated by :data:`hookimpl`. Installed
distributions publish theirs in the ``colibri`` entry-point group; Colibri's own backends are
registered through that very group, so a third-party backend is a first-class citizen::

    # pyproject.toml of a third-party package
    [project.entry-points.colibri]
    mybackend = "mypackage.colibri_plugin"

    # mypackage/colibri_plugin.py
    from colibri_backend.hookspecs import hookimpl

    @hookimpl
    def colibri_register_backends(register):
        register(MyBackend())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "colibri"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class ColibriSpecs:
    """The hooks Colibri calls on its plugins."""

    @hookspec
    def colibri_register_backends(self, register: Callable[[Any], None]) -> None:
        """Register inference backends.

        Call ``register(backend)`` once per backend. ``backend`` follows the
        :class:`colibri_backend.backends.Backend` protocol: ``name``, ``description``,
        ``unavailable_reason()`` and ``load(model_config)``. Importing the plugin module must stay
        cheap and must not fail when the backend's own package is missing: import it inside
        ``unavailable_reason()`` and ``load()`` instead, so ``colibri backends`` can say why the
        backend cannot run.
        """
