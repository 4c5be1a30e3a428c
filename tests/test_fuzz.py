"""Bounded fuzzing runs (docs/robustness.md): every libFuzzer target of native/fuzz/ (built with clang,
ASan and UBSan, COLIBRI_FUZZ=ON) for C_SECONDS each, and every atheris target of tools/fuzz_python.py
for PY_SECONDS each, from the committed seed corpora (regression inputs of fixed crashes included).
A crash, a sanitizer report, a leak or an unexpected exception fails the test; the number of
executions and the coverage each run reached are printed. tools/fuzz_long.sh runs the C targets long.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
C_TARGETS = ["fuzz_gguf", "fuzz_tokenizer", "fuzz_profile", "fuzz_replay", "fuzz_sampler", "fuzz_state"]
PY_TARGETS = ["chat_template", "gguf_metadata", "profile", "trace"]
C_SECONDS = int(os.environ.get("COLIBRI_FUZZ_SECONDS", "20"))
PY_SECONDS = int(os.environ.get("COLIBRI_PYFUZZ_SECONDS", "8"))


def _stats(log: str) -> tuple[int, str]:
    runs = re.findall(r"stat::number_of_executed_units: (\d+)", log)
    cov = re.findall(r"DONE +(cov: \d+ ft: \d+)", log)
    return (int(runs[-1]) if runs else 0), (cov[-1] if cov else "")


def _check(log: str, returncode: int, what: str) -> int:
    bad = [
        m
        for m in (
            "ERROR: libFuzzer",
            "ERROR: AddressSanitizer",
            "runtime error:",
            "Uncaught Python exception",
            "ERROR: LeakSanitizer",
        )
        if m in log
    ]
    assert returncode == 0 and not bad, f"{what} found a problem ({bad or returncode}):\n{log[-4000:]}"
    runs, cov = _stats(log)
    assert runs > 0, f"{what} executed nothing:\n{log[-2000:]}"
    print(f"{what}: {runs} executions in the bounded run, {cov}")
    return runs


@pytest.fixture(scope="module")
def fuzz_build() -> Path:
    if shutil.which("clang") is None:
        pytest.skip("clang is not installed (apt-get install clang); CI installs it")
    build = ROOT / "build" / "fuzz"
    env = dict(os.environ, CC="clang")
    cfg = [
        "cmake",
        "-S",
        str(ROOT / "native"),
        "-B",
        str(build),
        "-DCOLIBRI_FUZZ=ON",
        "-DCOLIBRI_BUILD_TESTS=OFF",
        "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
    ]
    subprocess.run(cfg, check=True, env=env, capture_output=True)
    proc = subprocess.run(["cmake", "--build", str(build), "-j2"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return build


@pytest.mark.parametrize("target", C_TARGETS)
def test_libfuzzer_target(fuzz_build: Path, target: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(ROOT / "native" / "fuzz" / "corpus" / target, corpus)
    n_seeds = len(list(corpus.iterdir()))
    proc = subprocess.run(
        [
            str(fuzz_build / target),
            f"-max_total_time={C_SECONDS}",
            "-print_final_stats=1",
            f"-artifact_prefix={tmp_path}/",
            "-rss_limit_mb=2048",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=C_SECONDS + 120,
        cwd=tmp_path,
    )
    log = proc.stdout + proc.stderr
    _check(log, proc.returncode, target)
    # every seed (regressions included) was run, not silently dropped
    assert re.search(rf"INFO: +{n_seeds} files found", log) or f"seed corpus: files: {n_seeds}" in log, log[
        :2000
    ]


@pytest.mark.parametrize("target", PY_TARGETS)
def test_atheris_target(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    shutil.copytree(ROOT / "tests" / "fuzz_corpus" / target, corpus)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "fuzz_python.py"),
            target,
            f"-max_total_time={PY_SECONDS}",
            "-print_final_stats=1",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=PY_SECONDS + 120,
        cwd=tmp_path,
    )
    _check(proc.stdout + proc.stderr, proc.returncode, f"atheris {target}")
