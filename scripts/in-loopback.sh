#!/usr/bin/env bash
# Run a command in a loopback-only network namespace, so Ray, torchrun and gloo never leave 127.0.0.1
# (Ray rewrites 127.0.0.1 to the machine's routable address otherwise). Needs root (CI runs as root).
set -euo pipefail
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up && exec "$@"' _ "$@"
fi
echo "note: cannot create a loopback-only network namespace (need root + unshare); running as is" >&2
exec "$@"
