#!/usr/bin/env bash
# Set up and run the whole test suite (unit + real torchrun/Ray end-to-end tests on loopback).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec bash "$ROOT/scripts/in-loopback.sh" python -m pytest -q -p no:cacheprovider "$@"
