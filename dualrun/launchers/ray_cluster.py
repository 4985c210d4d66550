"""Ray cluster side of the Ray backend: find or start a cluster, read its nodes, place bundles.

Address rules (`ray.address`):
  'auto'   join a running cluster: RAY_ADDRESS, else the last `ray start` here, else the one GCS running here.
  'local'  always start an embedded single-node cluster for this job (bound to 127.0.0.1), shut down after.
  None     join a running cluster when one is reachable (RAY_ADDRESS or the last `ray start`), else 'local'.
  HOST:PORT / ray://...   join exactly that cluster.
Ray 2.60 turns token auth on when ~/.ray/auth_token exists; explicit addresses then need RAY_AUTH_MODE=token,
which we set only when the cluster asks for a token (a driver in token mode breaks a cluster without auth).
A reachability probe (TCP, 2 s) runs before
`ray.init` so a stale or unreachable address fails in seconds with one actionable line, never a long hang.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from dualrun.config.model import JobConfig
from dualrun.errors import ConfigError, LaunchError
from dualrun.plan import Cluster, Node

_PROBE_S = 2.0
_QUIET_LOGGERS = ("ray._private.authentication.authentication_token_setup",)


def _reachable(address: str, timeout: float = _PROBE_S) -> bool:
    """Can we open a TCP connection to a GCS `host:port` or a Ray client's `ray://host:port`?"""
    if address.startswith("ray://"):
        address = address[len("ray://"):].split("/", 1)[0]
    elif "://" in address:
        return True
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _last_started() -> str | None:
    """The address of the last `ray start` on this machine (Ray's own bookkeeping file)."""
    from ray._private.utils import read_ray_address

    return read_ray_address(None)


def _running_gcs() -> list[str]:
    from ray._private.services import find_gcs_addresses

    return sorted(find_gcs_addresses())


def resolve_address(cfg: JobConfig) -> str | None:
    """The address to join, or None to start an embedded cluster. Raises LaunchError when 'auto' finds none."""
    wanted = cfg.ray.address
    if wanted == "local":
        return None
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if wanted not in (None, "auto"):
        return wanted
    if env:
        return env
    last = _last_started()
    if last and _reachable(last):
        return last
    if wanted is None:
        return None
    live = [a for a in _running_gcs() if _reachable(a)]
    if len(live) == 1:
        return live[0]
    if len(live) > 1:
        raise LaunchError(f"{cfg.source}: ray.address: 'auto' found {len(live)} Ray clusters on this machine "
                          f"({', '.join(live)}): set ray.address (or RAY_ADDRESS) to the one to use", 2)
    raise LaunchError(f"{cfg.source}: ray.address: 'auto' found no running Ray cluster: start one "
                      "(`ray start --head`), set RAY_ADDRESS, or set ray.address: null to start one for this job", 2)


def _unreachable(cfg: JobConfig, address: str) -> ConfigError:
    given = cfg.ray.address not in (None, "auto")   # else it came from RAY_ADDRESS (or `ray start`)
    return ConfigError(cfg.source if given else "<environment>", "ray.address" if given else "RAY_ADDRESS",
                       "a Ray cluster reachable from here (`ray status --address ...`; ray.address: local "
                       "starts one for the job)", address)


def check_reachable(cfg: JobConfig) -> None:
    """Before anything heavy starts (torch for accelerate's env, Ray itself): an address given in the config or in
    RAY_ADDRESS must answer, so a wrong one fails in about 2 s."""
    address = cfg.ray.address if cfg.ray.address not in (None, "auto", "local") else None
    if address is None and cfg.ray.address != "local":
        address = os.environ.get("RAY_ADDRESS", "").strip() or None
    if address not in (None, "auto", "local") and not _reachable(address):
        raise _unreachable(cfg, address)


def _token_available() -> bool:
    return bool((Path.home() / ".ray" / "auth_token").exists() or os.environ.get("RAY_AUTH_TOKEN")
                or os.environ.get("RAY_AUTH_TOKEN_PATH"))


def _needs_token(address: str) -> bool:
    """Does the cluster at `address` require token auth? Asked once, without a token (about 0.1 s).

    Why ask: Ray enables token mode whenever a token file exists, but a driver in token mode cannot serve a
    cluster started without auth (the GCS fails to call back its owner and kills its actors at birth)."""
    if "://" in address or os.environ.get("RAY_AUTH_MODE") or not _token_available():
        return False
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    try:
        GcsClient(address=address).internal_kv_get(b"dualrun_probe", None, timeout=_PROBE_S)
    except AuthenticationError:
        return True
    except Exception:  # noqa: BLE001 - ray.init will report anything else
        return False
    return False


