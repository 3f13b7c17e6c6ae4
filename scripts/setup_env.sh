#!/usr/bin/env bash
# Prepares this machine for torchpp, doing only what is missing:
# torch (2.13.0 from the registry when none is installed; an installed torch, CPU or CUDA build,
# is used as it is), the Python dependencies, and the C++ extensions built in place (ninja
# rebuilds only what changed). Source it: it exports PYTHONPATH so the in-place build is
# importable from torchrun and pytest alike.
#
# Without a registry (a lent GPU machine): wheels carried in .whl/ at the repository root
# (scripts/fetch_gpu_wheels.sh puts them there) are installed into build/site, which goes on
# PYTHONPATH ahead of the machine's own packages; what neither provides is reported.
set -euo pipefail
TORCHPP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
CARRIED="$TORCHPP_ROOT/.whl"
SITE="$TORCHPP_ROOT/build/site"
OFFLINE=0
# Carried wheels are for the Python they were fetched for (.whl/PYTHON names it): install from
# them alone, never from a registry. Elsewhere (this repository's own machine) they are ignored.
if [ -f "$CARRIED/PYTHON" ] && [ "$(cat "$CARRIED/PYTHON")" = "$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ]; then
  OFFLINE=1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# An installed torch is kept whatever its build (a CUDA one is never replaced by the CPU wheel);
# one that is installed but fails to import is an error to fix, not a reason to reinstall.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if "$PYTHON" -m pip show -q torch >/dev/null 2>&1; then
    "$PYTHON" -c "import torch" || true
    echo "torchpp: torch is installed but does not import (above); fix that installation" >&2
    exit 1
  fi
  if [ "$OFFLINE" = 1 ]; then
    echo "torchpp: no torch installed and no registry (carried wheels in $CARRIED)" >&2
    exit 1
  fi
  "$PYTHON" -m pip install -q torch==2.13.0
fi
TORCH_VERSION="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"

# Pin the installed torch so that no dependency can make pip resolve another one; transformers
# is pinned too: the model sweep (docs/models.md) and the plan tests follow its model plans.
# The training job (docs/training.md) reads local text with datasets, logs to tensorboard and
# checksums checkpoints with crc32c.
TRANSFORMERS_VERSION=5.24.0
CORE_DEPS="transformers, tqdm, matplotlib, ninja, pytest, pytest_timeout"
TRAINING_DEPS="datasets, tensorboard, crc32c"
deps_ok() {
  "$PYTHON" -c "import $1
assert transformers.__version__ == '$TRANSFORMERS_VERSION', transformers.__version__" 2>/dev/null
}
if ! deps_ok "$CORE_DEPS, $TRAINING_DEPS"; then
  if [ "$OFFLINE" = 1 ]; then
    # Once per set of carried wheels (the training extras may stay missing: no reinstall for them).
    carried="$(cd "$CARRIED" && ls -1 ./*.whl 2>/dev/null || true)"
    if [ -n "$carried" ] && [ "$carried" != "$(cat "$SITE/.carried" 2>/dev/null)" ]; then
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$CARRIED"/*.whl
      echo "$carried" >"$SITE/.carried"
    fi
    deps_ok "$CORE_DEPS" || { "$PYTHON" -c "import $CORE_DEPS
print('transformers', transformers.__version__)" >&2 || true
      echo "torchpp: dependencies missing after installing the carried wheels (above)" >&2; exit 1; }
    # Offline, the training job's extras are optional: what needs them says so when it runs.
    missing="$("$PYTHON" -c "import importlib.util as u; print(' '.join(m for m in '$TRAINING_DEPS'.split(', ') if u.find_spec(m) is None))")"
    [ -z "$missing" ] || echo "torchpp: offline without $missing (the training job's extras: carry their wheels to use them)" >&2
  else
    "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}" tqdm matplotlib \
      ninja pytest pytest-timeout datasets tensorboard crc32c
  fi
fi

# megatron-core for the Megatron drop-in's tests: 0.16.x is the newest release for Python 3.11
# (0.17+ need 3.12); it depends only on numpy, packaging and torch (pinned to the installed one).
MEGATRON_CORE_VERSION=0.16.1
if ! "$PYTHON" -c "import importlib.metadata as m; assert m.version('megatron-core') == '$MEGATRON_CORE_VERSION'" \
    2>/dev/null; then
  if [ "$OFFLINE" = 1 ]; then
    echo "torchpp: megatron-core $MEGATRON_CORE_VERSION absent and no registry: the Megatron tests cannot run here" >&2
  else
    "$PYTHON" -m pip install -q --no-build-isolation "torch==${TORCH_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}"
  fi
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
