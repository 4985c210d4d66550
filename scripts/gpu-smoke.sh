#!/usr/bin/env bash
# GPU smoke test: on a machine with one NVIDIA GPU where torch, transformers and accelerate are installed (no Ray,
# no vLLM, no internet), run real `dualrun launch --backend torchrun` jobs on CUDA in bf16 -- SFT, GRPO (TRL
# generates with transformers), GKD with a colocated teacher -- and `dualrun plan` for every GPU config, then print
# one table. Under 8 minutes.
#
#   bash scripts/gpu-smoke.sh fetch-wheels DIR   # on a machine with the package index: TRL + datasets wheels (< 60 MB)
#   bash scripts/gpu-smoke.sh [DIR]              # on the GPU machine: installs from DIR (if given), then runs
#
# Env: PYTHON (default python3), DUALRUN_SMOKE_DIR (work dir, default a temp dir), DUALRUN_SMOKE_STEPS (default 8),
# DUALRUN_SMOKE_CPU=1 (check the script itself on a CPU machine: the same jobs with use_cpu in fp32).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
# TRL and datasets, plus the datasets dependencies a transformers+accelerate install usually lacks.
WHEELS=(trl==1.16.0 datasets==5.2.0 pyarrow dill xxhash multiprocess)

if [ "${1:-}" = fetch-wheels ]; then
  dir="${2:?usage: gpu-smoke.sh fetch-wheels DIR}"
  "$PY" -m pip download -q --no-deps --only-binary :all: -d "$dir" "${WHEELS[@]}" || exit 1
  du -sh "$dir"
  exit 0
fi

fail() { echo "gpu-smoke: $*" >&2; exit 2; }
if [ "${DUALRUN_SMOKE_CPU:-0}" = 1 ]; then
  PRECISION="use_cpu: true"; PRECISION_ARGS=(--use_cpu true); DEVICE="CPU (DUALRUN_SMOKE_CPU=1)"
else
  "$PY" - <<'EOF' || fail "needs torch with CUDA and one visible NVIDIA GPU"
import sys, torch
sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else 1)
EOF
  PRECISION="mixed_precision: bf16"; PRECISION_ARGS=(--bf16 true)
  DEVICE="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"
fi
if [ -n "${1:-}" ]; then
  "$PY" -m pip install -q --no-index --find-links "$1" "${WHEELS[@]%%==*}" >/dev/null 2>&1 || fail "cannot install TRL/datasets from $1"
fi
"$PY" -c "import trl, datasets, accelerate, transformers" 2>/dev/null || fail "TRL and datasets are missing: pass the wheel dir"
# dualrun itself, without its Ray dependency (the torchrun backend never imports Ray).
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e "$ROOT" >/dev/null 2>&1 || fail "cannot install dualrun from $ROOT"

WORK="${DUALRUN_SMOKE_DIR:-$(mktemp -d -t dualrun-gpu-smoke-XXXX)}"
STEPS="${DUALRUN_SMOKE_STEPS:-8}"
mkdir -p "$WORK"
cd "$WORK" || exit 1
"$PY" "$ROOT/examples/make_tiny_model.py" --out tiny >/dev/null 2>&1 || fail "could not build the tiny model"
ROWS=()
START=$(date +%s)

# run NAME TIMEOUT COMMAND...: one table row (exit code, seconds, last logged loss of OUT/NAME if any)
run() {
  local name="$1" limit="$2"; shift 2
  local t0 rc detail
  t0=$(date +%s)
  timeout "$limit" "$@" >"$name.log" 2>&1
  rc=$?
  detail=$("$PY" - "$name" <<'EOF'
import json, pathlib, sys
state = pathlib.Path("out", sys.argv[1], "trainer_state.json")
if state.exists():
    losses = [h["loss"] for h in json.loads(state.read_text())["log_history"] if "loss" in h]
    print(f"{len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no loss logged")
EOF
)
  [ -n "$detail" ] || detail="$(grep -m1 -oE '[0-9]+ GPU\(s\)$' "$name.log"), $(grep -cE '^  (GPU|CPU) ' "$name.log") processes planned"
  [ "$rc" = 0 ] || detail="$(grep -m1 '^dualrun: error' "$name.log" || tail -n1 "$name.log") (log: $WORK/$name.log)"
  ROWS+=("$(printf '| %-28s | %4s | %5ss | %s |' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$detail")")
}

cat >sft.yaml <<EOF
$PRECISION
method: sft
roles: {train: {gpus: 1}}
EOF
cat >grpo.yaml <<EOF
$PRECISION
method: grpo
roles: {train: {gpus: 1}}
EOF
cat >gkd.yaml <<EOF
$PRECISION
method: gkd
roles:
  train: {gpus: 1}
  teacher: {gpus: 1, model: $WORK/tiny/teacher}
colocate_groups: [[train, teacher]]
EOF
COMMON=("${PRECISION_ARGS[@]}" --max_steps "$STEPS" --save_strategy no --report_to none --seed 0)
run sft 150 "$PY" -m dualrun launch --backend torchrun --config_file sft.yaml "$ROOT/examples/sft.py" \
  --model_name_or_path tiny/model --dataset_path tiny/data/sft.jsonl --output_dir out/sft "${COMMON[@]}"
run grpo 200 "$PY" -m dualrun launch --backend torchrun --config_file grpo.yaml "$ROOT/examples/grpo.py" \
  --model_name_or_path tiny/model --dataset_path tiny/data/prompts.jsonl --output_dir out/grpo "${COMMON[@]}"
run gkd 200 "$PY" -m dualrun launch --backend torchrun --config_file gkd.yaml "$ROOT/examples/gkd.py" \
  --model_name_or_path tiny/model --dataset_path tiny/data/gkd.jsonl --output_dir out/gkd "${COMMON[@]}"
for cfg in "$ROOT"/configs/*gpu*.yaml "$ROOT/configs/sampling_swift.yaml"; do
  run "plan $(basename "$cfg")" 30 "$PY" -m dualrun plan --config_file "$cfg"
done

echo
echo "dualrun GPU smoke: $DEVICE"
echo "| step                         | exit | time  | result |"
echo "|------------------------------|------|-------|--------|"
printf '%s\n' "${ROWS[@]}"
echo "total $(( $(date +%s) - START )) s; logs in $WORK"
! printf '%s\n' "${ROWS[@]}" | grep -qv '^| [^|]*|    0 |'
