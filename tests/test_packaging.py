"""The source tree has the installed layout, so `import colibri_backend` from the checkout's root (which puts
the source package first on sys.path) finds everything an installed one has; the server is a default
dependency (`pip install .` then `colibri serve`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_wheel_maps_the_source_package_as_it_is() -> None:
    packages = _pyproject()["tool"]["scikit-build"]["wheel"]["packages"]
    assert packages == {"colibri_backend": "colibri_backend"}  # no folder moved into place at install


def test_every_entry_point_imports_from_the_checkout_root() -> None:
    project = _pyproject()["project"]
    modules = [*project["entry-points"]["colibri"].values(), *project["entry-points"]["llm"].values()]
    modules += ["colibri_backend.adapters.sampling", "colibri_backend.server"]
    code = (
        "import importlib, sys\n"
        "import colibri_backend\n"
        f"assert colibri_backend.__file__.startswith({str(ROOT)!r}), colibri_backend.__file__\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_server_is_in_the_default_install() -> None:
    deps = " ".join(_pyproject()["project"]["dependencies"])
    for name in ("fastapi", "uvicorn", "pydantic", "prometheus-client"):
        assert name in deps
    r = subprocess.run(
        [sys.executable, "-m", "colibri_backend", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "--max-queue" in r.stdout


def test_the_bundled_model_ships_in_the_wheel() -> None:
    """scikit-build-core puts every file of the package that git does not ignore into the wheel, so the
    bundled GGUF and its routing profile must be tracked, not ignored, and not excluded from either."""
    from colibri_backend.models import BUNDLED_DIR, BUNDLED_MODELS

    files = [BUNDLED_DIR / name for name in BUNDLED_MODELS.values()]
    files += [f.with_name(f.name + ".routing") for f in files]
    rel = [str(f.relative_to(ROOT)) for f in files]
    for f in files:
        assert f.is_file() and f.stat().st_size > 0, f
    tracked = subprocess.run(["git", "ls-files", "--", *rel], cwd=ROOT, capture_output=True, text=True)
    assert tracked.returncode == 0 and sorted(tracked.stdout.split()) == sorted(rel), tracked.stdout
    ignored = subprocess.run(["git", "check-ignore", "--", *rel], cwd=ROOT, capture_output=True, text=True)
    assert ignored.returncode == 1 and not ignored.stdout, ignored.stdout  # 1: none of them is ignored
    skb = _pyproject()["tool"]["scikit-build"]
    excluded = [*skb.get("sdist", {}).get("exclude", []), *skb.get("wheel", {}).get("exclude", [])]
    assert not any(r.startswith(e.rstrip("/")) for r in rel for e in excluded), excluded
