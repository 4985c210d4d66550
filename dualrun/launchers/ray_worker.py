"""The Ray actor behind one rank: it runs `python -m dualrun.bootstrap ...` as a subprocess and streams its output.

Why a subprocess and not the actor itself: the user script must start in a fresh interpreter with its env set
before any import (torch reads CUDA_VISIBLE_DEVICES / OMP_NUM_THREADS at import), and the actor process is full
of Ray's own variables and threads. The actor only holds the rank's resources, picks the rendezvous address when
it is rank 0, and hands lines of output to the driver through a long-poll (`lines`), so the driver prints them
itself with a `[train rank N]` prefix (no Ray log prefixes, no interleaving inside a line).

This module is imported by Ray worker processes: keep it free of torch and of the rest of dualrun.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any

from dualrun.errors import killed_by
from dualrun.interpreter import resolve

STDOUT, STDERR = 1, 2
_TAIL = 40          # stderr lines kept for the failure message
_LINGER_S = 0.2
_BATCH = 2000       # most lines handed over per `lines` call


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it if the actor process dies (e.g. ray.kill, node loss)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; not Linux
        pass


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free on this node (all held open while picking, so none is picked twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RankWorker:
    """One rank. Methods are called concurrently (threaded actor): start/wait/lines/stop."""

    def __init__(self, run_id: str, label: str) -> None:
        self.run_id = run_id
        self.label = label
        self.run_dir = os.path.join(tempfile.gettempdir(), run_id)   # shared by the job's actors on this node
        os.makedirs(self.run_dir, exist_ok=True)
        self.tmp = tempfile.mkdtemp(dir=self.run_dir)
        self.proc: subprocess.Popen | None = None
        self.queue: queue.Queue = queue.Queue()
        self.tail: collections.deque = collections.deque(maxlen=_TAIL)
        self.readers: list[threading.Thread] = []
        self.log = None
        self.log_lock = threading.Lock()
        self.result: dict[str, Any] | None = None
        self.error_file: str | None = None
        self.spawner: threading.Thread | None = None
        self.end = 0.0

    def info(self, pick_port: bool = False) -> dict[str, Any]:
        """Where this actor landed: node IP and id, its GPUs, a temp dir; rank 0 also picks free ports on its node
        (MASTER_PORT, and the vLLM weight-sync port for which the trainer is the rendezvous master)."""
        import ray

        ctx = ray.get_runtime_context()
        port, group_port = _free_ports(2) if pick_port else (None, None)
        return {"ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "tmp": self.tmp, "pid": os.getpid(),
                "port": port, "group_port": group_port}

    def start(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str | None = None) -> int:
        """Start the rank's program; returns its pid. `argv[0]` '<python>' means this node's interpreter."""
        argv = resolve(argv)
        if not os.path.isdir(cwd):
            raise RuntimeError(f"the launching directory {cwd} does not exist on this node")
        self.error_file = env.get("TORCHELASTIC_ERROR_FILE") or None
        if self.error_file:
            os.makedirs(os.path.dirname(self.error_file), exist_ok=True)
        if log_path:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
            self.log = open(log_path, "a", encoding="utf-8", errors="replace")
        started = threading.Event()
        failure: list[BaseException] = []
        # The thread that forks must outlive the child: PR_SET_PDEATHSIG fires when that *thread* exits, and
        # Ray's actor threads are not ours to keep. So a dedicated thread spawns the program and waits for it.
        spawner = threading.Thread(target=self._spawn, args=(argv, env, cwd, started, failure), daemon=True)
        spawner.start()
        started.wait()
        if failure:
            raise failure[0]
        self.spawner = spawner
        assert self.proc is not None
        return self.proc.pid

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: str, started: threading.Event,
               failure: list[BaseException]) -> None:
        try:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True,
                                         preexec_fn=_die_with_parent)
            for stream, pipe in ((STDOUT, self.proc.stdout), (STDERR, self.proc.stderr)):
                t = threading.Thread(target=self._read, args=(stream, pipe), daemon=True)
                t.start()
                self.readers.append(t)
        except BaseException as e:  # noqa: BLE001 - handed to start()
            failure.append(e)
            return
        finally:
            started.set()
        self.proc.wait()
        self.end = time.time()

    def _read(self, stream: int, pipe) -> None:
        """Split the pipe into lines ('\\n' or '\\r', so progress bars still flow) and queue them."""
        buf = b""
        while True:
            chunk = pipe.read1(65536)
            if not chunk:
                break
            buf += chunk
            parts = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
            buf = parts.pop()
            for part in parts:
                self._emit(stream, part.decode("utf-8", "replace"))
        if buf:
            self._emit(stream, buf.decode("utf-8", "replace"))
        pipe.close()

    def _emit(self, stream: int, text: str) -> None:
        if stream == STDERR and text.strip():
            self.tail.append(text)
        if self.log is not None:
            with self.log_lock:
                self.log.write(text + "\n")
                self.log.flush()
        self.queue.put((stream, text))

    def wait(self) -> dict[str, Any]:
        """Block until the program exits (Ray notifies the driver); exit code, error text and end time."""
        assert self.proc is not None and self.spawner is not None, "start() was not called"
        self.spawner.join()
        code, end = self.proc.returncode, self.end
        self._kill_group(signal.SIGKILL)     # stragglers it left in its session (dataloader workers, ...)
        for t in self.readers:
            t.join(timeout=5)
        if self.log is not None:
            with self.log_lock:
                self.log.close()
                self.log = None
        self.result = {"exit_code": code, "end": end, "error": self._error(code) if code else None}
        self.queue.put(None)
        return self.result

    def _error(self, code: int) -> str:
        """The error the rank recorded (torch's error-file format), else its last stderr lines."""
        path = self.error_file
        if path and os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
                msg = data.get("message", data)
                msg = msg.get("message", msg) if isinstance(msg, dict) else msg
                if str(msg).strip():
                    return str(msg).strip()
            except (OSError, ValueError, AttributeError):
                pass
        if killed_by(code):
            return killed_by(code)
        lines = [t for t in self.tail if t.strip()]
        return "\n".join(lines[-10:]) if lines else "no error output"

    def lines(self, timeout: float = 5.0) -> list[tuple[int, str]] | None:
        """Long-poll: the queued lines (waits up to `timeout` for the first); None once output has ended."""
        out: list[tuple[int, str]] = []
        try:
            item = self.queue.get(timeout=timeout)
        except queue.Empty:
            return out
        # after the first line, keep collecting briefly: one remote call per burst of output, not per line,
        # so streaming logs costs the training next to nothing (a step's log + progress bar arrive together)
        until = time.monotonic() + _LINGER_S
        while True:
            if item is None:
                if out:
                    self.queue.put(None)  # hand EOF over on the next call
                    return out
                return None
            out.append(item)
            if len(out) >= _BATCH:
                return out
            left = until - time.monotonic()
            try:
                item = self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait()
            except queue.Empty:
                return out

    def _kill_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = 3.0) -> int | None:
        """SIGTERM the program's process group, SIGKILL after `grace` s. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self._kill_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            self._kill_group(signal.SIGKILL)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        elif self.proc is not None:
            self._kill_group(signal.SIGKILL)
        return None if self.proc is None else self.proc.returncode

    def cleanup(self) -> None:
        """Remove the job's temp dir on this node (also what an actor that died left there)."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
