"""The bad-input corpus (tests/support/bad_inputs.yaml) through the real CLI: `dualrun.cli.main` in this process for
most cases (milliseconds each instead of an interpreter start), a fresh `python -m dualrun` for the representative ones
(the first case of each command, of `env`, `secret`, `script` and `both`) and for every `make` case (fifos, huge files
and bombs stay out of the test process).

Every case: exit code 2, exactly one line on stderr naming the key, under 300 bytes, printable ASCII only (no
forged lines, no terminal escapes), no secret value, under 10 s, nothing on stdout and nothing started (the script
would leave a marker file; an eval would leave `PWNED`). Fields of a case: `config` (YAML text written to
bad.yaml), `make` (a builder below for inputs YAML text cannot hold), `args` (words before the script), `script`,
`command` (launch, plan or config), `env`, `secret` (must appear nowhere in the output), `hint`, `cut` (the key
itself is cut short in the line: match its start), `both` (run once per backend).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dualrun.contract import errors
from dualrun.cli import main
from helpers import SUPPORT

CORPUS = yaml.safe_load((SUPPORT / "bad_inputs.yaml").read_text())
SCRIPT = "import pathlib; pathlib.Path('STARTED').write_text('yes')\n"
MAX_LINE_BYTES = 300
MAX_SECONDS = 10.0


def _fifo(d: Path) -> str:
    os.mkfifo(d / "bad.yaml")
    return "bad.yaml"


def _big_json(d: Path) -> str:
    """A 50 MB JSON file given by mistake (JSON is YAML: without the size bound it would be parsed)."""
    with open(d / "data.json", "w") as f:
        f.write('{"rows": [')
        row = '{"a": 1, "b": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"},' * 1000
        for _ in range((50 * 2**20) // len(row)):
            f.write(row)
        f.write('{}]}\n')
    return "data.json"


def _just_too_big(d: Path) -> str:
    (d / "bad.yaml").write_text("env:\n" + "".join(f"  V{i}: '{'x' * 60}'\n" for i in range(4000)))
    return "bad.yaml"


def _alias_bomb(d: Path) -> str:
    """The billion laughs in YAML: 9 levels of 9 aliases each, about 600 bytes, 9^9 strings once expanded."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    (d / "bad.yaml").write_text("\n".join(lines) + "\n")
    assert (d / "bad.yaml").stat().st_size < 700
    return "bad.yaml"


def _deep_lists(d: Path) -> str:
    (d / "bad.yaml").write_text("env: " + "[" * 5000 + "]" * 5000 + "\n")
    return "bad.yaml"


def _deep_maps(d: Path) -> str:
    (d / "bad.yaml").write_text("ray: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n")
    return "bad.yaml"


def _alias_chain(d: Path) -> str:
    """Each anchor nests the previous one: shallow as written, 200 levels deep once expanded."""
    lines = ["a0: &a0 [1]"] + [f"a{i}: &a{i} [*a{i - 1}]" for i in range(1, 200)]
    (d / "bad.yaml").write_text("\n".join(lines) + "\n")
    return "bad.yaml"


def _long_value(d: Path) -> str:
    (d / "bad.yaml").write_text("backend: '" + "x" * 200_000 + "'\n")
    return "bad.yaml"


def _long_secret(d: Path) -> str:
    (d / "bad.yaml").write_text("env: {HF_TOKEN: [" + "hf_" + "s" * 200_000 + "]}\n")
    return "bad.yaml"


def _long_key(d: Path) -> str:
    (d / "bad.yaml").write_text("? " + "k" * 200_000 + "\n: 1\n")   # an explicit key: no 1024-character limit
    return "bad.yaml"


def _huge_env_value(d: Path) -> str:
    """One `env:` value past the kernel's 128 KiB limit for a variable: refused in one line, not an `execve` that
    fails (or a dry run that redacts it for minutes)."""
    (d / "bad.yaml").write_text("use_cpu: true\nnum_processes: 1\nenv: {BIG: '" + "a-b:c@" * 24_000 + "'}\n")
    return "bad.yaml"


def _binary(d: Path) -> str:
    (d / "bad.yaml").write_bytes(b"\xff\xfe\x00\x01garbage\x9c")
    return "bad.yaml"


def _directory(d: Path) -> str:
    (d / "conf.d").mkdir()
    return "conf.d"


def _devzero(d: Path) -> str:
    return "/dev/zero"


def _symlink_to_devzero(d: Path) -> str:
    (d / "bad.yaml").symlink_to("/dev/zero")
    return "bad.yaml"


MAKERS = {f.__name__[1:]: f for f in (_fifo, _big_json, _just_too_big, _alias_bomb, _deep_lists, _deep_maps,
                                       _alias_chain, _long_value, _long_secret, _long_key, _huge_env_value, _binary,
                                       _directory, _devzero, _symlink_to_devzero)}


