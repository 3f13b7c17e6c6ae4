#!/usr/bin/env bash
# The main job: sets up what is missing, then trains a small Llama from transformers with PTD-P
# (pp=2 x tp=2, zb-h1) on real text under torchrun on 4 CPU ranks (gloo); NPROC=8 adds dp=2.
# Run it again and it resumes from its latest checkpoint (docs/training.md).
# Extra arguments go to examples/train_llama.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$TORCHPP_ROOT"
NPROC="${NPROC:-4}"
# Each torchrun attempt its own store, so that --max-restarts restarts work (docs/training.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/train_llama.py "$@"
