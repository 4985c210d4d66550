"""What reaches workers: the allow-list, secret redaction, torchrun's variable names."""
from __future__ import annotations

from dualrun.env.worker import TORCHRUN_NAMES, forwarded_env, rank_env

from dualrun.contract.redact import redact


def test_only_allow_listed_variables_are_forwarded():
    environ = {"PATH": "/bin", "HF_HOME": "/h", "NCCL_DEBUG": "INFO", "SOME_SECRET_KEY": "x",
               "RANDOM_DRIVER_VAR": "1", "PYTHONPATH": "/p", "CUDA_HOME": "/c"}
    env = forwarded_env(environ)
    assert env == {"PATH": "/bin", "HF_HOME": "/h", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "CUDA_HOME": "/c"}


def test_forward_list_can_be_extended():
    env = forwarded_env({"MY_VAR": "1", "MY_OTHER": "2", "NOPE": "3", "DUALRUN_FORWARD_ENV": "MY_*"})
    assert env["MY_VAR"] == "1" and env["MY_OTHER"] == "2" and "NOPE" not in env


def test_redaction():
    env = redact({"HF_TOKEN": "a", "WANDB_API_KEY": "b", "X_SECRET": "c", "DB_PASSWORD": "d", "PATH": "/bin",
                  "GITHUB_TOKEN": "e"})
    assert env == {"HF_TOKEN": "***", "WANDB_API_KEY": "***", "X_SECRET": "***", "DB_PASSWORD": "***",
                   "PATH": "/bin", "GITHUB_TOKEN": "***"}


def test_rank_env_names_match_torchrun():
    env = rank_env(rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1,
                   master_addr="127.0.0.1", master_port=1234)
    assert tuple(env) == TORCHRUN_NAMES
    assert env["RANK"] == "1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_what_real_clusters_need_is_forwarded_and_credentials_never_printed():
    environ = {"FI_PROVIDER": "efa", "UCX_TLS": "rc", "HIP_VISIBLE_DEVICES": "0", "ROCR_VISIBLE_DEVICES": "0",
               "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "eu",
               "GOOGLE_APPLICATION_CREDENTIALS": "/k.json", "CC": "gcc", "CXX": "g++", "MAX_JOBS": "4"}
    env = forwarded_env(environ)
    assert env == environ
    shown = redact(env)
    assert all(shown[k] == "***" for k in environ if k.startswith("AWS_") or k.startswith("GOOGLE_"))
    assert shown["CC"] == "gcc" and shown["FI_PROVIDER"] == "efa"


def test_dropped_variables_are_named_without_values():
    from dualrun.env.unforwarded import dropped_line, dropped_names

    shell = {"PATH": "/bin", "JAVA_HOME": "/j", "SSH_TTY": "/dev/pts/0"}
    environ = dict(shell, MY_FLAG="1", SSH_CLIENT="x", OLDPWD="/", MY_TOKEN="hunter2", HF_HOME="/h")
    assert dropped_names(environ, parent=shell) == ["MY_FLAG", "MY_TOKEN"]
    line = dropped_line(environ, parent=shell)
    assert "MY_FLAG" in line and "DUALRUN_FORWARD_ENV" in line and "hunter2" not in line and "=1" not in line
    assert dropped_names(dict(environ, DUALRUN_FORWARD_ENV="MY_*"), parent=shell) == []
    # without a readable parent environment only the well-known system names are left out
    assert dropped_names(environ, parent=None) == ["JAVA_HOME", "MY_FLAG", "MY_TOKEN"]
    assert dropped_line(shell, parent=shell) is None