def _expand(corpus: list[dict]) -> list[tuple[str, dict, bool]]:
    """(test id, case, whether it runs in a fresh interpreter)."""
    out, seen = [], set()
    for i, case in enumerate(corpus):
        traits = {f"command={case.get('command', 'launch')}"} | {k for k in ("env", "secret", "script", "both")
                                                                  if case.get(k)}
        fresh = bool(case.get("make")) or not traits <= seen
        seen |= traits
        for backend in (("torchrun", "ray") if case.get("both") else (None,)):
            c = dict(case)
            if backend:
                c["args"] = ["--backend", backend] + list(c.get("args", []))
            out.append((f"{i}-{c['key'][:40]}" + (f"-{backend}" if backend else ""), c, fresh))
    return out


CASES = _expand(CORPUS)


def test_corpus_is_big_enough():
    assert len(CORPUS) >= 115 and len(CASES) >= 130


def _args(tmp_path: Path, case: dict) -> list[str]:
    (tmp_path / "train.py").write_text(SCRIPT)
    config = None
    if case.get("make"):
        config = MAKERS[case["make"]](tmp_path)
    if case.get("config") is not None:
        (tmp_path / "bad.yaml").write_text(case["config"])
        config = "bad.yaml"
    command = case.get("command", "launch")
    if command == "config":
        return ["config", "default"] + case.get("args", [])
    args = [command] + (["--config_file", config] if config else []) + case.get("args", [])
    return args + [case.get("script", "train.py")] if command == "launch" else args


def _env(case: dict) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "RAY_ADDRESS")}
    env.update({k: str(v) for k, v in (case.get("env") or {}).items()})
    env["DUALRUN_CACHE"] = "0"
    return env


def _in_a_fresh_interpreter(tmp_path: Path, case: dict) -> tuple[int, bytes, bytes]:
    proc = subprocess.run([sys.executable, "-m", "dualrun", *_args(tmp_path, case)], cwd=tmp_path,
                          capture_output=True, timeout=60, env=_env(case))
    return proc.returncode, proc.stdout, proc.stderr


def _in_this_process(tmp_path: Path, case: dict, monkeypatch, capfdbinary) -> tuple[int, bytes, bytes]:
    """`main(argv)` as `python -m dualrun` runs it: the case's cwd and environment, output captured at the file
    descriptors, `sys.exit` from argparse taken as the exit code. Nothing may have started afterwards either."""
    args = _args(tmp_path, case)
    monkeypatch.chdir(tmp_path)
    env = _env(case)
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(errors._STATE, "started", False)
    capfdbinary.readouterr()
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capfdbinary.readouterr()
    assert not errors.has_started(), "the job was marked as started"
    return code, out, err


def _ray_connected(case: dict) -> bool:
    """A case on the Ray backend, in a process still connected to a Ray cluster (an earlier test on this pytest-xdist
    worker joined the session's `ray_cluster`): dualrun would use that connection, as no fresh `python -m dualrun`
    can, so the case runs in a fresh interpreter instead."""
    ray = sys.modules.get("ray")
    on_ray = "ray" in case.get("args", []) or "backend: ray" in (case.get("config") or "")
    return on_ray and ray is not None and ray.is_initialized()


def test_both_ways_are_used():
    fresh = [c for _, c, f in CASES if f]
    assert len(CASES) - len(fresh) >= 100 and len(fresh) >= 8
    assert all(f for _, c, f in CASES if c.get("make"))


@pytest.mark.parametrize("case,fresh", [(c, f) for _, c, f in CASES], ids=[i for i, _, _ in CASES])
def test_bad_input(tmp_path, case, fresh, monkeypatch, capfdbinary):
    start = time.monotonic()
    if fresh or _ray_connected(case):
        returncode, stdout, stderr = _in_a_fresh_interpreter(tmp_path, case)
    else:
        returncode, stdout, stderr = _in_this_process(tmp_path, case, monkeypatch, capfdbinary)
    elapsed = time.monotonic() - start
    err = stderr.decode("utf-8", "replace")
    lines = [line for line in stderr.split(b"\n") if line.strip()]
    assert returncode == 2, err[-2000:]
    assert len(lines) == 1 and b"Traceback (most recent call last):\n" not in stderr, err[-2000:]
    line = lines[0]
    assert len(line) < MAX_LINE_BYTES, line
    assert all(32 <= b < 127 for b in line), line       # printable ASCII: no control, escape or bidi characters
    text = line.decode("ascii")
    key = case["key"]
    assert (f": {key}" if case.get("cut") else f": {key}: expected") in text, text
    if "hint" in case:
        assert case["hint"] in text, text
    if "secret" in case:
        assert case["secret"].encode() not in stderr + stdout, text
    assert elapsed < MAX_SECONDS, f"{elapsed:.1f} s"
    assert stdout == b""
    assert not (tmp_path / "STARTED").exists() and not (tmp_path / "PWNED").exists()
