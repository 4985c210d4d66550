#!/usr/bin/env bash
# The cluster tier alone: the tests marked `cluster` under tests/cluster/ (test_vcluster.py and test_cluster_*.py;
# those also marked `vllm` with the vLLM venv, after the others), which run dualrun on the virtual cluster of
# tests/support/vcluster.py: machines with addresses of their own on a private bridge (network, mount and PID
# namespaces held by processes; needs root). The tests themselves run in a loopback-only namespace, as the main suite
# does; the machines' namespaces are made from there. scripts/test.sh runs this beside the main suite and the vLLM
# tier; arguments go to pytest, and test paths among them (`bash scripts/test-cluster.sh
# tests/cluster/test_cluster_faults.py -k teacher`) replace the tier's list.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
cd "$ROOT"
export DUALRUN_CLUSTER_TIER=1
# Its own cache of the tiny models: the main suite runs beside this tier with the same interpreter, so with one cache
# both tiers' servers would carry the same model path, and a leftover check on that path (`pids_matching(tiny/...)`)
# in one tier would see the other's live servers (CI saw it: a cluster test named two main-suite teachers).
export DUALRUN_TEST_CACHE="${DUALRUN_TEST_CACHE:-${TMPDIR:-/tmp}/dualrun-test-cache}/cluster-tier"
# Test paths among the arguments (a file, or file::test) are what runs; without one, the whole tier.
targets=(tests/cluster)
vllm_targets=(tests/cluster)
for arg in "$@"; do
  case "$arg" in
    -*) ;;
    *) if [ -e "${arg%%::*}" ]; then targets=(); vllm_targets=(); break; fi ;;
  esac
done
status=0
bash "$ROOT/scripts/in-loopback.sh" python -m pytest -q -p no:cacheprovider --durations=8 -m "cluster and not vllm" "$@" \
  "${targets[@]}" || status=$?
[ "$status" != 5 ] || status=0   # 5: no such test selected (the paths named hold only vLLM ones)
# The cluster tests that run vLLM (marked `cluster` and `vllm`, in tests/cluster/) run here, with the vLLM
# venv (scripts/setup-vllm.sh: it waits while the vLLM tier makes it), not in the vLLM tier: that tier is the longer.
# DUALRUN_SKIP_VLLM=1 leaves them out, as it leaves out the vLLM tier.
if [ "${DUALRUN_SKIP_VLLM:-0}" = 1 ]; then
  exit "$status"
fi
setup_log="$(mktemp "${TMPDIR:-/tmp}/dualrun-setup-vllm.XXXXXX")"
if bash "$ROOT/scripts/setup-vllm.sh" >"$setup_log" 2>&1; then
  VLLM_PY="${DUALRUN_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python"
  vllm_status=0
  bash "$ROOT/scripts/in-loopback.sh" "$VLLM_PY" -m pytest -q -p no:cacheprovider --durations=8 -m "cluster and vllm" "$@" \
    "${vllm_targets[@]}" || vllm_status=$?
  [ "$vllm_status" = 0 ] || [ "$vllm_status" = 5 ] || status=$vllm_status   # 5: no such test selected
else
  cat "$setup_log" >&2
  echo "scripts/test-cluster.sh: creating the vLLM venv failed (scripts/setup-vllm.sh, output above)" >&2
  status=1
fi
rm -f "$setup_log"
exit "$status"
