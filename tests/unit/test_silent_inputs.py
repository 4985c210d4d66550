"""Bad input the YAML corpus cannot hold: secret flags found by argparse's prefix rule, linear time on big
environment values and long DUALRUN_FORWARD_ENV lists, the Python API's unknown overrides, owned flags in every
spelling, and a clean-up or notice that must not depend on who started dualrun."""
from __future__ import annotations

import time

import pytest

from dualrun.config import build_config
from dualrun.config.environment import check_environment
from dualrun.env.worker import forwarded_env
from dualrun.contract.redact import REDACTED, redact_argv, redact_text, redact_value
from dualrun.contract.errors import ConfigError
from dualrun.methods.commands import own_flag


@pytest.mark.parametrize("argv", [["--api-k", "sk-1"], ["--api_key", "sk-1"], ["--api-ke=sk-1"], ["--hf-tok", "sk-1"],
                                  ["--api-k sk-1"]])
def test_secret_flags_are_redacted_under_argparse_abbreviations(argv):
    shown = " ".join(redact_argv(argv))
    assert "sk-1" not in shown and REDACTED in shown
    assert "sk-1" not in redact_text(" ".join(argv))


def test_other_flags_keep_their_values():
    assert redact_argv(["--max-model-len", "64", "--enable-x", "y"]) == ["--max-model-len", "64", "--enable-x", "y"]


@pytest.mark.parametrize("args,flag", [
    (["--port 9000"], "--port"), (["-tp2"], "--tensor-parallel-size"), (["-dp", "2"], "--data-parallel-size"),
    (["--enforce-eager", "--po=1"], "--port"), (["--tensor_parallel", "2"], "--tensor-parallel-size"),
    (["--max-model-len", "64", "--host\t0.0.0.0"], "--host"),
])
def test_owned_flags_however_spelled_or_packed(args, flag):
    assert own_flag(args)[1] == flag


def test_flags_that_only_look_alike_pass():
    assert own_flag(["--portable", "--hostname", "x", "-tpx", "--model-impl", "vllm"]) is None


@pytest.mark.parametrize("text", ["a-" * 70_000, "a:" * 70_000 + "@", "a:b@" * 35_000, "a," * 70_000,
                                  "--a-" * 35_000, "x" * 140_000], ids=["dashes", "colons", "credentials", "commas",
                                                                        "flags", "plain"])
def test_redaction_is_linear_in_a_big_value(text):
    start = time.monotonic()
    redact_value("BIG", text)
    assert time.monotonic() - start < 0.5


def test_ten_thousand_forwarded_names_answer_in_well_under_a_second():
    names = ",".join(f"MY_VAR_{i}" for i in range(10_000))
    env = {"DUALRUN_FORWARD_ENV": names, "PATH": "/bin", "OTHER": "x",
           **{f"MY_VAR_{i}": str(i) for i in range(0, 10_000, 3)}}
    start = time.monotonic()
    check_environment(env)
    got = forwarded_env(env)
    assert time.monotonic() - start < 0.5
    assert "MY_VAR_9999" in got and "OTHER" not in got and "PATH" in got


def test_forward_patterns_still_match():
    got = forwarded_env({"DUALRUN_FORWARD_ENV": "MY_*,EXACT", "MY_A": "1", "EXACT": "2", "EXACTLY": "3"})
    assert {"MY_A", "EXACT"} <= set(got) and "EXACTLY" not in got


@pytest.mark.parametrize("env,key", [
    ({"DUALRUN_PROGRESS": "bogus"}, "DUALRUN_PROGRESS"), ({"DUALRUN_EXIT_TIMEOUT_S": "0"}, "DUALRUN_EXIT_TIMEOUT_S"),
    ({"DUALRUN_EXIT_TIMEOUT_S": "inf"}, "DUALRUN_EXIT_TIMEOUT_S"), ({"DUALRUN_FORWARD_ENV": "A,?*"}, "DUALRUN_FORWARD_ENV"),
    ({"DUALRUN_FORWARD_ENV": "A B"}, "DUALRUN_FORWARD_ENV"), ({"DUALRUN_JOBS_DIR": __file__}, "DUALRUN_JOBS_DIR"),
])
def test_documented_variables_are_checked(env, key):
    with pytest.raises(ConfigError) as e:
        check_environment(env)
    assert e.value.key == key and e.value.source == "<environment>"


def test_good_variables_pass():
    check_environment({"DUALRUN_PROGRESS": "all", "DUALRUN_EXIT_TIMEOUT_S": "2.5", "DUALRUN_FORWARD_ENV": "A,B_*,",
                       "DUALRUN_CACHE": "0", "DUALRUN_DEBUG": "1", "RAY_ADDRESS": "http://h:8265",
                       "DUALRUN_JOBS_DIR": "/nonexistent/made-when-missing"})  # torchrun
    for address in ("auto", "10.0.0.1:6379", "ray://head:10001", "[::1]:6379", ""):
        check_environment({"RAY_ADDRESS": address}, backend="ray")


def test_the_python_api_refuses_an_unknown_override_with_the_nearest_name(tmp_path):
    import dualrun

    (tmp_path / "t.py").write_text("raise SystemExit(3)\n")
    with pytest.raises(ConfigError) as e:
        dualrun.launch(str(tmp_path / "t.py"), config={"use_cpu": True}, num_proceses=4, dry_run=True)
    assert e.value.key == "num_proceses" and "did you mean 'num_processes'" in str(e.value)
    with pytest.raises(ConfigError):
        build_config({}, "<python>", {"gpus": 2})


