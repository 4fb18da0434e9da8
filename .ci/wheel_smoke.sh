#!/usr/bin/env bash
# The installed attnx, tested from OUTSIDE the source tree: `python -m attnx` (the smoke command)
# and a fast subset of the tests (about a minute on 2 cores), run from a copy of tests/ so that
# nothing can import the source tree's python/attnx instead of the installed package.
#
#   bash .ci/wheel_smoke.sh [PYTHON [TEST...]]   # PYTHON: the environment's interpreter (default
#                                                # python); TEST...: pytest's selection (paths
#                                                # under tests/, -k ...) instead of SUBSET below
#
# Used by .ci/wheel.sh (repaired wheel, then sdist install), by cibuildwheel's test-command, and
# by .ci/portable/wheel_aarch64.sh (emulated, with a smaller selection).
# Needs pytest and hypothesis in that environment (the `test` extra).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-python}
shift || true
# Tests that do not read files of the source tree (reference/test_reference.py loads reference.py
# by path, packaging/test_examples.py runs examples/, hardening/test_fuzz_harness.py runs fuzz/):
# the binding's checks, the dense kernel with every variant, paged attention, the cache and the
# layer, on every ISA.
SUBSET=(packaging/test_packaging.py hardening/test_errors.py attention/test_variants.py
        paged/test_paged.py cache/test_cache.py integrations/test_layers.py)

RUN=$(mktemp -d "${TMPDIR:-/tmp}/attnx-wheel-tests.XXXXXX")
trap 'rm -rf "$RUN"' EXIT
cp -r "$ROOT/tests" "$RUN/tests"
cp "$ROOT/pyproject.toml" "$RUN/"   # pytest's settings (markers, warnings as errors) only
cd "$RUN"

"$PY" - "$ROOT" <<'PYEOF'
import os, sys
import attnx
source = os.path.realpath(os.path.join(sys.argv[1], "python"))
where = os.path.realpath(attnx.__file__)
if where.startswith(source + os.sep):
    sys.exit(f"wheel_smoke: imported attnx from the source tree ({where}), not the installed one")
print(f"wheel_smoke: attnx {attnx.__version__} from {where}")
PYEOF
SMOKE=$("$PY" -m attnx)
echo "$SMOKE"
grep -q "max |diff|" <<<"$SMOKE" || { echo "wheel_smoke: python -m attnx printed no kernel-vs-reference line" >&2; exit 1; }
if (( $# )); then
  "$PY" -m pytest -q -p no:cacheprovider -m "not slow" "$@"
else
  "$PY" -m pytest -q -p no:cacheprovider -m "not slow" "${SUBSET[@]/#/tests/}"
fi
