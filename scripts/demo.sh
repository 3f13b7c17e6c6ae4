#!/usr/bin/env bash
# The main job: sets up what is missing, then trains with torchrun on 4 CPU ranks (gloo).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$TORCHPP_ROOT"
NPROC="${NPROC:-4}"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/train_ptdp.py "$@"
