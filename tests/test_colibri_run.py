"""colibri-run's --warmup (llama-bench's warmup run): the prompt and one decode step once, untimed, then the
timed run from an empty context. The timed run must be the run it would have been without the warmup: the
same tokens, the same counters (reset after the warmup), under an expert budget too.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from native_build import build_colibri_run

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "colibri_backend" / "models" / "colibri-moe-q8_0.gguf"
PROMPT = "def fibonacci(n):"
WARMUP_LINE = re.compile(
    r"colibri-run: warmup prompt: (\d+) tokens in [0-9.]+ s \([0-9.]+ tok/s\), not counted below"
)


@pytest.fixture(scope="module")
def colibri_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_colibri_run(tmp_path_factory.mktemp("colibri-run"))


def _run(exe: Path, *args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(exe), str(BUNDLED), "-p", PROMPT, "-t", "2", "--stats", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _eval_counts(stderr: str) -> tuple[str, str | None]:
    """From --stats: the tokens line without its timings, and the expert store's call count (None without a
    store). Hits and reads are left out: with a budget the warmup leaves experts in the store."""
    tokens = re.search(r"^\s+tokens: (.*)$", stderr, re.M)
    assert tokens is not None, stderr[-2000:]
    calls = re.search(r"^\s+experts: \d+ slots, (\d+) calls", stderr, re.M)
    return re.sub(r"in [0-9.]+ s", "in _ s", tokens.group(1)), calls.group(1) if calls else None


@pytest.mark.parametrize("budget", [None, "30%"])
def test_warmup_leaves_the_timed_run_as_it_was(colibri_run: Path, budget: str | None) -> None:
    extra = ("-n", "12") + (("--expert-slots", budget) if budget else ())
    plain = _run(colibri_run, *extra)
    warm = _run(colibri_run, *extra, "--warmup")
    assert warm.stdout == plain.stdout  # greedy: the same tokens
    m = WARMUP_LINE.search(warm.stderr)
    assert m is not None, warm.stderr[-2000:]
    n_prompt = int(re.search(r"^\s+prompt: (\d+) tokens", plain.stderr, re.M).group(1))
    assert int(m.group(1)) == n_prompt
    assert WARMUP_LINE.search(plain.stderr) is None
    # the counters were zeroed after the warmup: the timed run's eval calls only (1 prompt + 11 steps), and
    # under a budget the same expert calls
    tokens, calls = _eval_counts(warm.stderr)
    assert (tokens, calls) == _eval_counts(plain.stderr)
    assert "12 eval calls" in tokens
    assert (calls is not None) == (budget is not None)


def test_warmup_with_no_room_for_a_decode_step(colibri_run: Path) -> None:
    # -n 0: the context holds the prompt exactly, so the warmup runs the prompt alone
    r = _run(colibri_run, "-n", "0", "--warmup")
    assert WARMUP_LINE.search(r.stderr) is not None
    assert "generated: 0 tokens" in r.stderr
