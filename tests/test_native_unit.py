"""Builds the C engine with its unit tests (native/tests/test_*.c) and runs them through ctest.

The C tests cover what Python cannot reach directly: the GGUF reader's validation, every kernel set
against the scalar and double-precision references, the thread pool, the sampler's distributions and
the tokenizer of the stand-alone runner.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parent.parent / "native"


@pytest.fixture(scope="module")
def native_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cmake = shutil.which("cmake")
    assert cmake, "cmake is required to build the native unit tests (pip install cmake)"
    build = tmp_path_factory.mktemp("native-build")
    configure = [cmake, "-S", str(NATIVE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run([*configure, "-DCOLIBRI_BUILD_TESTS=ON"], check=True, capture_output=True)
    jobs = str(min(2, os.cpu_count() or 1))
    result = subprocess.run([cmake, "--build", str(build), "-j", jobs], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return build


def _ctest() -> str:
    ctest = shutil.which("ctest", path=str(Path(shutil.which("cmake") or "").parent)) or shutil.which("ctest")
    assert ctest, "ctest (part of CMake) is required"
    return ctest


def _ctest_names(build: Path) -> list[str]:
    listing = subprocess.run([_ctest(), "-N"], cwd=build, capture_output=True, text=True, check=True).stdout
    return re.findall(r"Test\s+#\d+: (\S+)", listing)


def test_every_c_unit_test_passes(native_build: Path) -> None:
    names = _ctest_names(native_build)
    assert {"test_gguf", "test_kernels", "test_threads", "test_sampler", "test_types"} <= set(names), names
    command = [_ctest(), "--output-on-failure", "--timeout", "600"]
    result = subprocess.run(command, cwd=native_build, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "100% tests passed" in result.stdout


def test_bench_bandwidth_reads_in_the_decode_tiles_order(native_build: Path) -> None:
    tool = native_build / "bench-bandwidth"
    common = [str(tool), "--mib", "8", "--chunk-kib", "1584", "--seconds", "0.1"]
    run = subprocess.run([*common, "--tile", "576,144"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("tile order: rows of 576 B, blocks of 144 B; read 8 MiB chunk 1584 KiB")
    assert float(re.search(r"median ([0-9.]+) GB/s", run.stdout)[1]) > 0
    # a block that is not a whole number of words, and a chunk that is not a whole number of rows
    for bad in ("576,210", "1000,144"):
        refused = subprocess.run([*common, "--tile", bad], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "multiples of 8" in refused.stderr, (bad, refused.stderr)
