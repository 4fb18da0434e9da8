# .ci/_prelude.sh: what .ci/wheel.sh and .ci/sanitize.sh both start with (sourced, never run).
# ci_prelude NAME DIR_VARIABLE: cd to the repository root and set ROOT; START (seconds, for the
# step timings); PY (PYTHON, default python3); WORK, the work directory: $DIR_VARIABLE if the
# caller set it (KEEP=1), else a fresh mktemp directory that the script removes on success (KEEP=0).
ci_prelude() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  ROOT=$PWD
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
  START=$(date +%s)
  PY=${PYTHON:-python3}
  KEEP=1
  WORK=${!2:-}
  if [[ -z "$WORK" ]]; then
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/attnx-$1.XXXXXX")
    KEEP=0
  fi
  mkdir -p "$WORK"
}
