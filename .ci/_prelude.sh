# .ci/_prelude.sh: what .ci/wheel.sh and .ci/sanitize.sh both start with, and the wheel repair
# that .ci/wheel.sh and .ci/portable/wheel_aarch64.sh share (sourced, never run).
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

# repair_manylinux NAME WHEEL [ARCH]: `auditwheel repair` WHEEL into $WORK/wheelhouse and set
# REPAIRED to the repaired wheel, which `auditwheel show` and its file name must both call
# manylinux (for ARCH, e.g. aarch64, where given); NAME starts the messages.
repair_manylinux() {
  local name=$1 wheel=$2 arch=${3:-} show
  auditwheel repair -w "$WORK/wheelhouse" "$wheel"
  REPAIRED=$(ls "$WORK"/wheelhouse/attnx-*.whl)
  show=$(auditwheel show "$REPAIRED" 2>&1)
  echo "$show"
  if ! tr -s ' \n' '  ' <<<"$show" \
    | grep -q "consistent with the following platform tag: \"manylinux_[0-9_]*${arch:+_$arch}"; then
    echo "$name: $(basename "$REPAIRED") is not a manylinux${arch:+ $arch} wheel" >&2
    exit 1
  fi
  case "$(basename "$REPAIRED")" in
    *manylinux*${arch:+_$arch}*) echo "$name: repaired to $(basename "$REPAIRED")" ;;
    *) echo "$name: the repaired wheel has no manylinux${arch:+ $arch} tag" >&2; exit 1 ;;
  esac
}
