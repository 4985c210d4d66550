"""Joining (or starting) the Ray cluster of a job and reading its nodes: one implementation for every user.

Used by the Ray launcher, the role-program runtime, `dualrun plan` and `dualrun check`, each with explicit
arguments (the config's `ray:` options, the config's name for messages, the CPUs an embedded cluster declares).

Address rules (`ray.address`):
  'auto'   join a running cluster: RAY_ADDRESS, else the last `ray start` here, else the one GCS running here.
  'local'  always start an embedded single-node cluster for this job (bound to 127.0.0.1), shut down after.
  None     join a running cluster when one is reachable (RAY_ADDRESS or the last `ray start`), else 'local'.
  HOST:PORT / ray://...   join exactly that cluster.
Ray 2.60 turns token auth on when ~/.ray/auth_token exists; explicit addresses then need RAY_AUTH_MODE=token,
which we set only when the cluster asks for a token (a driver in token mode breaks a cluster without auth).
A reachability probe (TCP, 2 s) runs before
`ray.init` so a stale or unreachable address fails in seconds with one actionable line, never a long hang.

An embedded cluster without the dashboard is started lean (`LEAN_*` below, docs/concepts.md "Ray's idle cost"):
no log monitor (dualrun streams the workers' output itself, `log_to_driver=False`), no autoscaler monitor (one
fixed node), no metrics export or task events (nothing reads them without a dashboard), the dashboard agent's
node-stats loop once a minute, no usage stats, no API server (without the dashboard it serves only usage stats), the
dashboard agent in Ray's minimal mode (no gRPC or HTTP server of its own; this driver does not import the
dashboard's packages to choose it); its workers (the ranks) run at normal priority, not Ray's niceness 15. Every
process a job uses stays: GCS, raylet, runtime-env agent (`runtime_env`), the dashboard agent (the raylet cannot run
without it).
"""
from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from dualrun.config.model import RayOptions
from dualrun.contract.errors import ConfigError, LaunchError
from dualrun.plan.processes import Cluster, Node

_PROBE_S = 2.0
_QUIET_LOGGERS = ("ray._private.authentication.authentication_token_setup",)

# What a lean embedded cluster changes (each an ordinary Ray setting; `ray start` takes the same, see docs):
LEAN_SYSTEM_CONFIG: dict[str, Any] = {
    "enable_metrics_collection": False,   # no metrics export from core workers, raylet, GCS, dashboard agent
    "task_events_report_interval_ms": 0,  # no task-event buffer flushed every second by each worker (state API)
    "worker_niceness": 0,   # ranks at normal priority (Ray's 15 lets anything else on a node take their CPU first)
    "memory_monitor_refresh_ms": 1000,   # the raylet's look at its workers' memory (OOM killer): 4/s -> 1/s
}
LEAN_ENV: dict[str, str] = {              # defaults only: a value the user set wins
    "RAY_USAGE_STATS_ENABLED": "0",       # no usage-stats reporting (Ray would contact its servers)
    "REPORTER_UPDATE_INTERVAL_MS": "60000",   # the dashboard agent's psutil scan of every worker: 5 s -> 60 s
}
LEAN_NODE_PARAMS: dict[str, Any] = {"include_log_monitor": False, "no_monitor": True}


def reachable(address: str, timeout: float = _PROBE_S) -> bool:
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


def _last_answering() -> str | None:
    """The last `ray start` on this machine, if its GCS answers."""
    last = _last_started()
    return last if last and reachable(last) else None


def running_here() -> list[str]:
    """What 'auto' finds on this machine (RAY_ADDRESS aside): the last `ray start` when it answers, else every
    GCS running here that answers (one to join; none or several: nothing to pick)."""
    last = _last_answering()
    return [last] if last else [a for a in _running_gcs() if reachable(a)]


