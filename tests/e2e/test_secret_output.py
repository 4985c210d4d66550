"""A secret flag's value (`--api-key VALUE` in `server_args`, `--hub_token VALUE` among a script's arguments) is
printed nowhere: not by dualrun's CPU engine, not in a server's output however it echoes its arguments (the
console, `log_dir`, the log tail an error quotes), not in a dry run. One rule (dualrun/env/worker.py) for all."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from dualrun.contract.redact import hide_values, secret_values

from dualrun.contract.redact import redact_argv
from dualrun.servers.process import ServerError, ServerProcess
from helpers import dualrun
from ray_helpers import ray_env

VALUE = "s3cr3t-VALUE-42"

# echoes its arguments the ways servers do (a list, vLLM's dict of non-default args, a flag line), then fails
ECHO = r"""
import sys
args = sys.argv[1:]
print("argv:", args, flush=True)
print("non-default args:", {"api_key": args[args.index("--api-key") + 1]}, flush=True)
print("unused:", " ".join(args), file=sys.stderr, flush=True)
raise SystemExit("cannot load the model")
"""


def test_the_values_of_secret_flags_are_found_in_every_spelling():
    argv = ["--api-key", VALUE, "--max-model-len", "64", f"--hf_token={VALUE}x", "--api-k", "abc", "--api-key", "ab"]
    assert secret_values(argv) == (f"{VALUE}x", VALUE, "abc")   # longest first; 2 characters are no secret
    assert redact_argv(argv) == ["--api-key", "***", "--max-model-len", "64", "--hf_token=***", "--api-k", "***",
                                 "--api-key", "***"]
    assert hide_values(f"{{'api_key': '{VALUE}'}}", secret_values(argv)) == "{'api_key': '***'}"


def test_a_servers_echo_of_its_secret_argument_is_masked_in_its_output_its_log_and_its_error(tmp_path):
    (tmp_path / "echo.py").write_text(ECHO)
    stream = io.StringIO()
    server = ServerProcess("teacher server 0", [sys.executable, str(tmp_path / "echo.py"), "--api-key", VALUE,
                                                "--top-k", "5"], {}, "127.0.0.1", 1, "/health", 30,
                           str(tmp_path / "teacher-server-0.log"), stream=stream)
    with pytest.raises(ServerError) as failed:
        server.start().wait_healthy()
    shown = {"console": stream.getvalue(), "log": (tmp_path / "teacher-server-0.log").read_text(),
             "error": str(failed.value)}
    for where, text in shown.items():
        assert VALUE not in text, where
        assert "'api_key': '***'" in text and "--api-key *** --top-k 5" in text, (where, text)


def test_the_cpu_engine_names_an_unused_secret_flag_without_its_value(tmp_path):
    """The engine's own line (a user may run it by hand, without dualrun's masking around it)."""
    proc = subprocess.run([sys.executable, "-m", "dualrun.programs.cpu_engine", "--model",
                           str(tmp_path / "no-model"), "--api-key", VALUE, "--hf-token", VALUE], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "dualrun engine: ignoring arguments it does not use: --hf-token ***\n" in proc.stderr   # (--api-key: its own)
    assert VALUE not in proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_dry_run_hides_the_scripts_secret_arguments(tmp_path, backend):
    (tmp_path / "job.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "t.py").write_text("")
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", "--dry_run", "t.py", "--hub_token",
                   VALUE, f"--api-key={VALUE}", "--seed", "1", cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert VALUE not in proc.stdout + proc.stderr
    assert "t.py --hub_token '***' '--api-key=***' --seed 1" in proc.stdout


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_teacher_servers_secret_argument_is_printed_nowhere(tmp_path, backend, ray_cluster_if_ray):
    """The CPU engine with `server_args: [--api-key VALUE, --hf-token VALUE]` (the key it requires, a flag it ignores)
    and a model it cannot load: the job ends naming the server and quoting its log; neither the launch's output nor
    log_dir has the value."""
    address = ray_cluster_if_ray.address if ray_cluster_if_ray else ""
    (tmp_path / "empty").mkdir()   # a directory, but no model in it
    (tmp_path / "job.yaml").write_text(
        "use_cpu: true\nmethod: gkd\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
        f"  teacher: {{gpus: 1, model: {tmp_path / 'empty'}, top_k: 5, server_args: [--api-key, {VALUE}, --hf-token, {VALUE}]}}\n")
    (tmp_path / "t.py").write_text("")
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", "t.py", cwd=tmp_path,
                   env=ray_env(RAY_ADDRESS=address), timeout=240)
    assert proc.returncode != 0 and "teacher server 0" in proc.stderr, proc.stderr[-3000:]
    assert "ignoring arguments it does not use: --hf-token ***" in proc.stderr
    logs = "".join(p.read_text() for p in Path(tmp_path / "logs").glob("*.log"))
    assert "--hf-token ***" in logs
    assert VALUE not in proc.stdout + proc.stderr + logs
