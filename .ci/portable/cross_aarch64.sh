#!/usr/bin/env bash
# The C++ core on a CPU without attnx's x86 kernels: cross-compiled for aarch64 (the NEON and
# portable scalar paths, as CMake builds it there) and run under qemu-user, with .ci/portable/smoke.cpp
# as the client. Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu qemu-user.
# Usage: bash .ci/portable/cross_aarch64.sh [build dir]   (by hand; not part of .ci/run)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build/cross-aarch64}
CXX=aarch64-linux-gnu-g++
mkdir -p "$(dirname "$BUILD")"  # the configure log goes next to the build dir
command -v "$CXX" >/dev/null || { echo "cross_aarch64: $CXX not found (apt-get install g++-aarch64-linux-gnu)" >&2; exit 2; }
command -v qemu-aarch64 >/dev/null || { echo "cross_aarch64: qemu-aarch64 not found (apt-get install qemu-user)" >&2; exit 2; }
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux \
  -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_CXX_COMPILER="$CXX" > "$BUILD.configure.log"
grep "attnx:" "$BUILD.configure.log" || true
cmake --build "$BUILD" --target attnx_core
# statically linked, so qemu needs no aarch64 sysroot
"$CXX" -O2 -std=c++17 -Wall -Wextra -Icpp/include .ci/portable/smoke.cpp "$BUILD/libattnx_core.a" \
  -static -pthread -o "$BUILD/smoke"
file "$BUILD/smoke" 2>/dev/null || true
qemu-aarch64 "$BUILD/smoke"
