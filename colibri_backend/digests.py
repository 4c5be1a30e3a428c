"""Integrity of model files: per-tensor digests in a sidecar `MODEL.gguf.digests`.

The engine computes and checks the digests (native/src/digest.c; the format is in digest.h and
docs/robustness.md): one 64-bit digest per tensor, one per expert for stacked expert tensors.
`write_digests` writes the sidecar (`colibri convert` calls it for every file it writes; call it
after any tool writes a GGUF), `verify_file` reads the whole file and names the tensors that do
not match, `verify_model` checks an open model's resident tensors from the engine's own copy.
A model whose sidecar exists checks each streamed expert when it is read, always.
"""

from __future__ import annotations

import os
from ctypes import byref, c_int32, c_void_p, create_string_buffer
from pathlib import Path
from typing import Any

from colibri_backend import _native
from colibri_backend.errors import ModelFormatError

# Room for the names of the bad tensors (one a line); more are counted but not named.
_REPORT_BYTES = 1 << 16


def sidecar_path(model_path: str | os.PathLike[str]) -> Path:
    """Where the digests of `model_path` live: the same path with ".digests" appended."""
    p = Path(model_path)
    return p.with_name(p.name + ".digests")


def write_digests(model_path: str | os.PathLike[str]) -> Path:
    """Digest every tensor of the GGUF at `model_path` and write its sidecar (atomically)."""
    lib = _native.load_library()
    lib.check(lib.colibri_write_digests(os.fsencode(model_path)), f"writing digests of {model_path}")
    return sidecar_path(model_path)


def _bad_names(report: Any, n_bad: c_int32) -> list[str]:
    names = [line for line in report.value.decode("utf-8", "replace").splitlines() if line]
    # more bad tensors than the report could name: say how many are left
    if n_bad.value > len(names):
        names.append(f"... and {n_bad.value - len(names)} more")
    return names


def verify_file(model_path: str | os.PathLike[str]) -> list[str]:
    """Read the whole file and compare it with its sidecar; the names of the tensors (or "NAME expert E")
    whose bytes differ, [] when all match. Raises when there is no sidecar, or when it or the file
    cannot be read."""
    lib = _native.load_library()
    report = create_string_buffer(_REPORT_BYTES)
    n_bad = c_int32(0)
    status = lib.colibri_verify_file(os.fsencode(model_path), report, _REPORT_BYTES, byref(n_bad))
    lib.check(status, f"verifying {model_path}")
    return _bad_names(report, n_bad)


def verify_model(handle: c_void_p, model_path: str | os.PathLike[str]) -> None:
    """Check an open model's resident tensors against its sidecar; ModelFormatError naming the bad ones."""
    lib = _native.load_library()
    report = create_string_buffer(_REPORT_BYTES)
    n_bad = c_int32(0)
    status = lib.colibri_model_verify(handle, report, _REPORT_BYTES, byref(n_bad))
    lib.check(status, f"verifying {model_path}")
    bad = _bad_names(report, n_bad)
    if bad:
        raise ModelFormatError(
            "COLIBRI_E_FORMAT", f"{model_path}: tensors do not match their digests: {', '.join(bad)}"
        )


__all__ = ["sidecar_path", "verify_file", "verify_model", "write_digests"]