def resolve_address(wanted: str | None, source: str) -> str | None:
    """The address to join for `ray.address: wanted`, or None to start an embedded cluster. Raises LaunchError
    when 'auto' finds none (or several)."""
    if wanted == "local":
        return None
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if wanted not in (None, "auto"):
        return wanted
    if env:
        return env
    if wanted is None:
        return _last_answering()
    live = running_here()
    if len(live) == 1:
        return live[0]
    if len(live) > 1:
        raise LaunchError(f"{source}: ray.address: 'auto' found {len(live)} Ray clusters on this machine "
                          f"({', '.join(live)}): set ray.address (or RAY_ADDRESS) to the one to use", 2)
    raise LaunchError(f"{source}: ray.address: 'auto' found no running Ray cluster: start one "
                      "(`ray start --head`), set RAY_ADDRESS, or set ray.address: null to start one for this job", 2)


def reachable_line() -> str:
    """`dualrun env`'s answer to "is a Ray cluster reachable": the cluster `dualrun launch --backend ray` would
    join (RAY_ADDRESS, `auto` looked up as a launch looks it up, else the last `ray start` here) and whether its
    GCS answers (a TCP probe: no Ray connection, nothing kept). The address is shown redacted and escaped."""
    from dualrun.contract.errors import one_line
    from dualrun.contract.redact import redact_text

    addr = os.environ.get("RAY_ADDRESS", "").strip()
    if addr == "auto":
        live = running_here()
        if len(live) != 1:
            found = (f"{len(live)} clusters ({', '.join(live)}): set RAY_ADDRESS to one" if live
                     else "no running cluster")
            return f"no (RAY_ADDRESS=auto: {found} on this machine)"
        return f"yes (auto: {one_line(redact_text(live[0]), 120)})"
    addr = addr or _last_started() or ""
    if not addr:
        return "no (no running cluster found; `dualrun launch --backend ray` starts a local one)"
    shown = one_line(redact_text(addr), 120)   # a password in the URL stays hidden, escapes stay text
    return f"yes ({shown})" if reachable(addr) else f"no ({shown} does not answer)"


def _unreachable(wanted: str | None, source: str, address: str) -> ConfigError:
    given = wanted not in (None, "auto")   # else it came from RAY_ADDRESS (or `ray start`)
    return ConfigError(source if given else "<environment>", "ray.address" if given else "RAY_ADDRESS",
                       "a Ray cluster reachable from here (`ray status --address ...`; ray.address: local "
                       "starts one for the job)", address)


def check_reachable(wanted: str | None, source: str) -> None:
    """Before anything heavy starts (torch for accelerate's env, Ray itself): an address given in the config
    (`ray.address: wanted`) or in RAY_ADDRESS must answer, so a wrong one fails in about 2 s."""
    address = wanted if wanted not in (None, "auto", "local") else None
    if address is None and wanted != "local":
        address = os.environ.get("RAY_ADDRESS", "").strip() or None
    if address not in (None, "auto", "local") and not reachable(address):
        raise _unreachable(wanted, source, address)


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


