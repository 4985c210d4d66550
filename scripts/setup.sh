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
  touch "$STAMP"
fi
