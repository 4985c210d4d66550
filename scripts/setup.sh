#!/usr/bin/env bash
# Create (once) a virtual environment with dualrun and its tested dependencies. Sourced by demo.sh and test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DUALRUN_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.dualrun-$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  # The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
  python -m pip install -q -c "$ROOT/constraints.txt" "torch==2.13.0"
  python -m pip install -q -c "$ROOT/constraints.txt" -e "$ROOT[test,deepspeed]"
  # DeepSpeed compiles its CPU communication op (deepspeed_shm_comm, ~80 CPU-s) the first time a job runs it; do
  # that here, once per venv, into the venv's own TORCH_EXTENSIONS_DIR (below), so no test or demo pays it. Bounded
  # and never fatal: where it cannot build (no compiler, killed by the bound) the partial build is removed and
  # DeepSpeed builds the op on first use, as without this step; on a GPU machine the call builds nothing. A venv that
  # has it already only re-checks it (ninja: nothing to do).
  if ! TORCH_EXTENSIONS_DIR="$VENV/torch-extensions" timeout -k 10 "${DUALRUN_DEEPSPEED_BUILD_TIMEOUT:-900}" \
      python -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()' >"$VENV/deepspeed-build.log" 2>&1; then
    echo "note: DeepSpeed's CPU op was not prebuilt (see $VENV/deepspeed-build.log); it builds on first use" >&2
    rm -rf "$VENV/torch-extensions"
  fi
  touch "$STAMP"
fi
# Where torch JIT-builds extensions (DeepSpeed's ops): this venv's own, built above with the venv's ninja, which the
# activated venv keeps first on PATH (another ninja version would rebuild it; tests/conftest.py checks the same).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch-extensions}"
