#!/usr/bin/env bash
# The Python package on aarch64, emulated: Debian's arm64 CPython 3.11 in a sysroot, PyPI's
# aarch64 wheels of the test dependencies, attnx's extension cross-compiled against them, and
# pytest run under qemu-user. By hand (not part of .ci/run: it takes tens of minutes), as root on
# a Debian/Ubuntu x86-64 host; it registers qemu-aarch64 with binfmt_misc so that the tests'
# subprocesses (sys.executable) run too.
# Usage: bash .ci/portable/python_aarch64.sh [pytest args...]   (default: a broad kernel subset)
# QEMU_CPU picks the emulated CPU (qemu-user reads it, the tests' subprocesses too): max (BF16,
# I8MM, SVE: every ARM extension) or a plain NEON core such as cortex-a72. The tests run each
# kernel path the CPU has (scalar and neon); ATTNX_ISA=neon runs that one only. Emulated, the
# large grid cases take minutes each: -k "not 1025 and not 2048 and not slow" keeps a run of the
# variant, delta-rule, merge and paged files to minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${ATTNX_A64_DIR:-/tmp/attnx-aarch64}
PY=python3
mkdir -p "$WORK"/{site,pkg}

# 1. the cross toolchain, qemu (registered with binfmt_misc), an arm64 CPython with its libraries
# (unpacked, not installed), and the test dependencies as PyPI's aarch64 wheels
source .ci/portable/_aarch64_sysroot.sh
aarch64_sysroot "$WORK"

# 2. those wheels, unpacked into one site directory
for w in "$WORK"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$WORK/site/"; done

# 3. the core (neon and scalar paths) and the extension, cross-compiled
bash .ci/portable/cross_aarch64.sh build/cross-aarch64 > "$WORK/cross.log" 2>&1 || { cat "$WORK/cross.log"; exit 1; }
PB=$("$PY" -c "import pybind11; print(pybind11.get_include())")
rm -rf "$WORK/pkg/attnx" && cp -r python/attnx "$WORK/pkg/attnx"
rm -rf "$WORK"/pkg/attnx/_core.*.so "$WORK"/pkg/attnx/__pycache__
aarch64-linux-gnu-g++ -O2 -shared -fPIC -std=c++17 -fvisibility=hidden -Icpp/include -Icpp/src -Icpp \
  -I"$PB" -I"$WORK/root/usr/include/python3.11" -I"$WORK/root/usr/include" cpp/bind/*.cpp \
  build/cross-aarch64/libattnx_core.a -pthread -o "$WORK/pkg/attnx/_core.cpython-311-aarch64-linux-gnu.so"

# 4. the tests, from a copy of the tree whose python/ is the aarch64 package
rm -rf "$WORK/run" && mkdir -p "$WORK/run" && cp -r tests pyproject.toml "$WORK/run/"
ln -sfn "$WORK/pkg" "$WORK/run/python"
cd "$WORK/run"
export PYTHONPATH=$WORK/pkg:$WORK/site
"$A64PY" -c "import platform, attnx; f = attnx.cpu_features(); print(platform.machine(), 'QEMU_CPU=${QEMU_CPU:-default}', f['isa'], [k for k in ('neon', 'dotprod', 'bf16', 'i8mm', 'sve') if f[k]])"
if [ $# -eq 0 ]; then
  set -- tests/attention/test_attention.py tests/paged/test_paged.py tests/kernels/test_float64.py \
    tests/cache/test_cache.py tests/hardening/test_fork.py tests/hardening/test_hardening.py \
    tests/hardening/test_errors.py tests/delta/test_delta_rule.py tests/attention/test_variants.py \
    tests/kernels/test_numerics.py tests/cache/test_step_plan.py tests/cache/test_prefix.py \
    tests/attention/test_merge.py tests/kernels/test_threads.py \
    tests/quant/test_quant_reference.py tests/quant/test_quant_kv.py \
    tests/reference/test_reference.py
fi
"$A64PY" -m pytest -q -p no:cacheprovider "$@"
