#!/usr/bin/env bash
# The C++ core cross-compiled for two platforms CI here cannot run natively, with zig's clang
# (`pip install ziglang`: its own macOS SDK stubs, MinGW-w64 headers and libc++):
#   aarch64-macos       (Apple silicon: the NEON and scalar kernels)
#   x86_64-windows-gnu  (the x86 kernels and scalar; MinGW ABI)
# CMake configures each as on that platform (CMAKE_SYSTEM_NAME/PROCESSOR), so CMakeLists.txt's
# choices are what is checked, and builds attnx_core (not the Python module, which needs the
# target's Python). The smoke program (.ci/portable/smoke.cpp) is linked for both; the Windows one
# runs under Wine where it is installed (Debian: apt-get install wine64), the macOS one is only
# linked. Usage: bash .ci/portable/cross_zig.sh [build dir]   (PYTHON: the interpreter with ziglang)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-build/cross-zig}
PY=${PYTHON:-python3}
"$PY" -m ziglang version >/dev/null 2>&1 || { echo "cross_zig: no ziglang for $PY (pip install ziglang)" >&2; exit 2; }
mkdir -p "$OUT/bin"
OUT=$(cd "$OUT" && pwd)
PYABS=$(command -v "$PY")

# CMake wants one executable per tool and target: small wrappers around `python -m ziglang`
tool() {  # tool NAME ZIG-ARGS...
  local name=$1
  shift
  printf '#!/bin/sh\nexec "%s" -m ziglang %s "$@"\n' "$PYABS" "$*" > "$OUT/bin/$name"
  chmod +x "$OUT/bin/$name"
}
tool ar ar
tool ranlib ranlib

build() {  # build TARGET SYSTEM PROCESSOR EXTRA-LINK-FLAGS
  local target=$1 system=$2 proc=$3 libs=$4 dir=$OUT/$1
  tool "c++-$target" c++ -target "$target"
  echo "== $target"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME="$system" \
    -DCMAKE_SYSTEM_PROCESSOR="$proc" -DCMAKE_CXX_COMPILER="$OUT/bin/c++-$target" \
    -DCMAKE_AR="$OUT/bin/ar" -DCMAKE_RANLIB="$OUT/bin/ranlib" > "$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
  grep "attnx:" "$dir.configure.log" || true
  cmake --build "$dir" --target attnx_core
  "$OUT/bin/c++-$target" -O2 -std=c++17 -Wall -Wextra -Icpp/include .ci/portable/smoke.cpp \
    "$dir/libattnx_core.a" $libs -o "$dir/smoke$([ "$system" = Windows ] && echo .exe)"
  echo "cross_zig: $target: core and smoke built"
}

# WaitOnAddress: MSVC and MinGW-w64 distributions link it from synchronization (CMakeLists.txt);
# zig's MinGW has it under its API-set name only.
build aarch64-macos Darwin arm64 ""
build x86_64-windows-gnu Windows AMD64 "-lapi-ms-win-core-synch-l1-2-0"

if command -v wine64 >/dev/null || [ -x /usr/lib/wine/wine64 ]; then
  WINE=$(command -v wine64 || echo /usr/lib/wine/wine64)
  export WINEPREFIX=$OUT/wineprefix WINEDEBUG=-all
  "$WINE" "$OUT/x86_64-windows-gnu/smoke.exe" 2>&1 | grep -v "^wine: \|rundll32"
  echo "cross_zig: the Windows smoke passed under Wine"
else
  echo "cross_zig: no Wine here: the Windows smoke was linked, not run"
fi
