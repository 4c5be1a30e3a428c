# Cross-compiling the engine for 64-bit ARM Linux with Debian's cross toolchain
# (apt-get install gcc-aarch64-linux-gnu; run the results with qemu-aarch64 -L /usr/aarch64-linux-gnu):
#
#   cmake -S native -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=native/cmake/aarch64-linux-gnu.cmake
#   cmake --build build/aarch64 -j2
#
# COLIBRI_AARCH64_PREFIX names another triplet's tools (e.g. aarch64-none-linux-gnu-).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

if(NOT DEFINED COLIBRI_AARCH64_PREFIX)
  set(COLIBRI_AARCH64_PREFIX aarch64-linux-gnu-)
endif()
set(CMAKE_C_COMPILER ${COLIBRI_AARCH64_PREFIX}gcc)
set(CMAKE_AR ${COLIBRI_AARCH64_PREFIX}ar CACHE FILEPATH "")
set(CMAKE_STRIP ${COLIBRI_AARCH64_PREFIX}strip CACHE FILEPATH "")

# Headers and libraries come from the target's sysroot only; programs (cmake's helpers) from the host.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# Test executables run through user-mode emulation (ctest uses this prefix).
find_program(COLIBRI_QEMU_AARCH64 qemu-aarch64)
if(COLIBRI_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${COLIBRI_QEMU_AARCH64};-L;/usr/aarch64-linux-gnu)
endif()
