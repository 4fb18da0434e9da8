#!/usr/bin/env bash
# One unattended run on a borrowed machine (more cores, another CPU family): the machine's
# description, a build, the test suite, the bench at 2 pinned threads and at every thread, and
# SmolLM2's architecture in transformers (random weights: no download, no GGUF), each step with
# its own time limit and its output in a file under $OUT. Run from the repository root:
#
#   OUT=/tmp/out bash bench/one_shot.sh                 # every step
#   STEPS="machine build bench" bash bench/one_shot.sh  # some of them
#
# STEPS: machine build suite bench hf (default: all). BENCH_ARGS: the bench's options (default
# --quick). HF_ARGS: hf_generate.py's (default: bf16, one 2048-token prompt). SUITE_ARGS: pytest's
# selection (default: tests; it needs pytest-xdist). The build goes to
# $OUT/../one-shot-site (PYTHONPATH), never into the machine's own environment; it needs
# scikit-build-core, pybind11, cmake and ninja already installed (no index is used).
set -uo pipefail
OUT=${OUT:-$PWD/one-shot-out}
STEPS=${STEPS:-machine build suite bench hf}
BENCH_ARGS=${BENCH_ARGS:---quick}
HF_ARGS=${HF_ARGS:---dtype bfloat16 --lens 2048 --batch 1 --new-tokens 8 --repeat 2}
SUITE_ARGS=${SUITE_ARGS:-tests}
PY=${PYTHON:-python3}
SITE=$(dirname "$OUT")/one-shot-site
mkdir -p "$OUT"
ROOT=$PWD
NCPU=$(nproc)
T0=$SECONDS

# step NAME LIMIT: runs the function NAME (below) in a child shell under a time limit (timeout
# signals the child's whole process group), its output in $OUT/NAME.log, and notes its status and
# duration in $OUT/steps.log. Nothing here is a bare `wait`: that would also wait for any process
# substitution the caller made (a `tee` that never ends).
step() {
  local name=$1 limit=$2 t=$SECONDS rc
  timeout --kill-after=10 "$limit" bash -c "$name" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc, $((SECONDS - t)) s (at $((SECONDS - T0)) s)" | tee -a "$OUT/steps.log"
}
wants() { [[ " $STEPS " == *" $1 "* ]]; }
with_site() { PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$@"; }

machine() {
  lscpu
  echo "nproc: $NCPU"
  "$PY" -c 'import sys, platform; print(sys.version); print(platform.platform())'
  "$PY" -c 'import numpy; print("numpy", numpy.__version__)'
  "$PY" -c 'import torch; print("torch", torch.__version__)' || true
  "$PY" -c 'import transformers; print("transformers", transformers.__version__)' || true
  "$PY" -c 'import onnxruntime; print("onnxruntime", onnxruntime.__version__)' || true
}

build() {
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-build-isolation --no-deps --no-index --target "$SITE" \
    -Cbuild-dir="$(dirname "$OUT")/one-shot-build" "$ROOT" &&
    with_site "$PY" -c 'import attnx; print(attnx.__file__); print(attnx.cpu_features())'
}

suite() {  # as CI runs it, on most of the cores, two threads a worker
  local workers=$((NCPU > 4 ? NCPU - 2 : 2))
  ATTNX_NUM_THREADS=2 with_site "$PY" -m pytest -q -p no:cacheprovider -p no:benchmark \
    -n "$workers" --ignore=tests/packaging --ignore=tests/bench $SUITE_ARGS
}

bench() {  # 2 threads on two pinned cores, then every thread
  with_site taskset -c 0,1 "$PY" -m attnx bench $BENCH_ARGS --threads 2 --json "$OUT/bench-2.json"
  [ "$NCPU" -le 2 ] ||
    with_site "$PY" -m attnx bench $BENCH_ARGS --threads "$NCPU" --json "$OUT/bench-$NCPU.json"
}

hf() {  # SmolLM2-135M's architecture in transformers, attnx against sdpa, at every thread, then 2
  cd "$ROOT/examples" || return 1
  [ "$NCPU" -le 2 ] || with_site "$PY" hf_generate.py --random-weights --threads "$NCPU" $HF_ARGS
  with_site taskset -c 0,1 "$PY" hf_generate.py --random-weights --threads 2 $HF_ARGS
}

export OUT SITE ROOT NCPU PY BENCH_ARGS HF_ARGS SUITE_ARGS
export -f with_site machine build suite bench hf
wants machine && step machine 30
wants build && step build 300
wants suite && step suite 420
wants bench && step bench 600
wants hf && step hf 300
echo "done in $((SECONDS - T0)) s; logs in $OUT" | tee -a "$OUT/steps.log"