def _set_auth_mode(mode: str) -> None:
    os.environ["RAY_AUTH_MODE"] = mode
    _refresh_config()   # Ray caches the mode; this makes the running process see the change


@dataclass
class Connection:
    """A live `ray.init` of this driver; `embedded` when we started the cluster (and so must stop it)."""

    address: str | None
    embedded: bool
    saved_env: dict[str, str | None]

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()   # for an embedded cluster this stops every process it started
        _restore(self.saved_env)
        self.saved_env = {}


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if os.environ.get(key) == value:
            continue
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
        if key == "RAY_AUTH_MODE":
            _set_auth_mode(value) if value else _refresh_config()


def _refresh_config() -> None:
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception:  # noqa: BLE001
        pass


def embedded_cpus(cfg: JobConfig) -> int:
    """CPUs to declare for an embedded cluster: enough bundles for every worker and every CPU server of a separate
    role (a logical count, not cores)."""
    from dualrun.plan import units

    workers = cfg.primary.processes
    # one CPU bundle per separate unit that dualrun starts a CPU server for (role programs pass a minimal
    # stand-in without roles)
    servers = sum(1 for _, r in units(cfg)[1:] if not r.address and not r.gpus) if hasattr(cfg, "roles") else 0
    return max(1, math.ceil(workers * cfg.ray.num_cpus_per_worker + servers * max(cfg.ray.num_cpus_per_worker, 1.0)))


