"""The dry run is a value: `describe()` renders the very `Prepared` object that `launch()` then runs, so what
`--dry_run` prints (command, env) is what the workers get."""
from __future__ import annotations

import json
import shlex

import pytest

DUMP = """
import json, os, sys
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv[1:]}, f)
"""


def _launcher(backend: str, tmp_path, script: str = "job.py", args: tuple[str, ...] = ()):
    from dualrun.config import build_config
    from dualrun.backends import backend_of
    from dualrun.launchers import Program
    from dualrun.plan.processes import make_plan
    from dualrun.methods.plugin import get_plugin

    cfg = build_config({"backend": backend, "use_cpu": True, "num_processes": 2,
                        "env": {"MY_FLAG": "on", "HF_TOKEN": "hf_secret"}}, str(tmp_path / "c.yaml"))
    plugin = get_plugin(cfg.method)
    plugin.validate(cfg)
    launcher = backend_of(cfg).launcher(cfg, Program(str(tmp_path / script), args), plugin, {})
    return launcher, make_plan(cfg)


def _printed_env(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        body = line.strip().removesuffix("\\").strip()
        key, _, value = body.partition("=")
        out[key] = shlex.split(value)[0] if value else ""
    return out


def test_torchrun_dry_run_prints_the_prepared_command_and_env(tmp_path, monkeypatch):
    from dualrun.contract.redact import REDACTED, redact
    from dualrun.launchers.launcher import join_cmd

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)   # torchrun's rule: 1 when a node runs several processes
    launcher, plan = _launcher("torchrun", tmp_path, args=("--lr", "1"))
    prepared = launcher.prepare(plan)
    text = launcher.describe(prepared).splitlines()
    env_lines = text[text.index("env -i \\") + 1:-1]
    assert _printed_env(env_lines) == redact(prepared.env)
    assert text[-1].strip() == join_cmd(prepared.argv)
    assert prepared.env["MY_FLAG"] == "on" and _printed_env(env_lines)["HF_TOKEN"] == REDACTED
    assert prepared.argv[-2:] == ("--lr", "1")
    assert _printed_env(env_lines)["OMP_NUM_THREADS"] == "1"


def test_ray_dry_run_prints_each_prepared_rank_env(tmp_path):
    from dualrun.contract.redact import redact
    from dualrun.launchers.launcher import join_cmd

    launcher, plan = _launcher("ray", tmp_path)
    prepared = launcher.prepare(plan)
    text = launcher.describe(prepared).splitlines()
    assert text[3] == "#   " + join_cmd(prepared.argv)
    shared_at = text.index("# env shared by every worker:")
    heads = [i for i, line in enumerate(text) if line.startswith("# train rank")]
    shared = _printed_env(text[shared_at + 1:heads[0]])
    for n, (start, p) in enumerate(zip(heads, plan.workers)):
        end = heads[n + 1] if n + 1 < len(heads) else len(text)
        assert {**shared, **_printed_env(text[start + 1:end])} == redact(prepared.rank_envs[p.label])


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_dry_run_prints_each_servers_prepared_command(tmp_path, backend):
    """Both backends show every server's command (two teacher replicas and their router) from the prepared launch:
    the command the launch builds once the host, the port and the replicas' addresses are known, with `<auto>`
    in their place."""
    from dualrun.config import build_config
    from dualrun.backends import backend_of
    from dualrun.launchers import Program
    from dualrun.launchers.launcher import join_cmd
    from dualrun.plan.processes import AUTO, make_plan
    from dualrun.methods.plugin import get_plugin
    from dualrun.plan.server_commands import server_command

    cfg = build_config({"backend": backend, "method": "gkd", "roles": {"train": {"gpus": 2}, "teacher": {
        "gpus": 2, "model": "m/teacher", "top_k": 20}}}, str(tmp_path / "c.yaml"))
    plugin = get_plugin("gkd")
    plugin.validate(cfg)
    launcher = backend_of(cfg).launcher(cfg, Program(str(tmp_path / "t.py")), plugin, {})
    plan = make_plan(cfg, method=plugin)
    prepared = launcher.prepare(plan)
    text = launcher.describe(prepared)
    assert [label for label, _, _ in prepared.servers] == [p.label for p in plan.servers] == [
        "teacher server 0", "teacher server 1", "teacher router"]
    host = "127.0.0.1" if backend == "torchrun" else "10.1.2.3"   # Ray: the server actor's node, known at launch
    known = {host, "4321", "10.1.2.4:1", "10.1.2.4:2"} - {"127.0.0.1"}
    for p, (label, argv, shown) in zip(plan.servers, prepared.servers):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"# {label}"))
        assert line.endswith(join_cmd(list(argv))), line
        real = server_command(cfg, plugin, p, host, 4321, ["10.1.2.4:1", "10.1.2.4:2"])
        assert [a for a in argv if a != AUTO] == [a for a in real if a not in known]
        assert len(argv) == len(real) and AUTO in argv
        if backend == "ray":   # Ray gives a replica its GPUs; the router has none
            assert shown["CUDA_VISIBLE_DEVICES"] == ("" if label == "teacher router" else AUTO)
    assert "vllm.entrypoints.cli.main serve m/teacher" in text and "dualrun.programs.router" in text


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_torchrun_runs_exactly_the_prepared_launch(tmp_path):
    """The port, the env and the arguments the dry run shows are the ones the real ranks get."""
    (tmp_path / "job.py").write_text(DUMP)
    launcher, plan = _launcher("torchrun", tmp_path, args=(str(tmp_path),))
    prepared = launcher.prepare(plan)
    text = launcher.describe(prepared).splitlines()
    port = shlex.split(text[-1])[shlex.split(text[-1]).index("--master-port") + 1]
    result = launcher.launch(prepared)
    assert result.ok, result.message
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["argv"] == [str(tmp_path)]
        assert got["env"]["MASTER_PORT"] == port   # the rendezvous port the dry run printed
        same = {k for k in prepared.env if got["env"].get(k) == prepared.env[k]}
        assert set(prepared.env) - same <= {"TORCHELASTIC_RUN_ID"}, set(prepared.env) - same
