#!/usr/bin/env bash
# The cluster tier alone: the tests marked `cluster` (tests/test_vcluster.py and tests/test_cluster_*.py), which
# run dualrun on the virtual cluster of tests/vcluster.py: machines with addresses of their own on a private bridge
# (network, mount and PID namespaces held by processes; needs root). The tests themselves run in a loopback-only
# namespace, as the main suite does; the machines' namespaces are made from there. scripts/test.sh runs this beside
# the main suite and the vLLM tier; arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
cd "$ROOT"
export DUALRUN_CLUSTER_TIER=1
exec bash "$ROOT/scripts/in-loopback.sh" python -m pytest -q -p no:cacheprovider -m cluster "$@" tests/test_vcluster.py \
  tests/test_cluster_*.py
