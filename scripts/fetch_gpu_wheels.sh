#!/usr/bin/env bash
# Downloads, here (where the registry is reachable), the wheels a lent GPU machine lacks into
# .whl/ at the repository root (git ignores it), for the device tool to carry (carry: [".whl"]).
# That machine has Python 3.12, torch 2.11+cu130 and transformers 5.17 but no registry;
# scripts/setup_env.sh installs what is in .whl/ there. What it lacks for torchpp:
# transformers 5.24 (pinned by setup_env.sh; every other requirement of it is on that machine,
# at versions it accepts: huggingface-hub 1.33, tokenizers 0.23, safetensors 0.8, numpy 2.5, typer),
# a regex new enough for it (>= 2025.10.22; the machine's version is not recorded), and crc32c
# for the checksums of checkpoints (the DCP test saves one).
# The carried folder must stay well under the tool's 64 MiB limit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
mkdir -p "$DEST"
rm -f "$DEST"/*.whl "$DEST/PYTHON"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "transformers==5.24.0" "regex>=2025.10.22" crc32c
echo 3.12 >"$DEST/PYTHON"  # setup_env.sh installs them only for this Python
size_kib=$(du -sk "$DEST" | cut -f1)
ls -1 "$DEST"
echo "fetch_gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB in $DEST"
if [ "$size_kib" -gt $((60 * 1024)) ]; then
  echo "fetch_gpu_wheels: over 60 MiB, too much to carry" >&2
  exit 1
fi
