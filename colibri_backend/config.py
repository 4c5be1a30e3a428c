"""Configuration: ``colibri.toml`` plus environment overrides.

Where the file comes from, first match wins: the ``--config`` argument, ``$COLIBRI_CONFIG``,
``./colibri.toml``, ``$XDG_CONFIG_HOME/colibri/colibri.toml`` (``~/.config/...``). With no file
the defaults apply: backend ``colibri`` and one alias, ``smollm2``, the default model.

Example::

    backend = "colibri"          # default backend of every alias that names none
    model = "smol"               # the default alias

    [server]
    host = "127.0.0.1"
    port = 8000
    api_key = "sk-local"         # or $COLIBRI_API_KEY; no key means no authentication
    max_queue = 16

    [models.smol]
    path = "models/SmolLM2-135M-Instruct.Q4_1.gguf"   # relative to this file; or a known name
    backend = "llama_cpp"        # optional, else the default backend
    threads = 2
    context_length = 2048
    memory_budget = "1.5G"
    chat_template = "templates/chatml.jinja"           # a file, or the template text itself

    [models.smol.options]        # passed to the backend untouched
    n_batch = 256

Environment overrides (they win over the file): ``COLIBRI_BACKEND`` (every alias), ``COLIBRI_MODEL``
(the default alias, or a model path / known name served as an extra alias), ``COLIBRI_THREADS``,
``COLIBRI_CONTEXT_LENGTH``, ``COLIBRI_MEMORY_BUDGET`` (every alias), ``COLIBRI_API_KEY``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from colibri_backend.errors import ColibriError

DEFAULT_BACKEND = "colibri"
DEFAULT_MODEL = "smollm2"
CONFIG_FILE_NAME = "colibri.toml"


class ConfigError(ColibriError, ValueError):
    """The configuration is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class ModelConfig:
    """One model alias: what to load and with which backend."""

    alias: str
    path: str  # a file or directory path, or a known model name such as "smollm2"
    backend: str = DEFAULT_BACKEND
    threads: int | None = None
    context_length: int | None = None
    memory_budget: int | None = None  # bytes
    chat_template: str | None = None  # template text overriding the model's own
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 16


@dataclass(frozen=True)
class Config:
    backend: str = DEFAULT_BACKEND
    default_model: str = DEFAULT_MODEL
    models: dict[str, ModelConfig] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)
    source: Path | None = None

    def model(self, name: str | None = None) -> ModelConfig:
        """The alias ``name`` (default: the default alias), or an ad-hoc alias for a path / model name."""
        name = name or self.default_model
        if name in self.models:
            return self.models[name]
        path = _expand_model_path(name, Path.cwd())
        # A file or directory is served under its base name ("SmolLM2-135M-Instruct.Q4_1"), a known
        # model under its name ("smollm2").
        alias = Path(path).name.removesuffix(".gguf") if Path(path).is_absolute() else name
        return ModelConfig(alias=alias, path=path, backend=self.backend)

    def with_model(self, spec: str, backend: str | None = None) -> Config:
        """A copy whose default alias is ``spec`` (an alias, a path or a known name), optionally
        forced onto ``backend``."""
        models = dict(self.models)
        target = models.get(spec) or self.model(spec)
        if backend is not None:
            target = replace(target, backend=backend)
        models[target.alias] = target
        return replace(self, models=models, default_model=target.alias)


