"""Builds of the native tools for the tests that run them as a user would (colibri-run with or without
compile-time options), into a folder the test owns."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_colibri_run(out: Path, c_flags: str = "") -> Path:
    """colibri-run, Release, configured in `out` with CMAKE_C_FLAGS=c_flags (no C tests); its path."""
    cmake = shutil.which("cmake")
    assert cmake, "cmake is required"
    configure = [cmake, "-S", str(ROOT / "native"), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release"]
    configure += ["-DCOLIBRI_BUILD_TESTS=OFF", f"-DCMAKE_C_FLAGS={c_flags}"]
    r = subprocess.run(configure, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jobs = str(min(2, os.cpu_count() or 1))
    r = subprocess.run(
        [cmake, "--build", str(out), "-j", jobs, "--target", "colibri-run"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out / "colibri-run"
