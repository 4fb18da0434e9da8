#!/usr/bin/env bash
# Sanitizer CI: builds attnx with AddressSanitizer + UndefinedBehaviorSanitizer
# (-DATTNX_SANITIZE=ON: -fsanitize=address,undefined -fno-sanitize-recover=all) into a throwaway
# virtual environment and runs the test suite with the sanitizer runtime preloaded. Any report
# (ASan: out-of-bounds, use-after-free, ...; UBSan: overflow, misaligned access, ...) fails the
# run, also one raised in a subprocess that a test started.
#
#   bash .ci/sanitize.sh                 # build, then run the suite
#   bash .ci/sanitize.sh -k paged        # extra arguments go to pytest
#   bash .ci/sanitize.sh --build-only    # build into ATTNX_SANITIZE_DIR and stop; the next run
#                                        # there tests that build without rebuilding (.ci/run
#                                        # builds in the background while other steps run)
#
# What runs: the whole test suite (every kernel, paged, cache, layer, sdpa, error, numerics,
# resources, concurrency, fuzz-harness and example test, on every instruction set the CPU has
# through the `isa` fixture), except test_memory_is_linear_in_sequence_length (RSS under ASan's
# allocator measures ASan, not attnx); the differential fuzz runs ATTNX_FUZZ_EXAMPLES=1000 dense
# + 500 paged cases instead of 3000 + 1500. Tests that measure RSS or set RLIMIT_AS skip
# themselves (ATTNX_SANITIZED=1). The core builds at -O2 under the sanitizers (why: CMakeLists.txt).
#
# ASan reports go to $WORK/reports too (log_path) and any "ERROR:" there fails the run, also
# one from a subprocess whose test did not look; UBSan reports go to stderr and stop the process
# (halt_on_error, -fno-sanitize-recover), which fails the test or the whole pytest run.
#
# Environment:
#   ATTNX_SANITIZE_DIR   work directory (venv, build, reports); default: a fresh mktemp dir,
#                        removed on success. Reuse one to skip the rebuild of unchanged sources.
#   ATTNX_FUZZ_EXAMPLES  dense differential-fuzz cases (default here 1000; paged: half)
#   PYTHON               interpreter to base the venv on (default python3)
#   CXX                  compiler whose sanitizer runtime is preloaded (default g++; must be the
#                        one CMake builds with)
set -euo pipefail
source "$(dirname "$0")/_prelude.sh"
ci_prelude sanitize ATTNX_SANITIZE_DIR
BUILD_ONLY=0
if [[ ${1:-} == --build-only ]]; then
  BUILD_ONLY=1
  shift
  if (( KEEP == 0 )); then
    echo "sanitize: --build-only needs ATTNX_SANITIZE_DIR (the build is kept for the next run)" >&2
    exit 2
  fi
fi
CXX_BIN=${CXX:-g++}
echo "sanitize: work directory $WORK"

