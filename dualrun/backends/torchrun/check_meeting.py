"""The meeting of `dualrun check` on several torchrun machines (dualrun/backends/torchrun/machine_check.py says why and how, and holds
its parts): `meet`, then machine 0 hosts it at `main_process_port` and every other machine joins it at
`main_process_ip`."""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from dualrun.backends.torchrun.machine_check import (GREETING, WAIT_S, ProbeListener, Wire, advertised, deadline_after, local_problems,
                                    name_of, probe_all, report_of, rendezvous_port, sync_here, sync_plan, sync_verdict,
                                    view)
from dualrun.config.model import JobConfig
from dualrun.light.interfaces import Interface, interfaces, listing, owner, route
from dualrun.check.node_facts import NodeReport, Outcome, can_bind, version_differences
from dualrun.plan.processes import Plan
from dualrun.weightsync.sync_group import SyncGroup, sync_group
from dualrun.weightsync.rehearsal import limit_s

_REPLY_S = 30.0   # a machine's answer to one request (its probes: a few seconds each)


def renamed(problem: str, old: tuple[str, ...], name: str) -> str:
    """A problem of this machine's own checks, under the machine's name ('machine 1 vc1: ...')."""
    for prefix in old:
        if problem.startswith(prefix + ":"):
            return name + problem[len(prefix):]
    return f"{name}: {problem}"


def meet(cfg: JobConfig, plan: Plan | None, here: NodeReport, problems: list[str],
         wait_s: float = WAIT_S) -> Outcome:
    """This machine's side of the meeting (dualrun/backends/torchrun/machine_check.py); `here` and `problems` are its own checks."""
    ifaces = interfaces()
    machine = cfg.machine_rank
    before, here.name = here.name, name_of(machine, socket.gethostname())
    problems = [renamed(p, (before, "this machine"), here.name) for p in problems]
    problems += local_problems(cfg, plan, machine, here.name, ifaces)
    group = sync_group(cfg, plan) if plan else None
    items = advertised(cfg, plan, machine, ifaces, group)
    listener = ProbeListener(machine)
    for item in items:
        item.update(port=listener.port, expected=listener.line.decode())
    address, _ = route(cfg.main_process_ip or "127.0.0.1")
    iface = owner(address, ifaces) if address else None
    mine = view(machine, here, problems, items, ifaces, f"{iface.name} {address}" if iface else None)
    try:
        if machine == 0:
            return host(cfg, group, mine, here, ifaces, wait_s)
        return guest(cfg, mine, here, ifaces, wait_s)
    finally:
        listener.close()


def _final(wires: dict[int, Wire], problems: list[str], views: list[dict[str, Any]], notes: list[str]) -> None:
    for wire in wires.values():
        try:
            wire.send({"final": {"problems": problems, "views": views, "notes": notes}})
        except OSError:
            pass
        wire.close()


def host(cfg: JobConfig, group: SyncGroup | None, mine: dict[str, Any], here: NodeReport,
         ifaces: dict[str, Interface], wait_s: float) -> Outcome:
    """Machine 0: listen where torchrun's store will, wait for every other machine, probe what each advertises,
    have each probe machine 0's, form the weight-sync group across them, and send everyone the verdict."""
    main, port, name = cfg.main_process_ip or "127.0.0.1", rendezvous_port(cfg), here.name
    problems = list(mine["problems"])
    why = can_bind(main, 0)
    if why:
        return problems + [f"{name}: main_process_ip {main} is not an address of this machine ({why}; it has "
                           f"{listing(ifaces)}); the other machines meet torchrun's rendezvous there, port {port}, so "
                           "it must be machine 0's"], [here], []
    on = owner(socket.gethostbyname(main), ifaces)
    try:
        server = socket.create_server(("0.0.0.0", port))   # as torchrun's store binds it: every address
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        return problems + [f"{name}: port {port} is taken on this machine ({why}): torchrun's rendezvous "
                           f"binds it (main_process_port) at main_process_ip {main}"
                           f"{' (' + on.name + ')' if on else ''}; free it or choose another main_process_port"], \
            [here], []
    here.ports = {port: "main_process_port"}
    mine["ports"] = {str(port): "main_process_port"}
    wires: dict[int, Wire] = {}
    views: dict[int, dict[str, Any]] = {0: mine}
    left = deadline_after(wait_s)
    with server:
        server.settimeout(0.5)
        while len(wires) < cfg.num_machines - 1 and left() > 0:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            wire = Wire(conn)
            try:
                wire.send({"greeting": GREETING, "name": name})
                v = wire.recv(_REPLY_S)
                k = int(v["machine"])
            except (OSError, ValueError, KeyError, TypeError):
                wire.close()
                continue
            if not 0 < k < cfg.num_machines or k in wires:
                _final({k: wire}, [f"machine {k}: a second `dualrun check` with --machine_rank {k}, or a rank "
                                   f"outside 1..{cfg.num_machines - 1}"], [], [])
                continue
            wires[k], views[k] = wire, v
    for k in range(1, cfg.num_machines):
        if k not in wires:
            where = f"{on.name} {on.address}" if on else main
            problems.append(f"machine {k}: did not reach machine 0 at {main}:{port} within {wait_s:g} s (machine 0 "
                            f"listens on {where}; run `dualrun check` with the same flags and --machine_rank {k} "
                            "there, and see that machine's own line)")
    for k, v in sorted(views.items()):
        if k:
            problems += v["problems"]
            problems += [f"{v['name']}: {p}" for p in version_differences(mine["facts"], v["facts"], "machine 0")]
    unreachable = [line for k, v in sorted(views.items()) if k
                   for line in probe_all(v["advertised"], v["name"], name, v["route"])]
    for k, wire in wires.items():
        try:
            wire.send({"probe": mine["advertised"], "name": name, "route": mine["route"]})
            unreachable += wire.recv(_REPLY_S)["probed"]
        except (OSError, ValueError, KeyError):
            unreachable.append(f"{views[k]['name']}: stopped answering machine 0 during the check")
    problems += unreachable
    notes: list[str] = []
    if group is not None and not unreachable and len(wires) == cfg.num_machines - 1 and \
            mine["facts"]["versions"].get("torch"):
        found, said = _sync(cfg, group, wires, views)
        problems += found
        notes += said
    ordered = [views[k] for k in sorted(views)]
    _final(wires, problems, ordered, notes)
    return problems, [here] + [report_of(v) for v in ordered[1:]], notes


