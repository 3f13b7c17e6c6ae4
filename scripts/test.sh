#!/usr/bin/env bash
# The test command: sets up what is missing, then runs the whole suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$TORCHPP_ROOT"
exec "$PYTHON" -m pytest tests "$@"
