"""Colibri's built-in plugins, installed as ``colibri_backend.plugins``.

Each backend module registers itself through the ``colibri`` entry-point group (see
pyproject.toml and colibri_backend.hookspecs), exactly as a third-party plugin would.
"""
