"""Print the CMake arguments that build llama.cpp (the reference engine) for the CPU it runs on.

    CMAKE_ARGS="$(python tools/llama_cpp_cmake_args.py)" pip install llama-cpp-python==0.3.36

The reference is compared at its best, so it is built for this CPU (`GGML_NATIVE`, llama.cpp's own default):
AVX-512 where the CPU has it, AVX2 where it has no more, NEON on ARM. A fixed AVX-512 build would stop
with an illegal instruction on an AVX2-only CPU (AMD Zen 2/3, most edge x86 boards).

One exception on x86: with AMX compiled in, llama-cpp-python 0.3.36 picks AMX weight buffers and crashes in
its first decode on the Xeons this project runs on, so the AMX instruction sets are switched off while
everything else `-march=native` enables stays on. GCC and Clang honour an explicit `-mno-…` whatever its
position relative to `-march`, and without `__AMX_INT8__` ggml compiles no AMX buffer type.

The same arguments reach the other packages of that pip command (Colibri's own build ignores the ggml ones
and its kernels never use AMX), and benchmarks/build_llama_bench.sh builds llama-bench with them.
"""

from __future__ import annotations

import platform
import shlex

_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_args(machine: str) -> list[str]:
    """The arguments for a CPU of architecture `machine` (as `platform.machine()` names it)."""
    args = ["-DGGML_NATIVE=ON"]
    if machine.lower() in ("x86_64", "amd64", "i686", "i386"):
        args += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
    return args


def main() -> None:
    print(shlex.join(cmake_args(platform.machine())))


if __name__ == "__main__":
    main()
