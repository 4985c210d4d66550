"""A `main_process_port` another process holds is refused before anything starts, on both backends: exit 2 and one
line naming the key (`--main_process_port` when the flag gave it) and the port, no traceback, the script never run.
Real processes: the test holds the port with a listening socket, as any other program would.

The check itself (dualrun.light.ports.port_taken) binds as the rendezvous store does (SO_REUSEADDR, then listen),
so a port another process listens on is taken and one only lingering in TIME_WAIT after a previous job is not."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dualrun.config import build_config
from dualrun.contract.errors import ConfigError
from dualrun.light.ports import EVERY_ADDRESS, port_taken
from helpers import eventually
from ray_helpers import ray_env

# it marks that it ran, then forms the group whose store rank 0 binds at main_process_port
RAY_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [DIWEF] \d+ \d+\] ")
SCRIPT = ("import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n"
          "import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.destroy_process_group()\n")


def _held(host: str = "127.0.0.1") -> socket.socket:
    """A socket listening on a free port of `host`, as another program holding it would."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.listen()
    return s


# -- the pure check ------------------------------------------------------------------------------------------------
def test_a_port_another_socket_listens_on_is_taken_there_and_on_every_address():
    with _held() as held:
        port = held.getsockname()[1]
        assert port_taken(port, "127.0.0.1") == "Address already in use"
        assert port_taken(port, EVERY_ADDRESS) == "Address already in use"   # torch's store binds every address
    assert port_taken(port, "127.0.0.1") is None and port_taken(port, EVERY_ADDRESS) is None


def test_a_port_left_in_time_wait_is_free_as_the_store_binds_it():
    """A previous job's store (SO_REUSEADDR, as torch's) that closed its connections first leaves the port in
    TIME_WAIT: a plain bind fails, the next store's (SO_REUSEADDR) does not, and neither does the check."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    server.close()
    conn.close()   # the listening side closes first: its port lingers in TIME_WAIT
    client.recv(1)
    client.close()   # its FIN acknowledged, the listening side's port goes from FIN_WAIT_2 to TIME_WAIT (60 s)
    assert eventually(lambda: port_taken(port, "127.0.0.1") is None, timeout=5)
    with socket.socket() as plain:
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))


def test_an_address_that_does_not_resolve_is_said_so():
    assert port_taken(29500, "no-such-host.invalid") == "no-such-host.invalid does not resolve"


# -- what the torchrun backend refuses before its launch ------------------------------------------------------------
def _torchrun_check(raw: dict, overrides: dict | None = None) -> None:
    from dualrun.backends import backend_of

    cfg = build_config(raw, "job.yaml", overrides)
    backend_of(cfg).before_launch(cfg)


def test_torchrun_machine_0_names_the_files_key_or_the_flag():
    with _held() as held:
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            _torchrun_check({"use_cpu": True, "main_process_port": port})
        assert str(e.value).startswith(f"job.yaml: main_process_port: expected a port free on this machine "), e.value
        assert f"got {port}, taken on this machine (Address already in use)" in str(e.value), e.value
        with pytest.raises(ConfigError) as e:
            _torchrun_check({"use_cpu": True}, {"main_process_port": port})
        assert str(e.value).startswith("<command line>: --main_process_port: expected a port free"), e.value


def test_torchrun_machines_1_to_n_bind_no_store_and_do_not_refuse():
    with _held() as held:   # machine 0's store binds it; this machine only connects to main_process_ip
        port = held.getsockname()[1]
        raw = {"use_cpu": True, "num_machines": 2, "num_processes": 2, "main_process_ip": "127.0.0.1",
               "main_process_port": port}
        _torchrun_check({**raw, "machine_rank": 1})
        with pytest.raises(ConfigError, match=f"main_process_port: .*got {port}, taken"):
            _torchrun_check({**raw, "machine_rank": 0})


# -- the whole launch, both backends -------------------------------------------------------------------------------
@pytest.fixture
def cluster(ray_cluster_if_ray):
    """The Ray case: this worker's running cluster (conftest.ray_cluster); the torchrun one starts none."""
    return ray_cluster_if_ray


def _launch(tmp_path: Path, backend: str, cluster, config: str, *flags: str) -> subprocess.CompletedProcess:
    (tmp_path / "job.yaml").write_text(config)
    (tmp_path / "script.py").write_text(SCRIPT)
    env = dict(os.environ, **ray_env(RAY_ADDRESS=cluster.address if backend == "ray" else ""))
    return subprocess.run([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file", "job.yaml",
                           *flags, "script.py", str(tmp_path / "ran.txt")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
@pytest.mark.parametrize("given", ["file", "flag"])
def test_a_taken_main_process_port_is_refused_before_anything_starts(tmp_path, cluster, backend, given):
    with _held() as held:
        port = held.getsockname()[1]
        config = "use_cpu: true\nroles: {train: {gpus: 2}}\n"
        if given == "file":
            proc = _launch(tmp_path, backend, cluster, config + f"main_process_port: {port}\n")
        else:
            proc = _launch(tmp_path, backend, cluster, config, "--main_process_port", str(port))
    key = "job.yaml: main_process_port" if given == "file" else "<command line>: --main_process_port"
    # Ray's core logs its own lines as it connects (in a network namespace with loopback alone: no route to find
    # this machine's address by): not dualrun's
    lines = [ln for ln in proc.stderr.strip().splitlines() if not RAY_LOG.match(ln)]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"dualrun: error: {key}: expected a port free on this machine"), \
        proc.stderr[-3000:]
    assert f"got {port}, taken on this machine (Address already in use)" in lines[0], lines
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ran.txt").exists()
    if backend == "ray":
        cluster.assert_nothing_left()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_rank_0s_actor_says_its_port_is_taken_where_its_store_binds_it(ray_cluster):
    """Where rank 0's node is not this machine the driver cannot look: the actor says it before any program starts,
    and the driver turns that into the same one line, naming the node."""
    import ray

    from dualrun.backends.ray.actors.rank_actor import RankWorker
    from dualrun.launchers.rendezvous_port import RANK0_STORE, taken_error
    from dualrun.plan.meeting import rendezvous_of

    ray_cluster.connect()
    actor = ray.remote(RankWorker).options(num_cpus=0).remote("dualrun-test-taken-port", "train rank 0")
    try:
        with _held() as held:
            port = held.getsockname()[1]
            taken = ray.get(actor.info.remote(True, port, "127.0.0.1"), timeout=60)
            everywhere = ray.get(actor.info.remote(True, port, EVERY_ADDRESS), timeout=60)
        free = ray.get(actor.info.remote(True, port, "127.0.0.1"), timeout=60)
        other = ray.get(actor.info.remote(False, port, "127.0.0.1"), timeout=60)   # not rank 0: binds nothing
    finally:
        ray.kill(actor)
    assert (taken.port, taken.taken, everywhere.taken) == (port, "Address already in use", "Address already in use")
    assert free.taken is None and other.taken is None
    cfg = build_config({"use_cpu": True, "backend": "ray", "main_process_port": port}, "job.yaml")
    line = str(taken_error(rendezvous_of(cfg), port, taken.taken, f"rank 0's node {taken.ip}", RANK0_STORE))
    assert line == (f"job.yaml: main_process_port: expected a port free on rank 0's node {taken.ip} (trainer rank "
                    f"0's store listens on it), got {port}, taken on rank 0's node {taken.ip} (Address already in use) "
                    "(free it, or choose another port)")
    ray_cluster.assert_nothing_left()
