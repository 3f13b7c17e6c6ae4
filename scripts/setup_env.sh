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

# Pin the installed torch so that no dependency can make pip resolve another one; transformers
# is pinned too: the model sweep (docs/models.md) and the plan tests follow its model plans.
# The training job (docs/training.md) reads local text with datasets, logs to tensorboard and
# checksums checkpoints with crc32c.
TRANSFORMERS_VERSION=5.24.0
if ! "$PYTHON" -c "import transformers, tqdm, matplotlib, ninja, pytest, pytest_timeout, datasets, tensorboard, crc32c
assert transformers.__version__ == '$TRANSFORMERS_VERSION'" 2>/dev/null; then
  "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}" tqdm matplotlib \
    ninja pytest pytest-timeout datasets tensorboard crc32c
fi

# megatron-core for the Megatron drop-in's tests: 0.16.x is the newest release for Python 3.11
# (0.17+ need 3.12); it depends only on numpy, packaging and torch (pinned to the installed one).
MEGATRON_CORE_VERSION=0.16.1
if ! "$PYTHON" -c "import importlib.metadata as m; assert m.version('megatron-core') == '$MEGATRON_CORE_VERSION'" \
    2>/dev/null; then
  "$PYTHON" -m pip install -q --no-build-isolation "torch==${TORCH_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}"
fi

# ccache through a one-line wrapper: torch's ninja writer takes CXX as a single program.
if [ -z "${CXX:-}" ] && command -v ccache >/dev/null 2>&1; then
  mkdir -p "$TORCHPP_ROOT/build/ccache"
  printf '#!/bin/sh\nexec ccache %s "$@"\n' "$(command -v c++)" >"$TORCHPP_ROOT/build/ccache/c++"
  chmod +x "$TORCHPP_ROOT/build/ccache/c++"
  export CXX="$TORCHPP_ROOT/build/ccache/c++"
fi
export MAX_JOBS="${MAX_JOBS:-2}"
build_log="$TORCHPP_ROOT/build/build_ext.log"
mkdir -p "$TORCHPP_ROOT/build"
if ! (cd "$TORCHPP_ROOT" && "$PYTHON" setup.py -q build_ext --inplace >"$build_log" 2>&1); then
  grep -E "error|Error" "$build_log" | head -40 >&2
  echo "torchpp: building the C++ extension failed; full log: $build_log" >&2
  exit 1
fi

export PYTHONPATH="$TORCHPP_ROOT${PYTHONPATH:+:$PYTHONPATH}"
