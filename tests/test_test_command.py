"""The README's test command, .ci/run and the reference engine's build arguments stay in step."""

from __future__ import annotations

import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from repo_tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "llama_cpp_cmake_args.py"


def _module() -> ModuleType:
    return load_tool("llama_cpp_cmake_args")


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    commands = [line for line in re.findall(r"```bash\n(.*?)\n```", text, re.S) if "pytest" in line]
    assert len(commands) == 1, commands
    return commands[0]


def test_ci_runs_the_readme_test_command() -> None:
    command = _readme_test_command()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci_lines
    assert "tools/llama_cpp_cmake_args.py" in command


def test_x86_builds_natively_without_amx() -> None:
    args = _module().cmake_args("x86_64")
    assert args[0] == "-DGGML_NATIVE=ON"
    for var in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
        (flags,) = [a.split("=", 1)[1] for a in args if a.startswith(f"-D{var}=")]
        assert set(flags.split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}
    assert not any("AVX512" in a for a in args)  # a fixed AVX-512 build stops on AVX2-only CPUs


def test_arm_gets_no_x86_flags() -> None:
    assert _module().cmake_args("aarch64") == ["-DGGML_NATIVE=ON"]


def test_printed_arguments_split_back_as_cmake_args_does() -> None:
    """scikit-build-core splits $CMAKE_ARGS with shlex: the flags with spaces must come back whole."""
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert shlex.split(out) == _module().cmake_args(platform.machine())