def connect(cfg: JobConfig, allow_start: bool = True) -> Connection | None:
    """Join the cluster `cfg` names, or start an embedded one (when allowed). One-line errors on failure."""
    import ray

    address = resolve_address(cfg)
    if address is None and not allow_start:
        return None
    if address is not None and not _reachable(address):
        if not allow_start:
            return None
        raise _unreachable(cfg, address)
    saved: dict[str, str | None] = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE")}  # ray.init may set it
    if address is not None and _needs_token(address):
        _set_auth_mode("token")
    quiet = [logging.getLogger(n) for n in _QUIET_LOGGERS]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if cfg.ray.runtime_env:
        kwargs["runtime_env"] = dict(cfg.ray.runtime_env)
    try:
        if address is None:
            # an embedded cluster is this job's alone: no usage-stats reporting (Ray would otherwise run a
            # reporting dashboard module and contact its servers); the user can still opt in with the variable
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(address="local", num_cpus=embedded_cpus(cfg), include_dashboard=cfg.ray.include_dashboard,
                     _node_ip_address="127.0.0.1", **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure becomes one actionable line
        _restore(saved)
        if ray.is_initialized():
            ray.shutdown()
        if not allow_start:
            return None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = f"the Ray cluster at {address}" if address else "an embedded local Ray cluster"
        hint = (" If the cluster uses token auth, put its token in ~/.ray/auth_token (or RAY_AUTH_TOKEN) and set "
                "RAY_AUTH_MODE=token." if address else " Check `dualrun env` and free disk space in /tmp.")
        raise LaunchError(f"could not connect to {where}: {first}.{hint}", 1) from None
    finally:
        for q, lvl in zip(quiet, levels):
            q.setLevel(lvl)
    return Connection(address, address is None, saved)


def alive_nodes() -> list[dict[str, Any]]:
    """Alive nodes, head first, then by address and id (a stable order for node indexes)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    head = lambda n: 0 if "node:__internal_head__" in n.get("Resources", {}) else 1  # noqa: E731
    return sorted(nodes, key=lambda n: (head(n), n.get("NodeManagerAddress", ""), n.get("NodeID", "")))


def cluster_of(nodes: Iterable[dict[str, Any]]) -> Cluster:
    out = []
    for i, n in enumerate(nodes):
        res = n.get("Resources", {})
        out.append(Node(i, n.get("NodeManagerAddress", "?"), int(res.get("GPU", 0)), float(res.get("CPU", 0)),
                        n.get("NodeID", "")))
    return Cluster(tuple(out), source="ray")


def live_cluster(cfg: JobConfig) -> Cluster | None:
    """The running cluster's nodes when one is reachable without starting one (for `dualrun plan`), else None."""
    import ray

    if cfg.ray.address == "local" or ray.is_initialized():
        return cluster_of(alive_nodes()) if ray.is_initialized() else None
    try:
        conn = connect(cfg, allow_start=False)
    except LaunchError:
        return None
    if conn is None:
        return None
    try:
        return cluster_of(alive_nodes())
    finally:
        conn.close()


# -- placement -------------------------------------------------------------------------------------------------

def check_resources(cfg: JobConfig, role: str, bundles: list[dict[str, float]]) -> None:
    """Fail with one line (exit 2) when the cluster can never hold these bundles: totals and the largest node."""
    nodes = alive_nodes()
    total = {"GPU": sum(n["Resources"].get("GPU", 0) for n in nodes),
             "CPU": sum(n["Resources"].get("CPU", 0) for n in nodes)}
    want = {k: sum(b.get(k, 0) for b in bundles) for k in ("GPU", "CPU")}
    key = {"GPU": f"roles.{role}.gpus", "CPU": "ray.num_cpus_per_worker"}
    for res in ("GPU", "CPU"):
        if want[res] > total[res] + 1e-9:
            raise ConfigError(cfg.source, key[res], f"at most {total[res]:g} {res}s in total (the Ray cluster has "
                              f"{total[res]:g} in {len(nodes)} node(s))", f"{want[res]:g}")
        biggest = max((b.get(res, 0) for b in bundles), default=0)
        best = max((n["Resources"].get(res, 0) for n in nodes), default=0)
        if biggest > best + 1e-9:
            raise ConfigError(cfg.source, key[res], f"at most {best:g} {res}s per process (the largest node of the "
                              "Ray cluster has that many)", f"{biggest:g}")


def describe_free() -> str:
    import ray

    free = ray.available_resources()
    total = ray.cluster_resources()
    parts = [f"{k} {free.get(k, 0):g}/{total.get(k, 0):g} free" for k in ("GPU", "CPU") if total.get(k)]
    return f"{len(alive_nodes())} node(s), " + (", ".join(parts) or "no CPUs or GPUs")


def placement_group(cfg: JobConfig, name: str, bundles: list[dict[str, float]]) -> Any:
    """Ask for one placement group (not waiting). PACK is Ray's soft packing: it spreads bundles over nodes
    when one node cannot hold them, which is the "PACK first, SPREAD fallback" the design asks for; STRICT_*
    strategies are taken as given."""
    from ray.util.placement_group import placement_group as make

    return make(bundles, strategy=cfg.ray.placement_strategy, name=name)


def placed(pg: Any, timeout: float, check: Callable[[], None] = lambda: None) -> bool:
    """Whether `pg` is placed within `timeout` s; `check` runs every second meanwhile (so a signal is seen)."""
    import ray

    deadline = time.monotonic() + timeout
    ref = pg.ready()
    ready: list[Any] = []
    while not ready:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _ = ray.wait([ref], timeout=min(1.0, left))
        check()
    return bool(ready)


def wait_placed(cfg: JobConfig, pg: Any, role: str, bundles: list[dict[str, float]],
                check: Callable[[], None] = lambda: None) -> None:
    """Wait at most ray.placement_timeout_s for `pg` (calling `check` every second, so a signal is seen);
    then one line saying what was asked and what the cluster has free."""
    timeout = cfg.ray.placement_timeout_s
    if not placed(pg, timeout, check):
        raise LaunchError(f"roles.{role}: {len(bundles)} bundle(s) {_shape(bundles)} with strategy "
                          f"{cfg.ray.placement_strategy} could not be placed within ray.placement_timeout_s="
                          f"{timeout:g} s; the cluster has {describe_free()}. Free resources, lower the role's "
                          "gpus, change ray.placement_strategy or raise the timeout", 1)


def wait_refs(refs: list[Any], what: str, limit: float, check: Callable[[], None] = lambda: None) -> list[Any]:
    """`ray.get(refs)` that calls `check` every second (so a signal is seen within a second) and gives up
    after `limit` s with one line (a runtime_env that never installs, an actor that never starts...)."""
    import ray

    deadline = time.monotonic() + limit
    while True:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
        check()
        if len(ready) == len(refs):
            return ray.get(refs)
        if time.monotonic() > deadline:
            raise LaunchError(f"the Ray workers did not {what} within {limit:g} s", 1)


def _shape(bundles: list[dict[str, float]]) -> str:
    kinds = sorted({tuple(sorted(b.items())) for b in bundles})
    return " + ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in kind) + "}" for kind in kinds)
