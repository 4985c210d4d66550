"""The virtual cluster itself (tests/support/vcluster.py): each machine its own address, name and /tmp; machines reach
each other and nothing else; a cut link drops traffic silently, a slow one is slow, a link taken down has no carrier; a
killed machine loses every process; and nothing is left behind, not even when the process that made the cluster is
SIGKILLed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import SUPPORT, eventually, loopback_only, pids_matching
from vcluster import GATEWAY, VCluster, address, held

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

# A TCP client on a machine: connect to host:port within `timeout`, send `size` bytes; prints one JSON line
CONNECT = textwrap.dedent("""
    import json, socket, sys, time
    host, port, timeout, size = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    t = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"x" * size)
            s.shutdown(socket.SHUT_WR)
            s.recv(1)
        print(json.dumps({"ok": True, "s": time.monotonic() - t}))
    except OSError as e:
        print(json.dumps({"ok": False, "error": type(e).__name__, "s": time.monotonic() - t}))
""")

# A TCP server on a machine: accept connections on every address, read each to its end, say how much came
LISTEN = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen()
    print("listening", flush=True)
    while True:
        c, _ = s.accept()
        n = 0
        while chunk := c.recv(65536):
            n += len(chunk)
        c.sendall(b"k")
        c.close()
""")


@pytest.fixture(scope="module")
def vc(tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared")
    with VCluster(2, shared=[shared]) as cluster:
        cluster.shared_dir = shared
        yield cluster


@pytest.fixture
def listener(vc):
    """A TCP server on machine 1, port 7000."""
    proc = vc.popen(1, [sys.executable, "-c", LISTEN, "7000"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    yield proc
    proc.kill()
    proc.wait()


def connect(vc, machine: int, host: str, port: int = 7000, timeout: float = 3.0, size: int = 10) -> dict:
    done = vc.run(machine, [sys.executable, "-c", CONNECT, host, str(port), str(timeout), str(size)], timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_each_machine_has_its_own_address_name_and_interfaces(vc):
    for k in (0, 1):
        assert vc.run(k, "hostname").stdout == f"vc{k}\n"
        assert f"eth0    inet {address(k)}/24" in vc.run(k, "ip -o -4 addr show").stdout
        assert vc.run(k, "ip route show default").stdout.split() == ["default", "via", GATEWAY, "dev", "eth0"]
        assert vc.run(k, "ls /sys/class/net").stdout.split() == ["eth0", "lo"]
        assert "UP" in vc.run(k, "ip -o link show lo").stdout.split("<")[1].split(">")[0].split(",")
        # the names of the cluster resolve to their addresses there (as gloo resolves its host name)
        names = vc.run(k, [sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()),"
                                                 " socket.gethostbyname('vc0'), socket.gethostbyname('vc1'))"])
        assert names.stdout.split() == [address(k), address(0), address(1)], names
    assert loopback_only()   # the test's own namespace got nothing


def test_tmp_is_each_machines_own_and_shared_directories_are_shared(vc):
    mine = f"/tmp/vcluster-{os.getpid()}-own"
    assert vc.run(0, f"echo zero > {mine} && echo ok > /dev/shm/x && echo zero > {vc.shared_dir}/note").returncode == 0
    assert vc.run(0, f"cat {mine} /dev/shm/x").stdout == "zero\nok\n"
    assert "No such file" in vc.run(1, f"cat {mine}").stderr and not os.path.exists(mine)
    # its own files and the shared directories' mount points (a checkout or venv under /tmp too: vcluster.image)
    assert vc.run(1, "ls /dev/shm").stdout == "" and sorted(vc.run(1, "ls -A /tmp").stdout.split()) == sorted(
        {".vcluster"} | {d.split("/")[2] for d in vc.shared if d.startswith("/tmp/")})
    assert str(vc.shared_dir) in vc.shared
    assert vc.run(1, f"cat {vc.shared_dir}/note").stdout == "zero\n" == (vc.shared_dir / "note").read_text()


def test_machines_reach_each_other_and_nothing_else(vc, listener):
    assert connect(vc, 0, address(1))["ok"]
    assert connect(vc, 0, "vc1")["ok"]
    assert not connect(vc, 0, "127.0.0.1")["ok"]   # machine 0's loopback is its own: machine 1's server is not there
    assert not connect(vc, 0, "192.0.2.1", timeout=1.0)["ok"]   # TEST-NET-1: the switch drops it
    links = vc.on_switch("ip -o link show")
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == \
        ["br0", "lo", "port0", "port1"], links
    assert vc.on_switch("cat /proc/sys/net/ipv4/ip_forward").strip() == "0"   # the switch routes nothing on
    assert loopback_only()


def test_a_cut_link_drops_traffic_silently_and_restore_brings_it_back(vc, listener):
    assert connect(vc, 0, address(1))["ok"]
    vc.cut(1)
    try:
        got = connect(vc, 0, address(1), timeout=2.0)
        assert got == {"ok": False, "error": "TimeoutError", "s": got["s"]} and got["s"] >= 1.9, got   # no refusal
        assert "state UP" in vc.run(1, "ip -o link show eth0").stdout     # machine 1 sees nothing wrong
    finally:
        vc.restore(1)
    assert connect(vc, 0, address(1))["ok"]


def test_a_link_taken_down_has_no_carrier(vc, listener):
    vc.link_down(1)
    try:
        assert eventually(lambda: "NO-CARRIER" in vc.run(1, "ip -o link show eth0").stdout, 10)
        assert not connect(vc, 0, address(1), timeout=2.0)["ok"]
    finally:
        vc.restore(1)
    assert eventually(lambda: connect(vc, 0, address(1))["ok"], 15)


def test_a_slow_link_is_slow(vc, listener):
    """4 Mbit/s: 2 MB take at least 4 s (a lower bound holds on any loaded machine)."""
    vc.slow(1, "4mbit")
    try:
        got = connect(vc, 0, address(1), timeout=60, size=2_000_000)
        assert got["ok"] and got["s"] >= 3.5, got
    finally:
        vc.restore(1)
    assert "tbf" not in vc.on_switch("tc qdisc show dev port1")


def test_commands_get_their_signals_exit_codes_and_cwd(vc, tmp_path):
    assert vc.run(0, "exit 3").returncode == 3
    assert vc.run(1, "pwd", cwd=vc.shared_dir).stdout.strip() == str(vc.shared_dir)
    trap = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); print('up', flush=True);" \
           " time.sleep(60)"
    proc = vc.popen(1, [sys.executable, "-c", trap], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    proc.terminate()
    assert proc.wait(20) == 7
    marker = f"vcluster-kill-{os.getpid()}"
    proc = vc.popen(1, ["sh", "-c", f"sleep 300 # {marker}"])
    assert eventually(lambda: pids_matching(marker, "sleep"), 10)
    proc.kill()
    assert proc.wait(20) == -signal.SIGKILL and eventually(lambda: not pids_matching(marker, "sleep"), 10)


def test_a_killed_machine_loses_every_process_and_comes_back_fresh():
    marker = f"vcluster-lost-{os.getpid()}"
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    with VCluster(2) as vc:
        proc = vc.popen(1, [*sleep, f"{marker}-a"])
        daemon = " ".join(sleep[:2]) + f" '{sleep[2]}' {marker}-b"
        vc.run(1, f"setsid {daemon} >/dev/null 2>&1 < /dev/null &")   # a daemon of its own, parent gone
        survivor = vc.popen(0, [*sleep, f"{marker}-c"])
        assert eventually(lambda: sleepers(marker) == ["a", "b", "c"], 10), sleepers(marker)
        vc.run(1, "touch /tmp/left-by-the-old-machine")
        vc.kill(1)
        assert proc.wait(20) == -signal.SIGKILL
        assert eventually(lambda: sleepers(marker) == ["c"], 10), sleepers(marker)
        assert survivor.poll() is None
        vc.start(1)
        # a fresh machine: its /tmp holds only the image bound back in (a checkout or venv under /tmp)
        bound = {Path(p).relative_to("/tmp").parts[0] for p in vc.shared if p.startswith("/tmp/")}
        assert set(vc.run(1, "ls /tmp").stdout.split()) == bound
        refused = vc.run(0, [sys.executable, "-c", f"import socket; socket.create_connection(('{address(1)}', 9), 5)"])
        assert "ConnectionRefusedError" in refused.stderr   # machine 1 answers at its address again
        survivor.kill()
        survivor.wait()


def sleepers(marker: str) -> list[str]:
    """The suffixes of the test's sleeping processes still running (their shims left out)."""
    from helpers import cmdline

    cmds = [cmdline(p).split() for p in pids_matching(marker)]
    return sorted(c[-1].rpartition("-")[2] for c in cmds if c and not any("vcluster_ns.py" in w for w in c))


MAKER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    from vcluster import VCluster
    vc = VCluster(2).start()
    vc.popen(1, ["sleep", "300"])
    print(json.dumps(sorted(vc.made)), flush=True)
    time.sleep(300)
""")


@pytest.mark.parametrize("end", ["close", "sigkill"])
def test_nothing_is_left_after_the_cluster_even_when_its_maker_is_sigkilled(end):
    """The namespaces are held by processes only: once the cluster closes, or the process that made it is SIGKILLed
    (its `finally` never runs), no process holds any of them, and no bridge or veth ever was in this namespace."""
    if end == "close":
        with VCluster(2) as vc:
            made = set(vc.made)
            assert held(made) == made
    else:
        maker = subprocess.Popen([sys.executable, "-c", MAKER, str(SUPPORT)], stdout=subprocess.PIPE,
                                 text=True)
        made = set(json.loads(maker.stdout.readline()))
        assert held(made) == made and len(made) == 9   # the switch's network, 4 of each machine
        maker.kill()
        maker.wait()
    assert eventually(lambda: not held(made), 20), held(made)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"], links
    assert loopback_only()
    assert not subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
