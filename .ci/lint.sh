#!/usr/bin/env bash
# Lint and formatting checks, changing no file: ruff's linter and formatter over the Python
# ([tool.ruff] in pyproject.toml) and clang-format over the C++ (.clang-format). Exits non-zero
# on the first tool that finds something. The tools are pinned: a formatter's output changes
# between versions, and CI must judge what a developer's run produced.
#
#   bash .ci/lint.sh                                    # check
#   ruff check --fix . && ruff format .                 # apply the Python rules
#   git ls-files '*.h' '*.cpp' | xargs clang-format -i  # apply the C++ style
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
RUFF_VERSION=0.17.6
CLANG_FORMAT_VERSION=23.1.5

have() {  # have TOOL VERSION: TOOL is on PATH at VERSION
  command -v "$1" >/dev/null && "$1" --version 2>/dev/null | grep -q -- "$2"
}
if ! have ruff "$RUFF_VERSION" || ! have clang-format "$CLANG_FORMAT_VERSION"; then
  "$PY" -m pip install -q "ruff==$RUFF_VERSION" "clang-format==$CLANG_FORMAT_VERSION"
  hash -r
fi

status=0
echo "lint: ruff check"
ruff check . || status=1
echo "lint: ruff format --check"
ruff format --check --output-format concise . || status=1
echo "lint: clang-format"
# Every tracked C++ file (the kernels, the bindings, the bench, the portable smoke test).
mapfile -t cxx < <(git ls-files '*.h' '*.hpp' '*.cpp' '*.cc')
clang-format --dry-run -Werror "${cxx[@]}" || status=1
exit $status