def _sync(cfg: JobConfig, group: SyncGroup, wires: dict[int, Wire],
          views: dict[int, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The weight-sync group across the machines: every machine runs its members at once; machine 0 judges."""
    address, port, by_machine = sync_plan(cfg, group)
    results: list[dict[str, Any] | None] = [None] * len(group.members)
    for k, wire in wires.items():
        wire.send({"sync": by_machine.get(k, [])})
    own: list[list[Any]] = []
    main = cfg.main_process_ip or "127.0.0.1"
    runner = threading.Thread(target=lambda: own.extend(sync_here(by_machine.get(0, []), main)), daemon=True)
    runner.start()
    left = deadline_after(limit_s() + _REPLY_S)
    for k, wire in wires.items():
        try:
            for i, r in wire.recv(left())["synced"]:
                results[i] = r
        except (OSError, ValueError, KeyError):
            pass
    runner.join(max(0.0, left()))
    for i, r in own:
        results[i] = r
    names = {k: v["name"] for k, v in views.items()}
    return sync_verdict(group, results, names, address, port)


def guest(cfg: JobConfig, mine: dict[str, Any], here: NodeReport, ifaces: dict[str, Interface],
          wait_s: float) -> Outcome:
    """Machine K: reach machine 0 (retrying until `wait_s`: it may start later), say what it has, answer machine
    0's requests, and return the verdict machine 0 sends."""
    main, port, name = cfg.main_process_ip or "127.0.0.1", rendezvous_port(cfg), here.name
    problems = list(mine["problems"])
    if any(f"main_process_ip {main} is this machine's own address" in p for p in problems):
        return problems, [here], []
    source, why = route(main)
    if why:
        return problems + [f"{name}: no route to {main} from this machine ({why}; it has {listing(ifaces)}); "
                           f"torchrun's rendezvous is there, port {port}"], [here], []
    on = owner(source, ifaces) if source else None
    left = deadline_after(wait_s)
    wire, last = None, "no attempt"
    while wire is None and left() > 0:
        try:
            sock = socket.create_connection((main, port), timeout=min(5.0, max(0.1, left())))
        except OSError as e:
            last = "no answer" if isinstance(e, socket.timeout) else (e.strerror or type(e).__name__)
            time.sleep(min(0.5, max(0.0, left())))
            continue
        wire = Wire(sock)
        try:
            greeting = wire.recv(10.0)
        except (OSError, ValueError):
            greeting = {}
        if greeting.get("greeting") != GREETING:
            wire.close()
            return problems + [f"{name}: {main}:{port} answers, but not as `dualrun check` on machine 0 (is the "
                               "port taken there? run the check on machine 0 too)"], [here], []
    if wire is None:
        state = f"{on}" if on else source
        return problems + [f"{name}: cannot reach machine 0 at {main}:{port} from {state} within {wait_s:g} s "
                           f"({last}); torchrun's rendezvous will be there"], [here], []
    here.facts["reach"] = {f"{main}:{port}": None}
    mine["facts"] = here.facts
    try:
        wire.send(mine)
        left = deadline_after(wait_s + limit_s() + 2 * _REPLY_S)
        while True:
            msg = wire.recv(left())
            if "probe" in msg:
                wire.send({"probed": probe_all(msg["probe"], msg["name"], name, msg["route"])})
            elif "sync" in msg:
                wire.send({"synced": sync_here(msg["sync"], cfg.main_process_ip or "127.0.0.1")})
            elif "final" in msg:
                final = msg["final"]
                views = final["views"] or [mine]
                return final["problems"], [report_of(v) for v in views], final["notes"]
    except (OSError, ValueError, KeyError) as e:
        return problems + [f"{name}: machine 0 at {main}:{port} stopped answering during the check "
                           f"({type(e).__name__})"], [here], []
    finally:
        wire.close()
