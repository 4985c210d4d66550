"""What a one-line error may show: no secret-looking part of a value, no key that is not a name, the variable or
flag that caused it, the YAML problem's position. Pure functions in milliseconds (the CLI cases are in
tests/support/bad_inputs.yaml)."""
from __future__ import annotations

import pytest

from dualrun.config import build_config
from dualrun.config.cross_keys import host_name
from dualrun.config.environment import check_environment
from dualrun.config.values import check
from dualrun.contract.errors import ConfigError, shown_key
from dualrun.contract.redact import REDACTED, redact_data, redact_text
from dualrun.methods.plugin import get_plugin, validate


def test_a_secret_named_assignment_loses_its_value_everywhere():
    assert redact_text("HF_TOKEN=hf_abc123") == f"HF_TOKEN={REDACTED}"
    assert redact_text("run with WANDB_API_KEY=w4ndb and more") == f"run with WANDB_API_KEY={REDACTED} and more"
    assert redact_text("TOKENIZERS_PARALLELISM=false A=b") == "TOKENIZERS_PARALLELISM=false A=b"   # not secret names


@pytest.mark.parametrize("value,secret", [
    (["HF_TOKEN=hf_in_a_list"], "hf_in_a_list"),
    (["--api-key", ["sk-nested-1"]], "sk-nested-1"),
    ("h:80?token=in_a_query", "in_a_query"),
    ("h:80?sig=any_query_name", "any_query_name"),
    ("https://urlusertoken@hf.co/m", "urlusertoken"),
    ({"HF_TOKEN=key_holds_it": 1}, "key_holds_it"),
])
def test_a_value_shown_in_an_error_has_no_secret_looking_part(value, secret):
    assert secret not in str(redact_data(value))
    line = ConfigError("c.yaml", "roles.r.address", "host:port", value).line()
    assert secret not in line and REDACTED in line


def test_environment_values_are_never_shown_whatever_their_name():
    for key in ("env", "env.PLAIN", "roles.train.env", "roles.train.env.X", "ray.runtime_env.env_vars",
                "ray.runtime_env.env_vars.X"):
        line = ConfigError("c.yaml", key, "a string", ["plain-visible-value"]).line()
        assert "plain-visible-value" not in line and "got a list" in line, line
    assert "visible" in ConfigError("c.yaml", "roles.env.model", "a string", ["visible"]).line()   # a role `env`


@pytest.mark.parametrize("key,shown", [
    ("roles.train.gpus", "roles.train.gpus"), ("colocate_groups[0]", "colocate_groups[0]"),
    ("--machine_rank", "--machine_rank"), ("<yaml>", "<yaml>"), ("accelerate keys", "accelerate keys"),
    ("root:*:20228:0:99999:7::", "<a key that is not a name (24 characters)>"),
    ("env.HF_TOKEN=hf_x.y.z", "env.HF_TOKEN=..."),
    ("env.a b", "env.<a key that is not a name (3 characters)>"),
])
def test_a_key_is_shown_only_as_far_as_it_is_names(key, shown):
    assert shown_key(key) == shown


@pytest.mark.parametrize("good", ["10.0.0.1", "node-1.cluster.local", "localhost", "::1", "fe80::1%eth0", "host_a",
                                  "n1.", "2001:db8::1"])
def test_main_process_ip_takes_addresses_and_host_names(good):
    assert host_name(good)


@pytest.mark.parametrize("bad", ["10", "1.2.3", "999.1.1.1", "not an ip!", " ", "", "http://10.0.0.1:29500",
                                 "10.0.0.1:29500", "user:pw@h", "[::1]", "-a.b", "a..b", "x" * 64])
def test_main_process_ip_refuses_what_is_no_address(bad):
    assert not host_name(bad)


def test_numbers_written_as_strings_are_refused_alike_and_shown_as_strings():
    for kind, value in (("int", " 5 "), ("int", "5"), ("float", "60"), ("float", "1e3")):
        with pytest.raises(ConfigError) as e:
            check("c.yaml", "k", kind, value)
        assert f"got the string '{value}'" in e.value.line()
    assert check("c.yaml", "k", "int", 5) == 5 and check("c.yaml", "k", "float", 60) == 60.0


