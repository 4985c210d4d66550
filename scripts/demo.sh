#!/usr/bin/env bash
# Set up, build a tiny model offline, and run a real short SFT training on an embedded local Ray cluster.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
cd "$ROOT"
TINY="${DUALRUN_TINY:-$ROOT/tiny}"
python examples/make_tiny_model.py --out "$TINY"
exec bash scripts/in-loopback.sh dualrun launch --backend ray --config_file configs/sft_cpu.yaml \
  examples/sft.py --model_name_or_path "$TINY/model" --dataset_path "$TINY/data/sft.jsonl" \
  --output_dir "$ROOT/runs/demo-sft" --max_steps 8 --seed 0