@contextmanager
def lean_node() -> Iterator[dict[str, Any]]:
    """For the `ray.init` that starts an embedded cluster: `LEAN_ENV` as defaults while Ray spawns its processes
    (which keep them; this process gets its own back after), `LEAN_NODE_PARAMS` on the node. Yields init kwargs.

    Why patch: `ray.init` builds its `RayParams` itself and has no argument for the log monitor or the autoscaler
    monitor (`ray start --include-log-monitor=False --no-monitor` has); a subclass set for the call adds them."""
    from ray._private import parameter

    saved = {key: os.environ.get(key) for key in LEAN_ENV}
    for key, value in LEAN_ENV.items():
        os.environ.setdefault(key, value)
    original = parameter.RayParams

    class LeanParams(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for name, value in LEAN_NODE_PARAMS.items():
                setattr(self, name, value)

    parameter.RayParams = LeanParams
    from ray._private import node, utils

    dependency_error, api_server = utils.get_dashboard_dependency_error, node.Node.start_api_server
    utils.get_dashboard_dependency_error = _minimal_dashboard
    node.Node.start_api_server = _no_api_server
    try:
        yield {"_system_config": dict(LEAN_SYSTEM_CONFIG)}
    finally:
        parameter.RayParams = original
        utils.get_dashboard_dependency_error, node.Node.start_api_server = dependency_error, api_server
        _restore(saved)


@contextmanager
def own_sessions() -> Iterator[None]:
    """For the `ray.init` that starts an embedded cluster: its processes (GCS, raylet, agents) each lead their own
    session, so a signal to the driver's process group (`kill -TERM -PGID` from a supervisor or a shell, Ctrl-C from
    the terminal) reaches the driver alone, which then stops the job through them. In the driver's group a SIGTERM
    killed the raylet first, and the driver's teardown then waited on Ray for good, every actor and server running.
    They still die with the driver (Ray's own `PR_SET_PDEATHSIG`), and `ray.shutdown()` stops them by pid."""
    from ray._private import services

    original = services.ConsolePopen

    class OwnSessionPopen(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = original


def _no_api_server(self: Any, **_: Any) -> None:
    """`Node.start_api_server` on a lean node: not started. Without the dashboard Ray's API server loads only its
    usage-stats module (`--modules-to-load=UsageStatsHead`; usage stats are off here), no job or state API, so
    nothing of a job reads it; Ray runs on without it as when it fails to start (`raise_on_failure` is False for
    `include_dashboard=False`): no dashboard URL. ~1.1 CPU-s of its start-up per launch, ~0.004 cores idle."""
    self._webui_url = None


def _minimal_dashboard() -> ImportError:
    """What `ray.init` asks to decide between Ray's full and minimal API server and dashboard agent (`--minimal`:
    what `pip install ray` without `[default]` runs): the minimal ones, as if the dashboard's packages were missing.
    Ray finds out by importing them (aiohttp, grpc, opencensus, pydantic, ...: 0.5-0.7 CPU-s in this driver), and a
    full dashboard agent opens a gRPC and an HTTP server nothing of a lean node's job reads."""
    return ImportError("dualrun: a lean embedded node runs Ray's minimal dashboard agent")


def connect(options: RayOptions, source: str, *, num_cpus: int = 1, allow_start: bool = True) -> Connection | None:
    """Join the cluster `options.address` names, or start an embedded one of `num_cpus` logical CPUs (when
    allowed; else None). One-line errors (naming `source`) on failure."""
    import ray

    address = resolve_address(options.address, source)
    if address is None and not allow_start:
        return None
    if address is not None and not reachable(address):
        if not allow_start:
            return None
        raise _unreachable(options.address, source, address)
    saved: dict[str, str | None] = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE")}  # ray.init may set it
    if address is not None and _needs_token(address):
        _set_auth_mode("token")
    quiet = [logging.getLogger(n) for n in _QUIET_LOGGERS]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if options.runtime_env:
        kwargs["runtime_env"] = dict(options.runtime_env)
    try:
        if address is None and options.include_dashboard:
            # the dashboard asked for: a default node (its views need the metrics, task events and log monitor)
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            with own_sessions():
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, _node_ip_address="127.0.0.1",
                         **kwargs)
        elif address is None:
            with lean_node() as lean, own_sessions():   # this job's alone: only what the job uses runs
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                         **kwargs, **lean)
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


def live_cluster(options: RayOptions, source: str) -> Cluster | None:
    """The running cluster's nodes when one is reachable without starting one (for `dualrun plan`), else None."""
    import ray

    if options.address == "local" or ray.is_initialized():
        return cluster_of(alive_nodes()) if ray.is_initialized() else None
    try:
        conn = connect(options, source, allow_start=False)
    except LaunchError:
        return None
    if conn is None:
        return None
    try:
        return cluster_of(alive_nodes())
    finally:
        conn.close()