@pytest.mark.parametrize("name,value", [("OMP_NUM_THREADS", "abc"), ("OMP_NUM_THREADS", ""), ("MPI_LOCALNRANKS", "x"),
                                        ("OMPI_COMM_WORLD_LOCAL_SIZE", "1.5"), ("USE_TORCH_XLA", "maybe")])
def test_accelerates_variables_are_blamed_on_the_environment(name, value):
    with pytest.raises(ConfigError) as e:
        check_environment({name: value})
    assert e.value.source == "<environment>" and e.value.key == name


def test_the_job_token_is_long_printable_and_never_shown():
    for bad in ("Q7", "Q" * 15, "QQQQQQQQ QQQQQQQQ", "Q" * 16 + "\u00e9"):
        with pytest.raises(ConfigError) as e:
            check_environment({"DUALRUN_JOB_TOKEN": bad})
        assert e.value.key == "DUALRUN_JOB_TOKEN" and bad not in e.value.line()
    for good in ("", "sixteen_chars___", "given-on-every-machine"):
        check_environment({"DUALRUN_JOB_TOKEN": good})


def test_a_method_error_names_the_device_group_the_user_wrote():
    for workers in (["samplr"], ["default"]):
        cfg = build_config({"method": "sampling", "device_groups": {"g": {"device": "GPU", "ranks": [0],
                                                                          "workers": workers}}}, "c.yaml")
        with pytest.raises(ConfigError) as e:
            validate(cfg, get_plugin(cfg.method, cfg.source))
        assert e.value.key == "device_groups.g.workers", e.value.line()


def _sampling_error(cfg: dict) -> str | None:
    cfg = build_config({"method": "sampling", **cfg}, "c.yaml")
    try:
        validate(cfg, get_plugin(cfg.method, cfg.source))
    except ConfigError as e:
        return e.line()
    return None


def test_an_unknown_role_in_a_device_group_list_is_named_and_a_token_is_hidden():
    groups = {"nproc_per_node": 4, "a": {"device": "GPU", "ranks": [0, 1], "workers": ["sampler"]},
              "b": {"device": "GPU", "ranks": [2, 3], "workers": ["prm", "orm", "critic"]}}
    line = _sampling_error({"device_groups": groups})
    assert line is not None and "device_groups.b.workers" in line and line.endswith("got critic"), line
    token = "ghp_" + "x1Y2" * 9
    groups["b"]["workers"][2] = token
    line = _sampling_error({"device_groups": groups})
    assert token not in line and REDACTED in line, line
    line = _sampling_error({"use_cpu": True, "roles": {"sampler": {"processes": 1}, token: {"processes": 1}}})
    assert token not in line and "not a name" in line, line


@pytest.mark.parametrize("word,token", [("critic", False), ("reward_model_v2_large_ckpt", False),
                                        ("hf_" + "a1" * 10, True), ("sk-" + "b2" * 10, True),
                                        ("aB3dE5fG7hJ9kL1mN3pQ5rS7tU9", True)])
def test_a_token_is_told_from_a_name_by_its_shape(word, token):
    from dualrun.contract.redact import looks_like_token

    assert looks_like_token(word) is token


@pytest.mark.parametrize("written,ok", [(None, True), (3, True), (2, False), (4, False), (1, False)])
def test_a_role_program_takes_num_processes_as_accelerates_total(written, ok):
    """2 + 1 processes (prm and orm colocated: one slot) -> the total is 3; any other number names both."""
    cfg = {"use_cpu": True, "roles": {"sampler": {"processes": 2}, "prm": {"processes": 1}, "orm": {"processes": 1}},
           "colocate_groups": [["prm", "orm"]]}
    if written is not None:
        cfg["num_processes"] = written
    line = _sampling_error(cfg)
    if ok:
        assert line is None
    else:
        assert line is not None and "num_processes" in line and "3" in line and f"got {written}" in line, line
