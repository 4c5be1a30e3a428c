#!/usr/bin/env bash
# Build llama.cpp's own C++ tools (llama-bench, plus llama-quantize and llama-perplexity for the
# quality comparisons) from the llama-cpp-python 0.3.36 source distribution, outside the repository.
#
#   benchmarks/build_llama_bench.sh            # -> $XDG_CACHE_HOME/colibri/llama.cpp-0.3.36/bin/llama-bench
#   LLAMA_SRC_DIR=/tmp/lcpp-sdist benchmarks/build_llama_bench.sh   # reuse an unpacked sdist
#
# The flags are the README's CMAKE_ARGS for llama-cpp-python (tools/llama_cpp_cmake_args.py): built for
# this CPU with AMX switched off, so llama-bench is the same engine the conformance suite loads.
# Nothing here is committed: the sources and the build live under the cache directory (or $OUT_DIR).
# Prints the bin directory on its last line.
set -euo pipefail

VERSION=0.3.36
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/colibri"
OUT_DIR="${OUT_DIR:-$CACHE/llama.cpp-$VERSION}"
JOBS="${JOBS:-2}"
SRC_PARENT="${LLAMA_SRC_DIR:-$OUT_DIR/sdist}"
SRC="$SRC_PARENT/llama_cpp_python-$VERSION/vendor/llama.cpp"

if [ ! -f "$SRC/CMakeLists.txt" ]; then
    mkdir -p "$SRC_PARENT"
    archive="$SRC_PARENT/llama_cpp_python-$VERSION.tar.gz"
    if [ ! -f "$archive" ]; then
        # The sdist only (never a wheel): needs scikit-build-core for pip's metadata step.
        python -m pip download --no-deps --no-binary llama-cpp-python --no-build-isolation \
            "llama-cpp-python==$VERSION" -d "$SRC_PARENT"
    fi
    tar -xzf "$archive" -C "$SRC_PARENT"
fi
[ -f "$SRC/CMakeLists.txt" ] || { echo "build_llama_bench: no llama.cpp sources under $SRC" >&2; exit 1; }

BUILD="$OUT_DIR/build"
mkdir -p "$BUILD"
# one build at a time in this directory (two makes in one tree corrupt each other's objects)
exec 9>"$OUT_DIR/.build.lock"
flock 9
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
eval "ARCH_ARGS=($(python "$ROOT/tools/llama_cpp_cmake_args.py"))"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ARCH_ARGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON >"$OUT_DIR/cmake-configure.log" 2>&1 \
    || { echo "build_llama_bench: cmake configure failed, see $OUT_DIR/cmake-configure.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$JOBS" --target llama-bench llama-quantize llama-perplexity llama-imatrix \
    >"$OUT_DIR/cmake-build.log" 2>&1 \
    || { echo "build_llama_bench: build failed, see $OUT_DIR/cmake-build.log" >&2; exit 1; }
mkdir -p "$OUT_DIR/bin"
for t in llama-bench llama-quantize llama-perplexity llama-imatrix; do
    cp "$BUILD/bin/$t" "$OUT_DIR/bin/$t"
done
"$OUT_DIR/bin/llama-bench" --help >/dev/null
echo "$OUT_DIR/bin"
