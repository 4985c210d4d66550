"""`dualrun check` on several torchrun machines: run it on every machine as `dualrun launch` runs there (the same
flags, each machine its own `--machine_rank`), and the machines meet where torchrun's rendezvous will.

Why: each machine alone looks fine; what fails is between them, and only after every model has loaded: the
rendezvous address that is not machine 0's, a link that is down, an interface variable one machine cannot honour,
an address a machine advertises that the others cannot reach back (gloo's, from its host name; its servers', from
its route to machine 0; trainer rank 0's weight-sync one, from vLLM's `get_ip()`).

How: machine 0 listens on `main_process_port` (on every address, as torchrun's store will: so the port must be
free there, and `main_process_ip` must be one of its own addresses). Machine K connects to
`main_process_ip:main_process_port` (retrying until `--wait_s`, since machines are started by hand) and says what
it has: its facts, its own problems, and the addresses it advertises, each with a port it listens on for the probe.
Machine 0 connects back to each such address (a probe answers with the machine's number and a token, so reaching
some other listener does not pass), then sends every machine its own advertised addresses to probe the same way
and, when the job has a weight-sync group across the machines, the members each machine runs
(`dualrun.weightsync.sync_group`). Machine 0 gathers every line; every machine prints the same list (exit 1) or table (0).
Messages are JSON lines over the one TCP connection.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable

from dualrun.plan.meeting import rendezvous_of
from dualrun.config.model import JobConfig
from dualrun.check.node_facts import NodeReport
from dualrun.light.interfaces import (Interface, gloo_address, gloo_ifname, ifname_problems, interfaces, listing,
                                      loopback_line, loopback_named, owner, reached_at, route)
from dualrun.plan.processes import Plan
from dualrun.weightsync.sync_group import NET_VARS, SyncGroup, advertised_address, node_host_env, port_host
from dualrun.weightsync.rehearsal import limit_s, master_endpoint, member_spec, run_specs, unanswered, verdict

GREETING = "dualrun-check/1"
PROBE_S = 5.0          # one probe of an advertised address
WAIT_S = 120.0         # how long machines wait for each other (`dualrun check --wait_s`)


def rendezvous_port(cfg: JobConfig) -> int:
    return cfg.main_process_port or 29500


def name_of(machine: int, host: str) -> str:
    return f"machine {machine} {host}"


def with_gloo_default(env: dict[str, str], main: str) -> dict[str, str]:
    """`env` as `dualrun launch` completes it on this machine: GLOO_SOCKET_IFNAME, where it names no interface, is
    the interface holding the address the other machines reach this one at (dualrun.backends.torchrun.agent_launcher,
    `with_gloo`)."""
    found = gloo_ifname(env, reached_at(main), interfaces())
    return {**env, "GLOO_SOCKET_IFNAME": found.name} if found is not None else env


def process_envs(cfg: JobConfig, plan: Plan | None, machine: int) -> list[dict[str, str]]:
    """The interface variables of each distinct process environment the plan puts on `machine` (the launching
    shell's forwarded ones, then the config's and the role's, then dualrun's GLOO_SOCKET_IFNAME where none names an
    interface, as the job's processes get them)."""
    shell = {k: v for k, v in os.environ.items() if k in NET_VARS}
    main = cfg.main_process_ip or "127.0.0.1"
    envs = [with_gloo_default({**shell, **{k: v for k, v in p.env.items() if k in NET_VARS}}, main)
            for p in (plan.processes if plan else ()) if p.node == machine]
    return [dict(e) for e in dict.fromkeys(tuple(sorted(e.items())) for e in envs or [with_gloo_default(shell, main)])]


def advertised(cfg: JobConfig, plan: Plan | None, machine: int, ifaces: dict[str, Interface],
               group: SyncGroup | None) -> list[dict[str, Any]]:
    """What this machine advertises to the others, each as {what, address, how}: gloo's address (CPU jobs), its
    servers' address (machine K with servers), trainer rank 0's weight-sync address (machine 0, a group that
    spans machines)."""
    out: list[dict[str, Any]] = []
    if cfg.use_cpu:
        for env in process_envs(cfg, plan, machine):
            if loopback_refused(cfg, env, ifaces):   # named as this machine's own problem (local_problems)
                continue
            address, how = gloo_address(env, ifaces)
            if address:
                out.append({"what": "gloo's address", "address": address, "how": how})
    main = cfg.main_process_ip or "127.0.0.1"
    if machine != 0 and plan and any(p.node == machine for p in plan.servers):
        address, _ = route(main)
        if address:
            out.append({"what": "its servers' address", "address": address,
                        "how": f"its address on the route to {main}"})
    if machine == 0 and group is not None and any(m.node != 0 for m in group.members):
        out.append({"what": "trainer rank 0's weight-sync address", "how": "vLLM's get_ip(): VLLM_HOST_IP, which "
                    "dualrun sets to machine 0's address on the route to main_process_ip unless the env sets it",
                    "address": advertised_address({**os.environ, **master_env(cfg, group)})})
    for item in out:
        iface = owner(item["address"], ifaces)
        item["interface"] = iface.name if iface else None
    return [dict(a) for a in {json.dumps(a, sort_keys=True): a for a in out}.values()]


class ProbeListener:
    """Answers every connection with this machine's number and a token, so a probe knows whom it reached."""

    def __init__(self, machine: int) -> None:
        self.token = secrets.token_hex(8)
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.line = f"{GREETING} machine {machine} {self.token}\n".encode()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(self.line)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def probe(address: str, port: int, expected: str) -> str | None:
    """None when `address:port` answers with `expected` (a machine's greeting line), else why not."""
    try:
        with socket.create_connection((address, port), timeout=PROBE_S) as s:
            s.settimeout(PROBE_S)
            got = s.makefile("rb").readline().decode(errors="replace").strip()
    except socket.timeout:
        return f"no answer within {PROBE_S:g} s"
    except OSError as e:
        return e.strerror or type(e).__name__
    return None if got == expected.strip() else "another process answered there"


def unreachable_line(name: str, item: dict[str, Any], error: str, prober: str, hint: str) -> str:
    on = f" on {item['interface']}" if item.get("interface") else ""
    return (f"{name}: {item['what']} {item['address']} ({item['how']}){on} is not reachable from {prober} "
            f"(a probe of {item['address']}:{item['port']}: {error}){hint}")


def hint_for(item: dict[str, Any], route: str | None) -> str:
    """How to make the advertised address right, for the variable that chose it; `route`: the machine's interface
    and address on its route to machine 0 ('eth0 10.0.0.2')."""
    where = route or "the interface the other machines reach"
    if item["what"] == "gloo's address":
        return f"; set GLOO_SOCKET_IFNAME={route.split()[0] if route else '<that interface>'} ({where}) there"
    if item["what"].startswith("trainer rank 0"):
        return f"; set VLLM_HOST_IP in roles.train.env to machine 0's address the others reach ({where})"
    return ""


def probe_all(items: list[dict[str, Any]], name: str, prober: str, route: str | None) -> list[str]:
    """Probe each advertised item of machine `name`; one line per one that does not answer as that machine."""
    out = []
    for item in items:
        error = probe(item["address"], item["port"], item["expected"])
        if error:
            out.append(unreachable_line(name, item, error, prober, hint_for(item, route)))
    return out


# -- the wire -------------------------------------------------------------------------------------------------------
class Wire:
    """JSON lines over one connection, each read bounded by a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.file = sock, sock.makefile("rb")

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall((json.dumps(message) + "\n").encode())

    def recv(self, timeout_s: float) -> dict[str, Any]:
        self.sock.settimeout(max(0.1, timeout_s))
        line = self.file.readline()
        if not line:
            raise ConnectionError("the other machine closed the connection")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def view(machine: int, report: NodeReport, problems: list[str], items: list[dict[str, Any]],
         ifaces: dict[str, Interface], route_to: str | None) -> dict[str, Any]:
    """What a machine tells the others: its checks, its advertised addresses, its interfaces and `route_to`, its
    interface and address on the route to machine 0."""
    return {"machine": machine, "name": report.name, "gpus": report.gpus, "planned": report.planned_gpus,
            "facts": report.facts, "problems": problems, "advertised": items, "interfaces": listing(ifaces),
            "route": route_to, "ports": {str(k): v for k, v in report.ports.items()}}


def report_of(v: dict[str, Any]) -> NodeReport:
    return NodeReport(v["name"], v["gpus"], v["planned"], v["facts"], ports={int(k): w for k, w in v["ports"].items()})


def loopback_refused(cfg: JobConfig, env: dict[str, str], ifaces: dict[str, Interface]) -> list[tuple[str, str, str]]:
    """The interface variables of `env` naming loopback that `dualrun launch` refuses on this machine: several
    machines whose machine 0 this one reaches off loopback (agent_launcher.py, `refuse_loopback`)."""
    here = reached_at(cfg.main_process_ip or "127.0.0.1") if cfg.num_machines > 1 else None
    return loopback_named(env, ifaces) if here and not here.startswith("127.") else []


def local_problems(cfg: JobConfig, plan: Plan | None, machine: int, name: str,
                   ifaces: dict[str, Interface]) -> list[str]:
    """This machine's own: an interface variable it cannot honour, `main_process_ip` that is its own (machine K)."""
    main, port = cfg.main_process_ip or "127.0.0.1", rendezvous_port(cfg)
    out = []
    instead = gloo_ifname({}, reached_at(main), ifaces)
    for env in process_envs(cfg, plan, machine):
        for phrase in ifname_problems(env, ifaces):
            out.append(f"{name}: {phrase} (it has {listing(ifaces)}); the job's processes meet at {main}:{port}")
        machines = f"num_machines {cfg.num_machines}"
        out += [f"{name}: {loopback_line(*named, ifaces, machines, instead.name if instead else None)}"
                for named in loopback_refused(cfg, env, ifaces)]
    mine = owner(main, ifaces)
    if machine != 0 and mine is not None:
        out.append(f"{name}: main_process_ip {main} is this machine's own address ({mine.name}); it must be machine "
                   f"0's, where torchrun's rendezvous listens on port {port}")
    return out


def sync_here(specs: list[list[Any]], main: str) -> list[list[Any]]:
    """Run this machine's members of the weight-sync group: [[member index, spec]] -> [[member index, result]]; each
    with GLOO_SOCKET_IFNAME as the job gives it on this machine (`with_gloo_default`; `main`: machine 0's address)."""
    results = run_specs([{**spec, "env": with_gloo_default(dict(spec["env"]), main)} for _, spec in specs])
    return [[i, r] for (i, _), r in zip(specs, results)]


def sync_verdict(group: SyncGroup, results: list[dict[str, Any] | None], names: dict[int, str], address: str,
                 port: int, model_bytes: int | None = None) -> tuple[list[str], list[str]]:
    return verdict(group, unanswered(results, f"no answer within {limit_s():g} s"), names, address, port,
                   model_bytes)


def master_env(cfg: JobConfig, group: SyncGroup) -> dict[str, str]:
    """Trainer rank 0's interface variables as the launcher gives them: on several machines, VLLM_HOST_IP = the
    address the others reach machine 0 at, unless its env sets one (agent_launcher.py)."""
    env = dict(group.master.env)
    if cfg.num_machines > 1:
        env.update(node_host_env(env, reached_at(cfg.main_process_ip or "127.0.0.1")))
    return env


def sync_plan(cfg: JobConfig, group: SyncGroup) -> tuple[str, int, dict[int, list[list[Any]]]]:
    """Machine 0: the master's address and port, picked as the job picks them, and each machine's member specs."""
    address, port = master_endpoint(port_host(rendezvous_of(cfg)), master_env(cfg, group))
    by_machine: dict[int, list[list[Any]]] = {}
    for i, m in enumerate(group.members):
        by_machine.setdefault(m.node, []).append([i, member_spec(group, m, address, port)])
    return address, port, by_machine


def deadline_after(seconds: float) -> Callable[[], float]:
    end = time.monotonic() + seconds
    return lambda: end - time.monotonic()
