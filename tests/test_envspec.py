"""What reaches workers: the allow-list, secret redaction, torchrun's variable names."""
from __future__ import annotations

from dualrun.envspec import TORCHRUN_NAMES, forwarded_env, rank_env, redact


def test_only_allow_listed_variables_are_forwarded():
    environ = {"PATH": "/bin", "HF_HOME": "/h", "NCCL_DEBUG": "INFO", "AWS_SECRET_ACCESS_KEY": "x",
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