def parse_size(value: Any, key: str = "memory_budget") -> int:
    """Bytes of a size setting, by colibri_backend.budget.parse_size (the one parser: binary units,
    0 / "none" / "unlimited" = no limit), with errors that name the setting."""
    from colibri_backend import budget

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key}: expected a size such as 1.5G, 512M or a number of bytes, got {value!r}")
    try:
        return budget.parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10 has no tomllib; tomli is the same parser
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(f"{path}: reading TOML on Python 3.10 needs the 'tomli' package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def find_config_file(
    explicit: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Path | None:
    """The configuration file to use, or None when there is none (defaults apply)."""
    env = os.environ if env is None else env
    if explicit is not None:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        return p
    if env.get("COLIBRI_CONFIG"):
        p = Path(env["COLIBRI_CONFIG"]).expanduser()
        if not p.is_file():
            raise ConfigError(f"COLIBRI_CONFIG: config file {str(p)!r} does not exist")
        return p
    local = Path.cwd() / CONFIG_FILE_NAME
    if local.is_file():
        return local
    xdg = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "colibri" / CONFIG_FILE_NAME
    if xdg.is_file():
        return xdg
    return None


def _expand_model_path(value: str, base: Path) -> str:
    """A path made absolute against ``base``; a bare known name (``smollm2``) stays as it is."""
    looks_like_path = (
        "/" in value
        or os.sep in value
        or value.startswith(("~", "."))
        or value.endswith((".gguf", ".safetensors"))
    )
    candidate = (
        (base / Path(value).expanduser())
        if not Path(value).expanduser().is_absolute()
        else Path(value).expanduser()
    )
    if looks_like_path or candidate.exists():
        return str(candidate.resolve())
    return value


class _Checker:
    """Typed access to a TOML table that reports errors as ``<file>: <dotted.key>: ...``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {message}")

    def string(
        self, table: Mapping[str, Any], name: str, prefix: str, default: str | None = None
    ) -> str | None:
        if name not in table:
            return default
        v = table[name]
        if not isinstance(v, str) or not v:
            raise self.fail(prefix + name, f"expected a non-empty string, got {v!r}")
        return v

    def integer(
        self, table: Mapping[str, Any], name: str, prefix: str, lo: int, hi: int, default: int | None = None
    ) -> int | None:
        if name not in table:
            return default
        v = table[name]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(prefix + name, f"expected an integer, got {v!r}")
        if not lo <= v <= hi:
            raise self.fail(prefix + name, f"must be between {lo} and {hi}, got {v}")
        return v

    def unknown(self, table: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
        extra = sorted(set(table) - allowed)
        if extra:
            raise self.fail(prefix + extra[0], f"unknown key (allowed: {', '.join(sorted(allowed))})")


_TOP_KEYS = {"backend", "model", "models", "server"}
_SERVER_KEYS = {"host", "port", "api_key", "max_queue"}
_MODEL_KEYS = {"path", "backend", "threads", "context_length", "memory_budget", "chat_template", "options"}
_ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")


def _parse_model(c: _Checker, alias: str, table: Any, base: Path, default_backend: str) -> ModelConfig:
    prefix = f"models.{alias}."
    if not isinstance(table, dict):
        raise c.fail(f"models.{alias}", "expected a table such as [models.NAME] with a path")
    if not _ALIAS_RE.match(alias):
        raise c.fail(
            f"models.{alias}",
            "alias must start with a letter or digit and use only letters, digits and . _ : / -",
        )
    c.unknown(table, _MODEL_KEYS, prefix)
    if "path" not in table:
        raise c.fail(
            prefix + "path",
            "missing: every model alias needs a path (a file, a directory or a known model name)",
        )
    path = _expand_model_path(c.string(table, "path", prefix) or "", base)
    budget = None
    if "memory_budget" in table:
        try:
            budget = parse_size(table["memory_budget"], prefix + "memory_budget")
        except ConfigError as exc:
            raise ConfigError(f"{c.source}: {exc}") from None
    template = c.string(table, "chat_template", prefix)
    if template is not None and "{" not in template:  # a file name, not template text
        tpath = base / Path(template).expanduser()
        try:
            template = tpath.read_text(encoding="utf-8")
        except OSError as exc:
            raise c.fail(
                prefix + "chat_template", f"cannot read template file {str(tpath)!r}: {exc.strerror or exc}"
            ) from None
    options = table.get("options", {})
    if not isinstance(options, dict):
        raise c.fail(prefix + "options", f"expected a table, got {options!r}")
    backend = c.string(table, "backend", prefix, default_backend) or default_backend
    if backend == "colibri":  # the engine's options are a LoadOptions: checked now, not at load
        from colibri_backend.load_options import LoadOptions

        try:
            LoadOptions.from_mapping(options, prefix + "options.")
        except ValueError as exc:
            raise ConfigError(f"{c.source}: {exc}") from None
    return ModelConfig(
        alias=alias,
        path=path,
        backend=backend,
        threads=c.integer(table, "threads", prefix, 1, 1024),
        context_length=c.integer(table, "context_length", prefix, 16, 1 << 24),
        memory_budget=budget,
        chat_template=template,
        options=dict(options),
    )


def parse_config(data: Mapping[str, Any], source: str = CONFIG_FILE_NAME, base: Path | None = None) -> Config:
    """A Config from already-parsed TOML data (no environment applied)."""
    c = _Checker(source)
    base = base or Path.cwd()
    c.unknown(data, _TOP_KEYS, "")
    backend = c.string(data, "backend", "", DEFAULT_BACKEND) or DEFAULT_BACKEND
    models_t = data.get("models", {})
    if not isinstance(models_t, dict):
        raise c.fail("models", "expected tables such as [models.NAME]")
    models = {alias: _parse_model(c, alias, t, base, backend) for alias, t in models_t.items()}
    default_model = c.string(data, "model", "", None)
    if default_model is None:
        default_model = next(iter(models), DEFAULT_MODEL)
    server_t = data.get("server", {})
    if not isinstance(server_t, dict):
        raise c.fail("server", "expected a table [server]")
    c.unknown(server_t, _SERVER_KEYS, "server.")
    server = ServerConfig(
        host=c.string(server_t, "host", "server.", "127.0.0.1") or "127.0.0.1",
        port=c.integer(server_t, "port", "server.", 0, 65535, 8000) or 0,
        api_key=c.string(server_t, "api_key", "server.", None),
        max_queue=c.integer(server_t, "max_queue", "server.", 1, 1 << 16, 16) or 16,
    )
    cfg = Config(backend=backend, default_model=default_model, models=models, server=server)
    if default_model not in models and models:
        # `model = "x"` naming no alias is a typo far more often than a path.
        if not (Path(default_model).expanduser().exists() or default_model == DEFAULT_MODEL):
            raise c.fail("model", f"{default_model!r} is not one of the aliases ({', '.join(models)})")
    return cfg


def _env_int(env: Mapping[str, str], name: str, lo: int, hi: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name}: must be between {lo} and {hi}, got {v}")
    return v


def apply_env(cfg: Config, env: Mapping[str, str] | None = None) -> Config:
    """The configuration with the COLIBRI_* environment overrides applied."""
    env = os.environ if env is None else env
    backend = env.get("COLIBRI_BACKEND") or None
    threads = _env_int(env, "COLIBRI_THREADS", 1, 1024)
    ctx = _env_int(env, "COLIBRI_CONTEXT_LENGTH", 16, 1 << 24)
    budget = (
        parse_size(env["COLIBRI_MEMORY_BUDGET"], "COLIBRI_MEMORY_BUDGET")
        if env.get("COLIBRI_MEMORY_BUDGET")
        else None
    )
    changes: dict[str, Any] = {}
    if backend:
        changes["backend"] = backend
    if threads is not None:
        changes["threads"] = threads
    if ctx is not None:
        changes["context_length"] = ctx
    if budget is not None:
        changes["memory_budget"] = budget
    models = {a: replace(m, **changes) for a, m in cfg.models.items()}
    out = replace(cfg, models=models, backend=backend or cfg.backend)
    if env.get("COLIBRI_MODEL"):
        spec = env["COLIBRI_MODEL"]
        if spec not in models:
            extra = replace(out.model(spec), **changes)
            models[extra.alias] = extra
            spec = extra.alias
        out = replace(out, models=models, default_model=spec)
    if env.get("COLIBRI_API_KEY"):
        out = replace(out, server=replace(out.server, api_key=env["COLIBRI_API_KEY"]))
    if out.default_model not in out.models:
        implicit = replace(out.model(out.default_model), **changes)
        out = replace(out, models={**out.models, implicit.alias: implicit}, default_model=implicit.alias)
    return out


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read the configuration (see the module docstring for where from) and apply the environment."""
    env = os.environ if env is None else env
    file = find_config_file(path, env)
    if file is None:
        cfg = Config()
    else:
        cfg = replace(parse_config(_read_toml(file), str(file), file.resolve().parent), source=file)
    return apply_env(cfg, env)
