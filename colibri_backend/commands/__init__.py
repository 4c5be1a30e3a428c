"""Subcommands of the `colibri` CLI, one module each (see colibri_backend.cli)."""
