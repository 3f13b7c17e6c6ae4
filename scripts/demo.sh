#!/usr/bin/env bash
# The main job: sets up what is missing, then trains a tiny Llama from transformers with PTD-P
# (pp=2 x tp=2, zb-h1) under torchrun on 4 CPU ranks (gloo); NPROC=8 adds dp=2.
# Extra arguments go to examples/train_llama.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$TORCHPP_ROOT"
NPROC="${NPROC:-4}"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/train_llama.py "$@"
