#!/usr/bin/env bash
# The GPU check, one command on a bare lent GPU machine (docs/gpu.md):
#   environment -> setup and build (scripts/setup_env.sh, MAX_JOBS = nproc) -> tests/gpu -> the
#   GPU benchmarks (split B/W, stage MFU, context-parallel blocks, p=2 bubble over NCCL),
# each part under its own time limit so a slow one cannot eat the rest (under 8 minutes in all).
# Prints a summary; writes it, the whole log and each benchmark's JSON to $OUT when set (the
# device tool brings that folder back), else to bench/results/gpu/<UTC date-time>/.
# TORCHPP_GPU_CHECK_PARTS=setup,tests,bench picks parts (default: all).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/bench/results/gpu/$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
PARTS="${TORCHPP_GPU_CHECK_PARTS:-setup,tests,bench}"
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
START=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }
wants() { [[ ",$PARTS," == *",$1,"* ]]; }

# run_part NAME LIMIT_S COMMAND...: runs it under `timeout`, notes pass/fail/timeout and seconds.
run_part() {
  local name=$1 limit=$2 start rc status
  shift 2
  echo "=== $name (limit ${limit}s) ==="
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  case $rc in
    0) status=passed ;;
    124 | 137) status="TIMED OUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  note "$(printf '%-28s %-22s %4ss' "$name" "$status" "$(($(date +%s) - start))")"
  return $rc
}

echo "=== environment ==="
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 - <<'EOF'
import platform, sys
import torch
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a"
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF
  echo "cores $(nproc), MAX_JOBS $MAX_JOBS"
} | tee "$RESULTS/environment.txt"

# A rerun of some parts on a fresh machine (the previous one was given back) still needs the build.
if ! wants setup && ! PYTHONPATH="$ROOT:$ROOT/build/site" python3 -c "import torchpp._C" 2>/dev/null; then
  echo "torchpp is not built on this machine: running setup first"
  PARTS="setup,$PARTS"
fi
if wants setup; then
  # shellcheck disable=SC1091
  run_part "setup and build" 175 bash -c 'source scripts/setup_env.sh && python3 -c "import torchpp, transformers; \
print(\"torchpp built; transformers\", transformers.__version__)"' || { note "setup failed: nothing else can run"; exit 1; }
fi
# What setup_env.sh exports, for the parts below (it ran in a child shell).
export PYTHONPATH="$ROOT:$ROOT/build/site${PYTHONPATH:+:$PYTHONPATH}"

if wants tests; then
  # Three test files at once where pytest-xdist is there (it is on the lent machines): 16 cores,
  # and the ranks' GPU work is small.
  workers=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n 3 --dist loadfile)
  run_part "tests/gpu" 210 python3 -m pytest tests/gpu -q -rfEs --timeout 120 -p no:cacheprovider "${workers[@]}"
fi

if wants bench; then
  run_part "bench: split B/W" 30 python3 bench/bench_split_bw.py --json "$RESULTS/split_bw.json"
  run_part "bench: stage MFU" 40 python3 bench/bench_stage_mfu.py --json "$RESULTS/stage_mfu.json"
  run_part "bench: CP blocks" 35 python3 bench/bench_cp_block.py --json "$RESULTS/cp_block.json"
  run_part "bench: p=2 bubble (NCCL)" 35 python3 bench/bench_bubble_nccl.py --json "$RESULTS/bubble_nccl.json"
fi

note "total $(($(date +%s) - START))s; results in $RESULTS"
echo "=== summary ==="
cat "$SUMMARY"
! grep -q -e FAILED -e "TIMED OUT" "$SUMMARY"
