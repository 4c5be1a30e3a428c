"""The per-phase decode-step timers (native/src/steptime.h), compiled in with -DCOLIBRI_STEP_TIMERS.

They are off in every other build, so this test builds colibri-run with them and checks that every decode
step is timed, that each phase reports, and that the phases fit inside the step they are part of.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from native_build import build_colibri_run

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "colibri_backend" / "models" / "colibri-moe-q8_0.gguf"
PHASES = (
    "embed",
    "norms",
    "mixer",
    "residual",
    "quantize-in",
    "router",
    "group",
    "expert-glu",
    "expert-down",
    "combine",
    "head-norm",
    "output",
)
N_PREDICT = 8


def _stderr(exe: Path) -> str:
    r = subprocess.run(
        [str(exe), str(BUNDLED), "-p", "Once upon a time", "-n", str(N_PREDICT), "-t", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _stderr(build_colibri_run(tmp_path_factory.mktemp("steptime"), "-DCOLIBRI_STEP_TIMERS"))


def test_every_decode_step_and_phase_is_timed(timed_run: str) -> None:
    steps = re.search(r"steptime: (\d+) one-token steps, ([0-9.]+) ms per step", timed_run)
    assert steps, timed_run[-2000:]
    # the prompt is one chunk of several tokens (not timed); each generated token after the first is a step
    assert N_PREDICT - 1 <= int(steps.group(1)) <= N_PREDICT
    assert float(steps.group(2)) > 0
    share = {}
    for name in PHASES:
        row = re.search(
            rf"steptime: {re.escape(name)}\s+([0-9.]+) ms/step\s+([0-9.]+)%\s+\((\d+) calls\)", timed_run
        )
        assert row, (name, timed_run[-2000:])
        share[name] = float(row.group(2))
        assert int(row.group(3)) >= int(steps.group(1)), name  # at least once per step
    untimed = re.search(r"steptime: \(untimed\)\s+(-?[0-9.]+) ms/step", timed_run)
    assert untimed and float(untimed.group(1)) >= 0  # the phases lie inside the step
    assert share["expert-glu"] + share["expert-down"] + share["output"] > share["residual"]
