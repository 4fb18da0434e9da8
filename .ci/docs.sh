#!/usr/bin/env bash
# The documentation site (mkdocs.yml, docs/): installs the [docs] extra's packages into the
# current environment and builds the site with warnings as errors (a broken link or anchor, a
# docstring the API reference cannot read). The API reference is read from the sources by static
# analysis, so neither the compiled core nor torch is needed, and attnx itself is not installed
# here (pip install ".[docs]" would build the core again).
#
#   bash .ci/docs.sh          # the site in build/docs-site
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 NO_MKDOCS_2_WARNING=1
PY=${PYTHON:-python3}
mapfile -t reqs < <("$PY" -c '
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["docs"]))')
"$PY" -m pip install -q "${reqs[@]}"
"$PY" -m mkdocs build --strict -d build/docs-site