# ---- the sanitizer runtime -------------------------------------------------------------------
ASAN_LIB=$("$CXX_BIN" -print-file-name=libasan.so)
UBSAN_LIB=$("$CXX_BIN" -print-file-name=libubsan.so)
for lib in "$ASAN_LIB" "$UBSAN_LIB"; do
  if [[ "$lib" != /* || ! -e "$lib" ]]; then
    echo "sanitize: $CXX_BIN has no sanitizer runtime ($lib); install libasan/libubsan (gcc)" >&2
    exit 2
  fi
done

# ---- a throwaway venv that sees the CI's packages (numpy, ml_dtypes, pytest, hypothesis) -----
VENV=$WORK/venv
if [[ ! -x "$VENV/bin/python" ]]; then
  # --without-pip: no ensurepip needed (Debian ships it separately); the base's pip, visible
  # through --system-site-packages, installs into the venv
  "$PY" -m venv --system-site-packages --without-pip "$VENV"
fi
VPY=$VENV/bin/python
# Where python3 is itself a virtual environment, --system-site-packages reaches past it to the base
# interpreter: a .pth file lets the venv see that environment's packages too.
OUTER=$("$PY" -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')
if [[ -n "$OUTER" ]]; then
  echo "$OUTER" > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ci-outer-venv.pth"
fi
# Build requirements for --no-build-isolation (already satisfied when the system has them).
"$VPY" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12"
command -v cmake >/dev/null || "$VPY" -m pip install -q cmake
command -v ninja >/dev/null || "$VPY" -m pip install -q ninja

# An editable install of attnx in the base environment (a developer machine) registers an
# import hook that would win over the venv's copy; drop it inside this venv only.
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$SITE/sitecustomize.py" <<'EOF'
# written by .ci/sanitize.sh: import the sanitized attnx of this venv, not an editable install
import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if not ("editable" in type(f).__module__ and "attnx" in type(f).__module__)]
EOF

# ---- build ------------------------------------------------------------------------------------
# (skipped once after a --build-only run in this directory: its marker is used up here)
BUILT=$WORK/built-by-build-only
if [[ -e "$BUILT" && $BUILD_ONLY == 0 ]]; then
  rm -f "$BUILT"
  echo "sanitize: testing the build that --build-only made"
else
  echo "sanitize: building attnx with -DATTNX_SANITIZE=ON"
  T0=$(date +%s)
  # -g1: line tables only (file:line in every report's stack), not full debug info, which took a
  # third of the build's time in the templated kernels.
  "$VPY" -m pip install -q --no-build-isolation --no-deps --force-reinstall \
    -Ccmake.define.ATTNX_SANITIZE=ON -Ccmake.build-type=RelWithDebInfo \
    -Ccmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
    -Cbuild-dir="$WORK/build" "$ROOT"
  echo "sanitize: built in $(( $(date +%s) - T0 )) s"
  if (( BUILD_ONLY )); then
    touch "$BUILT"
    exit 0
  fi
fi

# ---- run --------------------------------------------------------------------------------------
REPORTS=$WORK/reports
rm -rf "$REPORTS"
mkdir -p "$REPORTS"
export LD_PRELOAD="$ASAN_LIB $UBSAN_LIB${LD_PRELOAD:+ $LD_PRELOAD}"
# detect_leaks=0: CPython keeps its interned objects to the end by design (LSan would list them).
# allocator_may_return_null=1: an impossible allocation becomes NULL -> MemoryError, which is
# what attnx must turn it into (tests/hardening/test_resources.py), instead of ASan aborting first.
# Reports also go to files (log_path) so that one in a subprocess can not go unnoticed.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:check_initialization_order=1:detect_stack_use_after_return=1:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan"
export ATTNX_SANITIZED=1
export ATTNX_FUZZ_EXAMPLES=${ATTNX_FUZZ_EXAMPLES:-1000}
export ATTNX_HYPOTHESIS_PROFILE=${ATTNX_HYPOTHESIS_PROFILE:-ci}

# The tests must import the sanitized build, not another attnx.
"$VPY" - "$VENV" <<'EOF'
import os, sys
import attnx, attnx._core as core
venv = os.path.realpath(sys.argv[1])
path = os.path.realpath(core.__file__)
if not path.startswith(venv + os.sep):
    sys.exit(f"sanitize: imported {path}, not the sanitized build under {venv}")
with open(path, "rb") as f:
    if b"__asan_init" not in f.read():
        sys.exit(f"sanitize: {path} is not instrumented (no __asan_init)")
print(f"sanitize: attnx {attnx.__version__} from {path}, isa={attnx.cpu_features()['isa']}, "
      f"threads={attnx.get_num_threads()}")
EOF

T0=$(date +%s)
rc=0
# The whole suite (pyproject's testpaths), less one test that measures RSS, which under ASan's
# allocator (redzones, quarantine) measures ASan rather than attnx.
# The integration suites (Hugging Face models, torch.distributed process groups) spend their time
# in torch and transformers, which are not instrumented; their attnx calls are the ones the
# kernel, tensor and merge tests already make here.
"$VPY" -m pytest -q -p no:cacheprovider \
  --deselect tests/attention/test_attention.py::test_memory_is_linear_in_sequence_length \
  --ignore=tests/integrations/test_hf.py --ignore=tests/integrations/test_distributed.py \
  "$@" || rc=$?
echo "sanitize: tests ran in $(( $(date +%s) - T0 )) s (exit $rc)"

# Any error report is a finding, even when the test that ran the process did not notice it.
# (ASan's "WARNING: failed to allocate" lines are not: they are the impossible allocations that
# tests/hardening/test_resources.py makes on purpose, answered with NULL -> MemoryError.)
shopt -s nullglob
found=0
for r in "$REPORTS"/*; do
  if grep -qE "ERROR: |runtime error|SUMMARY: " "$r"; then
    echo "==== sanitizer report $r" >&2
    cat "$r" >&2
    found=$((found + 1))
  fi
done
if (( found )); then
  echo "sanitize: $found sanitizer report(s): FAILED" >&2
  rc=1
else
  echo "sanitize: no sanitizer reports"
fi
echo "sanitize: total $(( $(date +%s) - START )) s"
if (( rc == 0 && KEEP == 0 )); then
  rm -rf "$WORK"
fi
exit $rc
