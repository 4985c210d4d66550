"""Several torchrun machines: an optional serving machine (plan/optional.py) joins the running job and leaves it.

Why a protocol of its own: machine 0 starts the job without the optional machines, so nothing in the start-up
exchange (machine_servers.py) waits for them; they come and go while the ranks train, through three keys of
machine 0's store (contract/job_store.py):
- machine K, once its replicas answered, puts their addresses under `JOIN_KEY` (`offer`); machine 0's `MachineFleet`
  takes each in as a grown spare is taken in (fleet_resize.py's `take_in`: held until the trainer's weights reach it
  where it takes them) and health-checks it from then on;
- machine K, stopped (SIGTERM), puts why under `LEAVING_KEY` and waits (`leave`); machine 0 takes its replicas out
  of rotation, lets their requests in flight end (drained: `FleetResize.depart`), then sets `LET_GO_KEY`; machine K
  stops them and exits 0. Below `min_replicas` that ends the job (or restarts it), naming the replica and machine;
- a machine lost or cut off says nothing: machine 0's health checks miss its replicas, and they leave as a dead
  replica with no restart left does (`Supervision.leaves`) while `min_replicas` remain, else the job ends naming it.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from dualrun.contract import job_store
from dualrun.servers.process import ServerError
from dualrun.servers.server_death import ServerDeath
from dualrun.servers.supervision import joined_summary, machine_joined_line

LOOK_S = 0.5            # how often machine 0 looks for machines that come or go
LET_GO_WAIT_S = 60.0    # machine K, leaving: how long it waits for machine 0 to drain its replicas (DRAIN_S + slack)


class MachineFleet:
    """Machine 0's side: `optional` (machine -> its replicas) taken in as they come, let go as they leave, for the
    server set `machines` (machine_servers.Machines)."""

    def __init__(self, machines: Any, optional: dict[int, tuple[int, ...]]) -> None:
        self.machines, self.optional = machines, optional
        self.plan = machines.plan
        self.supervisor = machines.servers.supervisor
        self.offered: dict[int, str] = {}   # machine -> the `JOIN_KEY` value taken in (a fresh one is a new coming)
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._run, name="dualrun-machine-fleet", daemon=True).start()

    def present(self) -> list[int]:
        """The optional machines whose replicas serve now (they wait for the job's result)."""
        with self._lock:
            return [k for k in self.offered if any(not self.supervisor.parked(i) for i in self.optional[k])]

    def _run(self) -> None:
        servers, store = self.machines.servers, None
        while not servers.stopping and servers.failure is None:
            time.sleep(LOOK_S)
            if not servers.watching:
                continue   # the job's ranks are not running (yet, or any more): nobody to serve
            try:
                store = store or job_store.connect(self.machines.host, self.machines.port, 5.0)
                for k in self.optional:
                    self._look(store, k)
            except Exception:  # noqa: BLE001 - the store went away: the job is ending; a later look says
                store = None

    def _look(self, store: Any, k: int) -> None:
        if store.check([job_store.leaving_key(k)]):
            why = store.get(job_store.leaving_key(k)).decode()
            self._let_go(k, why)
            for key in (job_store.join_key(k), job_store.leaving_key(k)):
                store.delete_key(key)
            store.set(job_store.let_go_key(k), "1")
            return
        if not store.check([job_store.join_key(k)]):
            return
        value = store.get(job_store.join_key(k)).decode()
        with self._lock:
            if self.offered.get(k) == value:
                return
            self.offered[k] = value
        threading.Thread(target=self._take_in, args=(k, json.loads(value)), name="dualrun-machine-join",
                         daemon=True).start()

    def _take_in(self, k: int, addresses: dict[str, str]) -> None:
        """Machine K's replicas, each taken in by its router; one that does not get in is named and parked again
        (the job goes on without it)."""
        began = time.monotonic()
        for key, address in addresses.items():
            index = int(key)
            label = self.plan.servers[index].label
            try:
                brought = self.supervisor.take_in(index, address)
            except Exception as e:  # noqa: BLE001 - any failure to join: named, the job goes on
                line = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"dualrun: {label} on machine {k} did not join: {line}; the job goes on without it",
                      file=sys.stderr, flush=True)
                continue
            if brought is None:
                continue
            self.machines.watched[index] = address   # health-checked from now on (machine_servers.py)
            unit = self.plan.servers[index].unit
            running = len([i for i in self.supervisor.table.running(unit)])
            seconds = time.monotonic() - began
            print(machine_joined_line(label, address, k, brought.step, seconds, running, self.plan.fleets[unit].high,
                                      brought.last), file=sys.stderr, flush=True)
            self.supervisor.summarise_join(index, brought, lambda step, label=label, seconds=seconds: joined_summary(
                label, step, seconds, f"after machine {k} offered it"))

    def _let_go(self, k: int, why: str) -> None:
        """Machine K leaves: its running replicas out of rotation and drained; below `min_replicas` the job's end."""
        running = [i for i in self.optional[k] if not self.supervisor.parked(i)]
        for index in running:
            self.machines.watched.pop(index, None)   # its end is no death
        by_unit: dict[str, list[int]] = {}
        for index in running:
            by_unit.setdefault(self.plan.servers[index].unit, []).append(index)
        for unit, indices in by_unit.items():
            left = self.supervisor.depart(indices, f"machine {k} stopped by {why}; drained")
            low = self.plan.fleets[unit].low
            if left < low:
                label = self.plan.servers[indices[0]].label
                self.machines.servers.fatal(ServerDeath.of(indices[0], ServerError(
                    label, f"left with machine {k} (stopped by {why}): {left} of min_replicas {low} replicas of "
                    f"{unit} remain")))
        with self._lock:
            self.offered.pop(k, None)


def offer(machines: Any) -> None:
    """Machine K (optional), its replicas answered: their addresses for machine 0 to take in (a store gone is named
    as the exchange names it)."""
    machine = machines.machine
    try:
        machines._connect().set(job_store.join_key(machine),
                                json.dumps({str(i): a for i, a in sorted(machines.own().items())}))
    except Exception as e:  # noqa: BLE001 - the store is gone: name it while the job runs
        machines._store_lost(e)
        return
    print(f"dualrun: machine {machine} is optional: its replicas join the running job (machine 0 takes them in; "
          "SIGTERM drains them and ends this machine's part)", file=sys.stderr, flush=True)


def leave(host: str, port: int, machine: int, why: str, wait_s: float = LET_GO_WAIT_S) -> str:
    """Machine K (optional), stopped: tell machine 0 and wait until it drained this machine's replicas (or the job
    ended, or the store is gone, or `wait_s` passed); the line saying how it went."""
    deadline = time.monotonic() + wait_s
    try:
        store = job_store.connect(host, port, 5.0)
        store.set(job_store.leaving_key(machine), why)
        while time.monotonic() < deadline:
            if store.check([job_store.let_go_key(machine)]):
                store.delete_key(job_store.let_go_key(machine))
                return (f"dualrun: machine {machine} left the job ({why}): machine 0 took its replicas out of "
                        "rotation and drained them; stopping them")
            if store.check([job_store.RESULT_KEY]):
                break
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - machine 0's store is gone: the job ended, nobody routes to these replicas
        pass
    return f"dualrun: machine {machine} left the job ({why}); stopping its replicas"