def test_honest_layouts_still_pass():
    """What the refusals must leave alone: a colocated vLLM rollout's tensor parallel size and sleep mode, a
    separate server's sizes, an external server with only its address (and top_k)."""
    from dualrun.methods.plugin import get_plugin

    for method, raw in [
        ("grpo", {"offload_model": True, "roles": {"train": {"gpus": 2}, "rollout": {
            "gpus": 2, "engine": "vllm", "tensor_parallel_size": 2}}, "colocate_groups": [["train", "rollout"]]}),
        ("grpo", {"roles": {"train": {"gpus": 1}, "rollout": {"gpus": 2, "tensor_parallel_size": 2, "model": "o/m",
                                                               "server_args": ["--max-model-len", 64]}}}),
        ("gkd", {"roles": {"train": {"gpus": 1}, "teacher": {"address": "h:1", "top_k": 4, "model": "o/t"}}}),
        ("sft", {"roles": {"train": {"gpus": 2, "tensor_parallel_size": 1}}}),
    ]:
        cfg = build_config({"method": method, **raw}, "ok.yaml")
        get_plugin(method).validate(cfg)


def test_a_dropped_variable_is_named_under_a_wrapper_process(tmp_path):
    """`MY_FLAG=1 timeout 60 dualrun launch ...`: the parent is `timeout`, which inherited MY_FLAG; the notice
    compares with the launching shell's environment instead, so the variable is still named."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("timeout") is None:
        pytest.skip("no coreutils timeout")
    (tmp_path / "c.yaml").write_text("use_cpu: true\nnum_processes: 1\n")
    (tmp_path / "t.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "MY_FLAG_27"}
    proc = subprocess.run(["bash", "-c", f"MY_FLAG_27=1 timeout 120 {sys.executable} -m dualrun launch --dry_run "
                           "--config_file c.yaml t.py; true"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert "not forwarded to the workers: " in proc.stderr and "MY_FLAG_27" in proc.stderr, proc.stderr[-2000:]


_NO_RAY = """
import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoRay())
from dualrun.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["launch", "plan"])
def test_the_ray_backend_without_ray_says_how_to_install_it(tmp_path, command):
    """Ray's absence simulated by an import blocker in a fresh interpreter (uninstalling it is not ours to do)."""
    import subprocess
    import sys

    (tmp_path / "c.yaml").write_text("use_cpu: true\nnum_processes: 1\n")
    (tmp_path / "t.py").write_text("")
    args = [command, "--backend", "ray", "--config_file", "c.yaml"] + (["t.py"] if command == "launch" else [])
    proc = subprocess.run([sys.executable, "-c", _NO_RAY, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "ray[default]"' in lines[0] and ": ray: expected" in lines[0], lines


def test_tmpdir_is_forwarded_only_to_a_node_where_it_exists(tmp_path):
    """A Ray rank's actor (here without Ray: the class itself) drops the launching machine's TMPDIR where the
    directory does not exist on its node, and says so in the rank's output; an existing one is kept."""
    import os
    import sys

    from dualrun.backends.ray.actors.rank_actor import RankWorker

    def run(tmpdir: str) -> tuple[str, list[str]]:
        worker = RankWorker("dualrun-test-tmpdir", "rank 0")
        env = {"PATH": os.environ["PATH"], "TMPDIR": tmpdir}
        worker.start([sys.executable, "-c", "import os; print('TMPDIR=' + os.environ.get('TMPDIR', '-'))"], env,
                     str(tmp_path))
        assert worker.wait().exit_code == 0
        lines = [text for batch in iter(lambda: worker.queue.take(1.0), None) for _, text in batch]
        return next(t for t in lines if t.startswith("TMPDIR=")), lines

    seen, lines = run("/no/such/dualrun-tmp")
    assert seen == "TMPDIR=-" and any("TMPDIR=/no/such/dualrun-tmp" in t and "does not exist on this node" in t
                                      for t in lines)
    seen, lines = run(str(tmp_path))
    assert seen == f"TMPDIR={tmp_path}" and not any("does not exist" in t for t in lines)


def test_a_rollout_server_the_script_turns_off_is_named_unused(capfd):
    """The script sets `use_vllm=False` itself: dualrun leaves it alone, and says in one line that the rollout
    server is unused; a config left at its defaults is pointed at the server without that line."""
    import dataclasses
    import types

    from dualrun.plugins.workers.grpo_worker import wire_rollout

    @dataclasses.dataclass
    class GRPOConfig:   # the fields TRL's GRPOConfig has for this, with its defaults
        use_vllm: bool = False
        vllm_mode: str = "colocate"
        vllm_server_host: str = "0.0.0.0"
        vllm_server_port: int = 8000

        def __post_init__(self) -> None:
            pass

    wire_rollout(types.SimpleNamespace(GRPOConfig=GRPOConfig), "GRPOConfig", "127.0.0.1:8123")
    off = GRPOConfig(use_vllm=False)
    err = capfd.readouterr().err
    assert off.use_vllm is False and err.count("\n") == 1
    assert "rollout server at 127.0.0.1:8123 (roles.rollout) is unused: GRPOConfig.use_vllm=False" in err
    on = GRPOConfig()
    err = capfd.readouterr().err
    assert on.use_vllm is True and on.vllm_server_port == 8123 and "unused" not in err
