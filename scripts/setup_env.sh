#!/usr/bin/env bash
# Prepares this machine for torchpp, doing only what is missing:
# torch 2.13.0 (the local CPU wheel), the Python dependencies from PyPI, and the C++
# extensions built in place (ninja rebuilds only what changed). Source it: it exports
# PYTHONPATH so the in-place build is importable from torchrun and pytest alike.
set -euo pipefail
TORCHPP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install -q torch==2.13.0
fi
TORCH_VERSION="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"

# Pin the installed torch so that no dependency can make pip resolve another one.
if ! "$PYTHON" -c "import transformers, tqdm, matplotlib, ninja, pytest, pytest_timeout" 2>/dev/null; then
  "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}" transformers tqdm matplotlib ninja pytest pytest-timeout
fi

if command -v ccache >/dev/null 2>&1; then
  export CXX="${CXX:-ccache c++}"
fi
export MAX_JOBS="${MAX_JOBS:-2}"
(cd "$TORCHPP_ROOT" && "$PYTHON" setup.py -q build_ext --inplace >/dev/null)

export PYTHONPATH="$TORCHPP_ROOT${PYTHONPATH:+:$PYTHONPATH}"
