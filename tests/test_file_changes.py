"""A model file that changes underneath an open model (docs/robustness.md).

The engine reads the metadata and every resident tensor into memory it owns at load, copies the
experts of an all-resident context when the context is created, and streams the rest from the
inode it loaded. So truncating, replacing (renaming another file over it) or deleting the GGUF
while a model generates must never raise a signal: the output is the intact model's, or, when
a streamed expert can no longer be read, that eval fails with a clear error. A second model in
the same process keeps generating either way. Each case runs in a child process, so a SIGBUS
(what mapping the file used to give) shows as a negative return code instead of killing pytest.

The model is Colibri's bundled MoE (6 layers x 32 experts, top-4, 22 MiB Q8_0); "streamed" holds
4 expert slots (the top-4 one token needs), so nearly every token reads experts from the file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import colibri_backend
from colibri_backend.models import bundled_model_path

PROMPT = "def fibonacci(n):"
N_TOKENS = 24
CHANGE_AFTER = 3  # tokens streamed before the file changes
MODES = {"resident": {"memory_budget": 0}, "streamed": {"expert_slots": 4}}

CHILD = r"""
import json, os, sys
import colibri_backend
from colibri_backend.errors import ColibriError

mode_opts, action, victim, second, other, prompt, n, after = sys.argv[1:]
opts = dict(json.loads(mode_opts), threads=1)
a = colibri_backend.load(victim, **opts)
b = colibri_backend.load(second, **opts)
pieces, err = [], None
try:
    for i, piece in enumerate(a.stream(prompt, max_tokens=int(n))):
        pieces.append(piece)
        if i + 1 == int(after):
            if action == "truncate":
                os.truncate(victim, os.path.getsize(victim) // 8)
            elif action == "replace":
                os.replace(other, victim)
            elif action == "delete":
                os.unlink(victim)
except ColibriError as exc:
    err = str(exc)
second_text = b.generate(prompt, max_tokens=int(n))
print(json.dumps({"text": "".join(pieces), "error": err, "second": second_text}))
"""


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """The intact model's greedy continuation in each mode (they agree: the budget never changes the math)."""
    out = {}
    for mode, opts in MODES.items():
        with colibri_backend.load(bundled_model_path("colibri-moe"), threads=1, **opts) as m:
            out[mode] = m.generate(PROMPT, max_tokens=N_TOKENS)
    assert out["resident"] == out["streamed"]
    return out


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("action", ["truncate", "replace", "delete"])
def test_file_changes_while_generating(
    tmp_path: Path, reference: dict[str, str], mode: str, action: str
) -> None:
    src = bundled_model_path("colibri-moe")
    victim, second, other = tmp_path / "victim.gguf", tmp_path / "second.gguf", tmp_path / "other.gguf"
    shutil.copyfile(src, victim)
    shutil.copyfile(src, second)
    # the replacement has the same size and nothing of the model: reading it by path would be garbage
    other.write_bytes(b"\x55" * src.stat().st_size)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            json.dumps(MODES[mode]),
            action,
            str(victim),
            str(second),
            str(other),
            PROMPT,
            str(N_TOKENS),
            str(CHANGE_AFTER),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"child died (signal {-proc.returncode if proc.returncode < 0 else None}): {proc.stderr[-2000:]}"
    )
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = reference[mode]
    assert res["second"] == ref  # the other model in the process is untouched
    if mode == "streamed" and action == "truncate":
        # experts past the new end cannot be read: that eval fails, with a message that says why
        assert res["error"] is not None, res
        assert "truncated" in res["error"] and "victim.gguf" in res["error"], res["error"]
        assert ref.startswith(res["text"]) and len(res["text"]) < len(ref)
    else:
        # everything the model needs is the engine's own copy or the inode it loaded
        assert res["error"] is None, res["error"]
        assert res["text"] == ref


def test_context_after_truncation_is_refused_cleanly(tmp_path: Path) -> None:
    """A context created after the file lost its experts: the all-resident copy cannot be made,
    and the model says so instead of computing with missing bytes."""
    victim = tmp_path / "m.gguf"
    shutil.copyfile(bundled_model_path("colibri-moe"), victim)
    code = (
        "import os, sys, colibri_backend\n"
        "from colibri_backend import _native\n"
        "from ctypes import byref, c_void_p\n"
        "lib = _native.load_library(); h = c_void_p()\n"
        "lib.check(lib.colibri_model_open(os.fsencode(sys.argv[1]), byref(h)))\n"
        "os.truncate(sys.argv[1], os.path.getsize(sys.argv[1]) // 2)\n"
        "p = _native.ContextParamsC(); lib.colibri_context_default_params(byref(p)); p.n_ctx = 64\n"
        "c = c_void_p(); st = lib.colibri_context_new(h, byref(p), byref(c))\n"
        "print(st, lib.last_error())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(victim)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, _, message = proc.stdout.strip().partition(" ")
    assert int(status) == _native_status("COLIBRI_E_IO"), proc.stdout
    assert "shorter than when it was opened" in message, message


def _native_status(name: str) -> int:
    from colibri_backend import _native

    return {v: k for k, v in _native.STATUS_NAMES.items()}[name]
