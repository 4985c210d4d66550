"""`torchrun.rendezvous_timeout_s`: the bound each machine of a multi-machine torchrun job waits for the others. It
reaches torchrun's own rendezvous (what torch's static TCP rendezvous reads from `--rdzv-conf`); a bad value is
refused (tests/support/bad_inputs.yaml). The machines' ends that name the missing machine are
tests/unit/test_machine_watch.py's (no job) and tests/cluster/test_cluster_faults.py's (the virtual cluster)."""
from __future__ import annotations

from datetime import timedelta

import pytest


def _launcher(tmp_path, machines: int = 2, **torchrun):
    from dualrun.backends import backend_of
    from dualrun.config import build_config
    from dualrun.launchers import Program
    from dualrun.methods.plugin import get_plugin
    from dualrun.plan.processes import make_plan

    raw = {"use_cpu": True, "num_processes": 2, "num_machines": machines, "machine_rank": 0,
           "main_process_ip": "10.0.0.1", "main_process_port": 29500, "torchrun": torchrun}
    cfg = build_config(raw, str(tmp_path / "c.yaml"))
    plugin = get_plugin(cfg.method)
    launcher = backend_of(cfg).launcher(cfg, Program(str(tmp_path / "job.py")), plugin, {})
    return launcher, make_plan(cfg)


def _rdzv_handler(launcher, plan):
    """The rendezvous torch builds from the prepared torchrun command, as torchrun's own `run` would."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    from torch.distributed.run import config_from_args

    config, _, _ = config_from_args(launcher._agent_args(launcher.prepare(plan), 0))
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                  run_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  **config.rdzv_configs)
    return create_rdzv_handler(params)


def test_the_default_is_torchruns_own_wait(tmp_path):
    launcher, plan = _launcher(tmp_path)
    assert launcher.rdzv.options.rendezvous_timeout_s == 600
    assert _rdzv_handler(launcher, plan).timeout == timedelta(seconds=600)


def test_torchs_static_rendezvous_waits_the_configured_seconds(tmp_path):
    launcher, plan = _launcher(tmp_path, rendezvous_timeout_s=45)
    argv = launcher.torchrun_argv(plan)
    assert argv[argv.index("--rdzv-conf") + 1] == "timeout=45"
    assert _rdzv_handler(launcher, plan).timeout == timedelta(seconds=45)


def test_c10d_gets_its_join_timeout(tmp_path):
    launcher, plan = _launcher(tmp_path, rendezvous_timeout_s=45, rdzv_backend="c10d")
    argv = launcher.torchrun_argv(plan)
    assert argv[argv.index("--rdzv-conf") + 1] == "join_timeout=45"


def test_one_machine_has_nobody_to_wait_for(tmp_path):
    launcher, plan = _launcher(tmp_path, machines=1, rendezvous_timeout_s=45)
    assert "--rdzv-conf" not in launcher.torchrun_argv(plan)


@pytest.mark.parametrize("value", [0, -1, 2.5, "soon", True])
def test_a_bad_value_names_the_key(tmp_path, value):
    from dualrun.contract.errors import ConfigError

    with pytest.raises(ConfigError, match=r"torchrun\.rendezvous_timeout_s"):
        _launcher(tmp_path, rendezvous_timeout_s=value)
