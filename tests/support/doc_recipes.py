"""What the tests that run the docs' commands share: the bash blocks of the multi-node recipes' READMEs
(examples/multi-node/*/README.md) and of docs/*.md, read as a user would copy them, and the user's shell they run in.
tests/e2e/test_recipes.py runs the one-machine blocks; the cluster tier's modules run the virtual-cluster ones; a unit
test reads a doc's blocks. Here, not in a test module, so no tier imports another's tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO, pids_matching

RECIPES = REPO / "examples" / "multi-node"
BIN = str(Path(sys.executable).parent)


def one_machine_block(recipe: str, heading: str = "## Try it on one machine") -> list[str]:
    """The commands of the README's "Try it on one machine" bash block (or the first one under `heading`):
    continuations joined, comments dropped."""
    text = (RECIPES / recipe / "README.md").read_text()
    section = text.split(heading, 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands, current = [], ""
    for line in block.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if current.strip():
                commands.append(current.strip())
            current = ""
    return commands


def substitute(commands: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for cmd in commands:
        for old, new in values.items():
            cmd = cmd.replace(old, new)
        out.append(cmd)
    return out


def shell_env(**extra: str) -> dict[str, str]:
    """The user's shell: this venv's `ray` / `dualrun` on PATH, no inherited Ray address or auth mode."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def stop_cluster(temp_dir: str, grace: float = 3.0) -> None:
    """What `ray stop` does, for this cluster only: SIGTERM, then SIGKILL whatever is left after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in pids_matching(temp_dir, open_files=True):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids_matching(temp_dir, open_files=True) and time.monotonic() < deadline:
            time.sleep(0.3)
    assert not pids_matching(temp_dir, open_files=True), f"Ray processes of {temp_dir} left running: {pids_matching(temp_dir, open_files=True)}"


def run_block(commands: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the commands as one bash session (so `export` carries over), stopping at the first failure."""
    script = "set -e\n" + "\n".join(commands) + "\n"
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=shell_env(**(env or {})), capture_output=True,
                          text=True, timeout=timeout)



def token_mode() -> dict[str, str]:
    """The READMEs' rule: with ~/.ray/auth_token, Ray 2.60's `ray start --head` turns token auth on."""
    return {"RAY_AUTH_MODE": "token"} if (Path.home() / ".ray" / "auth_token").exists() else {}



def doc_files(doc: Path) -> dict[str, str]:
    """Code blocks of a doc that follow a line naming their file: "`path/name.py`:" or "`path` — ..."."""
    text = doc.read_text()
    out = {}
    for m in re.finditer(r"^`([\w./-]+)`[^\n]*\n\n```\w*\n(.*?)```", text, re.M | re.S):
        out[m.group(1)] = m.group(2)
    return out


def doc_blocks(doc: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), re.S)



def doc_commands(doc: Path, prefix: str = "dualrun launch") -> list[str]:
    """Every command of the doc's bash blocks that starts with `prefix` (continuation lines joined)."""
    out = []
    for block in doc_blocks(doc, "bash"):
        current = ""
        for line in block.splitlines():
            current += line[:-1].rstrip() + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                if current.strip().startswith(prefix):
                    out.append(current.strip())
                current = ""
    return out

