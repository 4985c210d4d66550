"""Untrusted input stays harmless: the one redaction rule, escaped and bounded messages, bounded YAML, module and
device checks, and a failure path that imports nothing heavy. Pure functions in milliseconds, a few CLI runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from helpers import dualrun
from dualrun.config.program import module_exists
from dualrun.config.yamlfile import parse, read_text
from dualrun.contract.redact import REDACTED, is_secret, redact, redact_argv, redact_text
from dualrun.contract.errors import ConfigError, one_line, shown


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "DB_PASSWD", "DB_PASSWORD", "MY_PASS", "DB_PWD",
                                  "GOOGLE_APPLICATION_CREDENTIALS", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                  "AWS_SESSION_TOKEN", "apiKey", "--api-key", "--hf_token", "env.MY_SECRET",
                                  "OPENAI_API_KEY", "SSH_PRIVATE_KEY", "HTTP_AUTHORIZATION"])
def test_secret_names(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", ["PATH", "PWD", "OLDPWD", "TOKENIZERS_PARALLELISM", "--max-num-batched-tokens",
                                  "roles.teacher.top_k", "MASTER_PORT", "KEYBOARD", "PASSAGE_LEN", "HF_HOME"])
def test_names_that_are_not_secret(name):
    assert not is_secret(name)


def test_redaction_of_values_flags_and_urls():
    assert redact_text("postgres://me:hunter2@db:5432/x") == f"postgres://me:{REDACTED}@db:5432/x"
    assert redact_text("ray://admin:pw@10.0.0.1:10001") == f"ray://admin:{REDACTED}@10.0.0.1:10001"
    assert redact_text("--api-key sk-1 --port 8000") == f"--api-key {REDACTED} --port 8000"
    assert redact_argv(["--api-key", "sk-1", "--api_key=sk-2", "--port", "1", "--hf-token", "hf"]) == [
        "--api-key", REDACTED, f"--api_key={REDACTED}", "--port", "1", "--hf-token", REDACTED]
    env = redact({"DATABASE_URL": "mysql://u:pw@h/db", "S": json.dumps({"env": {"HF_TOKEN": "hf_x"}}), "A": "b"})
    assert "pw" not in env["DATABASE_URL"] and "hf_x" not in env["S"] and env["A"] == "b"


def test_messages_are_escaped_cut_and_hide_secrets():
    line = ConfigError("a\nb.yaml", "k\x1b[2J", "a string", "x\n" * 100_000 + "Traceback").line()
    assert "\n" not in line and "\x1b" not in line and len(line) < 300 and line.isascii()
    assert line.startswith("a\\nb.yaml: <a key that is not a name (5 characters)>: expected a string, got 'x\\nx\\n")
    line = ConfigError("c.yaml", "env.HF_TOKEN", "a string", ["hf_abc"]).line()
    assert "hf_abc" not in line and "value hidden" in line
    line = ConfigError("c.yaml", "roles.r.server_args", "a list", ["--api-key", "sk-9", {"AWS_SECRET": "s"}]).line()
    assert "sk-9" not in line and "'s'" not in line
    assert shown("\u202eevil") == "'\\u202eevil'"
    bomb: list = ["lol"] * 9
    for _ in range(8):
        bomb = [bomb] * 9        # 9^9 strings, shared: printing it must stay bounded
    start = time.perf_counter()
    assert len(shown(bomb)) <= 60 and time.perf_counter() - start < 0.1
    assert len(one_line("y" * 10**6)) <= 280


def test_yaml_bounds_are_fast():
    bomb = "a: &a [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
        f"{n}: &{n} [" + ",".join([f"*{p}"] * 9) + "]\n" for p, n in zip("abcdefgh", "bcdefghi"))
    for text, match in ((bomb, "values once aliases are expanded"), ("a: " + "[" * 5000 + "]" * 5000, "nesting"),
                        ("x: {a: 1, a: 2}\n", "x.a: expected each key once")):
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=match):
            parse("c.yaml", text)
        assert time.perf_counter() - start < 1.0
    start = time.perf_counter()
    assert len(parse("c.yaml", "v: '" + "x" * 200_000 + "'\n")["v"]) == 200_000
    assert time.perf_counter() - start < 2.0


def test_merge_keys_and_shared_anchors_stay_valid():
    data = parse("c.yaml", "base: &b {gpus: 2, engine: vllm}\nroles:\n  train: {gpus: 2}\n"
                           "  rollout: {<<: *b, gpus: 1}\n  teacher: *b\n")
    assert data["roles"]["rollout"] == {"gpus": 1, "engine": "vllm"} and data["roles"]["teacher"]["gpus"] == 2


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    errors: list[BaseException] = []
    reader = threading.Thread(target=lambda: errors.append(pytest.raises(ConfigError, read_text, str(fifo)).value))
    reader.start()
    reader.join(2)
    assert not reader.is_alive() and "a FIFO" in str(errors[0])
    with pytest.raises(ConfigError, match="a character device"):
        read_text("/dev/zero")


def test_modules_are_found_without_importing_them(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("raise SystemExit('imported!')\n")
    monkeypatch.chdir(tmp_path)
    assert module_exists("mine") and module_exists("json.decoder") and module_exists("trl.scripts.sft")
    assert not module_exists("no_such_module_xyz") and not module_exists("json.nope") and not module_exists("mine.x")


def test_the_failure_path_imports_no_torch_or_ray(tmp_path):
    (tmp_path / "bad.yaml").write_text("roles: {train: {gpus: 300000000}}\n")
    (tmp_path / "train.py").write_text("")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dualrun", "launch", "--config_file",
                           "bad.yaml", "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "ray", "accelerate", "transformers", "trl", "numpy")}
    assert not heavy, sorted(heavy)


@pytest.mark.slow
def test_deep_script_is_no_role_program_and_no_traceback(tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\nnum_processes: 1\n")
    (tmp_path / "deep.py").write_text("x = " + "(" * 100_000 + "1" + ")" * 100_000 + "\n")
    proc = dualrun("launch", "--dry_run", "--config_file", "c.yaml", "deep.py", cwd=tmp_path, timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "torch.distributed.run" in proc.stdout


SERVER_ARGS = ("method: grpo\nuse_cpu: true\nroles:\n  train: {gpus: 1}\n"
               "  rollout: {gpus: 1, model: m, server_args: [--api-key, sk-live-abc, '--hf-token=hf_live_def']}\n"
               "env: {DATABASE_URL: 'postgres://me:pg_pw_123@db/x'}\n")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_server_args_and_url_passwords_never_printed(tmp_path, backend):
    (tmp_path / "c.yaml").write_text(SERVER_ARGS)
    (tmp_path / "train.py").write_text("")
    env = {"RAY_ADDRESS": "", "DUALRUN_CACHE": "0"}
    outs = [dualrun("launch", "--dry_run", "--backend", backend, "--config_file", "c.yaml", "train.py",
                    cwd=tmp_path, env=env),
            dualrun("plan", "--json", "--backend", backend, "--config_file", "c.yaml", cwd=tmp_path, env=env)]
    for proc in outs:
        assert proc.returncode == 0, proc.stderr
        for secret in ("sk-live-abc", "hf_live_def", "pg_pw_123"):
            assert secret not in proc.stdout + proc.stderr
    if backend == "torchrun":
        assert "--api-key '***'" in outs[0].stdout or "--api-key ***" in outs[0].stdout, outs[0].stdout


@pytest.mark.parametrize("started,code", [(False, 2), (True, 1)])
def test_last_resort_handler_is_one_line(monkeypatch, capsys, tmp_path, started, code):
    """A bug of ours on the validation path still ends in one line (exit 2); after a start, exit 1."""
    from dualrun import cli
    from dualrun.contract import errors

    def broken(ns):
        if started:
            errors.mark_started()
        raise RuntimeError("boom\nTraceback (most recent call last):\n  --api-key sk-oops")

    monkeypatch.setattr(errors, "_STATE", {"started": False})
    monkeypatch.setattr(cli, "_load", broken)
    monkeypatch.delenv("DUALRUN_DEBUG", raising=False)
    (tmp_path / "t.py").write_text("")
    assert cli.main(["launch", str(tmp_path / "t.py")]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected RuntimeError" in err and "sk-oops" not in err, err


def test_dualrun_env_hides_a_password_in_ray_address(monkeypatch):
    from dualrun.backends.ray.connect import reachable_line

    monkeypatch.setenv("RAY_ADDRESS", "ray://admin:sekrit-pw@127.0.0.1:1\x1b[2J")
    line = reachable_line()
    assert "sekrit-pw" not in line and "\x1b" not in line and line.startswith("no (")


def test_plan_header_escapes_the_config_path(tmp_path):
    name = "odd\nTraceback\x1b[31m.yaml"
    (tmp_path / name).write_text("use_cpu: true\nnum_processes: 1\n")
    proc = dualrun("plan", "--config_file", name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith("cluster=planned (1 node(s))") and "\x1b" not in proc.stdout
