"""What many test modules share: the repository's path, the CLI run as a user runs it, the tiny assets (built once,
cached by the builder's content), the leftover-process check, a free port, a wait for asynchronous cleanup and the
loopback check. One copy of each, so a fix reaches every test; tests/conftest.py holds only fixtures and hooks."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from dualrun.light.ports import free_port

SUPPORT = Path(__file__).resolve().parent   # tests/support: what every tier's tests import (on sys.path: pyproject)
REPO = SUPPORT.parents[1]
ASSETS = SUPPORT / "assets"   # the small scripts and programs tests run
BUILDER = REPO / "examples" / "make_tiny_model.py"

__all__ = ["ASSETS", "REPO", "SUPPORT", "cmdline", "dualrun", "engine_pid", "eventually", "free_port", "gone",
           "link_tiny", "loopback_only", "pids_matching", "tiny_assets"]


def dualrun(*args: str, cwd: str | Path | None = None, timeout: float = 240, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a fresh interpreter, as a user would."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dualrun", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env, input=input)


def loopback_only() -> bool:
    """This process's network namespace has no interface but `lo`: the only place tests may start torchrun or Ray."""
    try:  # /proc/net/dev lists the interfaces of this process's network namespace
        with open("/proc/net/dev") as f:
            names = {line.split(":")[0].strip() for line in f.readlines()[2:]}
        return names <= {"lo"}
    except OSError:
        return False


def _cache_key(vllm: bool) -> str:
    """The builder's source, this interpreter and its transformers/tokenizers (the vLLM tier's venv pins others)."""
    h = hashlib.sha1(BUILDER.read_bytes())
    versions = []
    for dist in ("transformers", "tokenizers", "torch"):
        try:
            versions.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            versions.append("-")
    h.update(repr((sys.executable, versions, vllm)).encode())
    return h.hexdigest()[:16]


def tiny_assets(vllm: bool = False) -> Path:
    """examples/make_tiny_model.py's output (model, teacher, data), built once and then reused by every test, every
    xdist worker and later runs until the builder changes. Built beside the cache and renamed into place, so a
    crashed or concurrent build never leaves a half-made directory. Tests only read it (outputs go elsewhere)."""
    root = Path(os.environ.get("DUALRUN_TEST_CACHE", Path(tempfile.gettempdir()) / "dualrun-test-cache"))
    out = root / f"tiny{'-vllm' if vllm else ''}-{_cache_key(vllm)}"
    if (out / "data" / "gkd.jsonl").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))
    cmd = [sys.executable, str(BUILDER), "--out", str(work / "tiny")] + (["--vllm"] if vllm else [])
    subprocess.run(cmd, check=True, capture_output=True)
    try:
        os.rename(work / "tiny", out)
    except OSError:   # another worker finished first: its copy is as good
        if not (out / "data" / "gkd.jsonl").exists():
            raise
    shutil.rmtree(work, ignore_errors=True)
    return out


def link_tiny(tiny: Path, where: Path) -> Path:
    """`where/tiny` -> the shared assets: paths under the test's own directory (unique markers on the workers'
    command lines, relative `tiny/model` arguments) without building or copying anything."""
    link = where / "tiny"
    if not link.exists():
        link.symlink_to(tiny, target_is_directory=True)
    return link


def cmdline(pid: int) -> str:
    """The process's command line as one string ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _has_open_file_under(pid: int, prefix: str) -> bool:
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd).startswith(prefix):
                return True
        except OSError:
            continue
    return False


def pids_matching(marker: str, *also: str, open_files: bool = False) -> list[int]:
    """Processes (this one excluded) whose command line contains `marker` (a test's unique path) and every word of
    `also`; with `open_files`, also those holding a file under `marker` open (Ray's agents rename themselves to
    `ray::...` but keep their logs open). The one leftover check of the suite: a test that started something asserts
    this is empty afterwards."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmd = cmdline(int(entry.name))
        hit = marker in cmd and all(word in cmd for word in also)
        if not hit and open_files and not also:
            hit = _has_open_file_under(int(entry.name), marker)
        if hit:
            out.append(int(entry.name))
    return out


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: only its parent's wait is missing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def engine_pid(text: str, label: str = "") -> int:
    """The pid of the last CPU engine that started in `text` (its "loading ... (pid N)" line), optionally only one
    whose lines carry the launcher's `[label]` prefix: so tests can check that the server itself, not only its
    parent, is gone."""
    prefix = re.escape(f"[{label}] ") if label else ""
    found = re.findall(prefix + r"dualrun engine: loading .* \(pid (\d+)\)", text)
    assert found, f"no engine start{' of ' + label if label else ''} in:\n{text[-3000:]}"
    return int(found[-1])


def eventually(check: Callable[[], Any], timeout: float = 15.0, every: float = 0.2) -> Any:
    """The first truthy value of `check()` within `timeout` s (cleanup in Ray is asynchronous), else the last."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def health_server(delay_s: float = 0.0, status: dict[str, int] | None = None, default: int = 200,
                  gate: Callable[[], Any] | None = None) -> Any:
    """A real HTTP server on loopback, serving in a thread: every GET answered after `delay_s` with its path's code
    in `status`, else `default`; with `gate`, called first, a GET whose call raises is answered 500. Another
    machine's server (or a slow one) as a health check sees it; the caller shuts it down (`shutdown`,
    `server_close`)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            try:
                if gate is not None:
                    gate()
            except Exception:  # noqa: BLE001 - the gate said no
                self.send_response(500)
                self.end_headers()
                return
            time.sleep(delay_s)
            self.send_response((status or {}).get(self.path, default))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pids_under(where, marker: str) -> list[int]:
    """Processes matching `marker` whose working directory is `where` or below it: this test's alone, not another
    job's running beside it (the cluster tier's, whose processes /proc shows too)."""
    mine = []
    for pid in pids_matching(marker):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd == str(where) or cwd.startswith(str(where) + os.sep):
            mine.append(pid)
    return mine
