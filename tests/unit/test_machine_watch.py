"""Machine 0's side of the machine watch (dualrun/backends/torchrun/machine_watch.py) against a real TCPStore on 127.0.0.1, the
other machine's beats written by hand: silence after a beat is a loss named with the machine's address, a machine
that never beat or that left is none, and `settle` names one that stops beating once the ranks failed. The network
side (a cut link, a lost machine) is tests/cluster/test_cluster_faults.py's."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest

from dualrun.contract import job_store
from dualrun.backends.torchrun import machine_watch
from dualrun.backends.torchrun.machine_watch import MachineWatch
from dualrun.light.ports import free_port


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server, port


def watch(port: int, lost: list[str], machines: int = 2, timeout_s: float = 1.5) -> MachineWatch:
    w = MachineWatch("127.0.0.1", port, 0, machines, timeout_s, lost.append)
    w.start()
    return w


def until(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_machine_that_stops_beating_is_named_after_the_timeout(store):
    server, port = store
    lost: list[str] = []
    server.set(job_store.machine_key(1), "10.0.0.2")
    w = watch(port, lost, machines=3)
    started = time.monotonic()
    server.add(job_store.beat_key(1), 1)   # machine 1 beats once; machine 2 never does (its rendezvous' concern)
    assert until(lambda: lost, 15)
    assert lost == ["machine 1 (10.0.0.2) sent no sign of life for 1.5 s (torchrun.machine_timeout_s): it was lost "
                    "or its link is cut; ending the job"]
    assert time.monotonic() - started >= 1.5 and w.failure == lost[0]


@pytest.mark.slow
def test_beats_and_leaving_are_no_loss(store):
    server, port = store
    lost: list[str] = []
    w = watch(port, lost)
    for _ in range(12):
        server.add(job_store.beat_key(1), 1)
        time.sleep(0.25)
    server.set(job_store.left_key(1), "1")   # its agent returned: silence from now on is its end
    time.sleep(2.5)
    w.stop()
    assert lost == [] and w.failure is None


def test_settle_names_a_machine_that_beats_no_more_once_the_ranks_failed(store, monkeypatch):
    monkeypatch.setattr(machine_watch, "SETTLE_S", 1.5)
    server, port = store
    server.set(job_store.machine_key(1), "10.0.0.2")
    lost: list[str] = []
    w = MachineWatch("127.0.0.1", port, 0, 2, 60.0, lost.append)
    w.start()
    server.add(job_store.beat_key(1), 1)
    assert until(lambda: 1 in w.addresses)
    line = w.settle()
    assert line is not None and line.startswith("machine 1 (10.0.0.2) sent no sign of life for ")
    assert line.endswith(" s after this machine's ranks failed: it was lost or its link is cut") and lost == []


def test_settle_takes_a_last_beat_written_since_the_watchs_look_for_no_sign_of_life(store, monkeypatch):
    """Machine 1 beat once more between the watch's last look and its loss: that beat is old news, not a new one;
    and the settle ends after SETTLE_S, not a look interval later."""
    monkeypatch.setattr(machine_watch, "SETTLE_S", 1.5)
    monkeypatch.setattr(machine_watch, "BEAT_S", 60.0)   # the watch's own thread does not look meanwhile
    server, port = store
    server.set(job_store.machine_key(1), "10.0.0.2")
    server.add(job_store.beat_key(1), 1)
    w = MachineWatch("127.0.0.1", port, 0, 2, 600.0, [].append)
    w.start()
    assert until(lambda: w._store is not None)
    w.look()   # the watch's last look
    assert 1 in w.addresses
    server.add(job_store.beat_key(1), 1)   # its last beat, after that look; then it is lost
    started = time.monotonic()
    line = w.settle()
    assert line is not None and line.startswith("machine 1 (10.0.0.2) sent no sign of life for "), line
    assert time.monotonic() - started < 1.5 + 10   # SETTLE_S bounds it, not the look interval (BEAT_S / 2: 30 s)


def test_a_machine_that_never_joins_is_named_after_the_rendezvous_timeout(store):
    server, port = store
    lost: list[str] = []
    w = MachineWatch("127.0.0.1", port, 0, 3, 60.0, lost.append, join_timeout_s=2.0)
    started = time.monotonic()
    w.start()
    server.set(job_store.machine_key(1), "10.0.0.2")   # machine 1 came; machine 2 never does
    assert until(lambda: lost, 15)
    assert lost == [f"machine 2 did not join within 2 s (torchrun.rendezvous_timeout_s): not started, or unable to "
                    f"reach machine 0's store at 127.0.0.1:{port} (main_process_ip, main_process_port); ending the "
                    "job"]
    assert 2.0 <= time.monotonic() - started < 2.0 + 5 and w.unjoined() == [2]


@pytest.mark.slow
def test_machines_that_join_within_the_rendezvous_timeout_are_no_loss(store):
    server, port = store
    lost: list[str] = []
    w = MachineWatch("127.0.0.1", port, 0, 3, 60.0, lost.append, join_timeout_s=2.0)
    w.start()
    server.set(job_store.machine_key(1), "10.0.0.2")
    server.set(job_store.left_key(2), "1")   # came, trained and left before machine 0 looked
    time.sleep(3.5)
    w.stop()
    assert lost == [] and w.unjoined() == []


def test_machine_k_names_machine_0_when_its_store_never_listens():
    port = free_port()   # nothing listens there
    lost: list[str] = []
    w = MachineWatch("127.0.0.1", port, 1, 2, 60.0, lost.append, join_timeout_s=2.0)
    started = time.monotonic()
    w.start()
    assert until(lambda: lost, 15)
    assert lost == [f"machine 0 (127.0.0.1) did not answer within 2 s (torchrun.rendezvous_timeout_s; its store at "
                    f"127.0.0.1:{port}, main_process_ip and main_process_port): it is not started, has ended, or this "
                    "machine cannot reach it; ending this machine's part of the job"]
    assert 2.0 <= time.monotonic() - started < 2.0 + 5 and not w.reached


def test_once_machine_0s_workers_started_every_machine_came(store):
    """A machine that writes nothing (its launch runs no watch) but joined torchrun's rendezvous is no loss."""
    _, port = store
    lost: list[str] = []
    w = MachineWatch("127.0.0.1", port, 0, 2, 60.0, lost.append, join_timeout_s=1.0, workers_started=lambda: True)
    w.start()
    time.sleep(2.5)
    w.stop()
    assert lost == [] and w.unjoined() == []


def test_an_optional_machine_is_neither_awaited_nor_lost_when_it_goes_silent(store):
    """An optional serving machine (plan/optional.py) may never come, and its loss is its replicas' (machine_fleet.py):
    machine 2 never comes, machine 1 beats once and goes silent, and the watch says nothing of either."""
    server, port = store
    lost: list[str] = []
    w = MachineWatch("127.0.0.1", port, 0, 3, 1.0, lost.append, join_timeout_s=1.0, optional=(1, 2))
    w.start()
    server.set(job_store.machine_key(1), "10.0.0.2")
    server.add(job_store.beat_key(1), 1)
    time.sleep(3.0)
    w.stop()
    assert lost == [] and w.unjoined() == [] and w.awaited() == []
