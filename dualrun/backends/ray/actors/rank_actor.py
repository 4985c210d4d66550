"""The Ray actor behind one rank: it runs `python -m dualrun.rank.bootstrap ...` as a subprocess and streams its output.

Why a subprocess and not the actor itself: the user script must start in a fresh interpreter with its env set
before any import (torch reads CUDA_VISIBLE_DEVICES / OMP_NUM_THREADS at import), and the actor process is full
of Ray's own variables and threads. The actor only holds the rank's resources, picks the rendezvous address when
it is rank 0, and hands lines of output to the driver through a long-poll (`lines`), so the driver prints them
itself with a `[train rank N]` prefix (no Ray log prefixes, no interleaving inside a line).

This module is imported by Ray worker processes: keep it free of torch; of dualrun it imports only small modules that
need nothing beyond the standard library (errors, line_queue, parent_death, progress, protocol, ports, interpreter,
interfaces).
"""
from __future__ import annotations

import codecs
import collections
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from dualrun.light.child_process import ChildProcess
from dualrun.env.worker import on_this_node
from dualrun.contract.errors import killed_by
from dualrun.light.line_queue import STDERR, STDOUT, LineQueue
from dualrun.light.parent_death import die_with_parent
from dualrun.light.progress import Collapser, show_progress
from dualrun.contract.protocol import PROGRESS, ActorPlace, RankExit
from dualrun.light.ports import EVERY_ADDRESS, free_ports, port_taken
from dualrun.light.interpreter import resolve
from dualrun.light.interfaces import holding

CALL = "<call>"     # stands for the pickled call's file on the actor's node
_TAIL = 40          # stderr lines kept for the failure message
READ_PAUSE_S = 0.25  # between two reads of a pipe: a step's log line and its bar redraw come in one read
PIPE_BYTES = 1 << 18  # ... so the pipe holds 256 KiB: ~1 MB/s before a write waits (a fuller pipe is read on at once;
#                       not more: past 64 MiB of pipes per user, Linux gives that user's new pipes one page)


class RankWorker:
    """One rank. Methods are called concurrently (threaded actor): start/wait/lines/stop."""

    def __init__(self, run_id: str, label: str) -> None:
        self.run_id = run_id
        self.label = label
        self.run_dir = os.path.join(tempfile.gettempdir(), run_id)   # shared by the job's actors on this node
        os.makedirs(self.run_dir, exist_ok=True)
        self.tmp = tempfile.mkdtemp(dir=self.run_dir)
        self.child = ChildProcess()   # the program, in its own process group
        self.queue = LineQueue()   # the driver's long-poll (`lines`)
        self.tail: collections.deque = collections.deque(maxlen=_TAIL)
        self.readers: list[threading.Thread] = []
        self.log = None
        self.log_lock = threading.Lock()
        self.result: RankExit | None = None
        self.error_file: str | None = None
        self.spawner: threading.Thread | None = None
        self.end = 0.0
        self.exited = threading.Event()   # set when the program has exited: the readers stop pausing
        self.show_bars = True
        self.call_file: str | None = None
        self.rank = "0"

    def info(self, pick_port: bool = False, master_port: int | None = None,
             master_host: str = EVERY_ADDRESS) -> ActorPlace:
        """Where this actor landed: node IP and id, its GPUs, a temp dir; rank 0 also picks free ports on its node
        (MASTER_PORT, and the vLLM weight-sync port for which the trainer is the rendezvous master). A
        `master_port` (the config's `main_process_port`) is used as it is: firewalled clusters open one port; the
        place says whether another process holds it where the store binds it (`master_host`), before any
        program starts (the driver refuses it in one line)."""
        import ray

        ctx = ray.get_runtime_context()
        port, group_port = free_ports(2, "") if pick_port else (None, None)
        taken = None
        if pick_port and master_port is not None:
            port, group_port = master_port, (port if group_port == master_port else group_port)
            taken = port_taken(master_port, master_host)
        ip = ray.util.get_node_ip_address()
        return ActorPlace(ip, ctx.get_node_id(), tuple(str(g) for g in ray.get_gpu_ids()), os.getpid(), port,
                          group_port, tmp=self.tmp, interface=holding(ip), taken=taken)

    def start(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str | None = None,
              call: bytes | None = None) -> int:
        """Start the rank's program; returns its pid. `argv[0]` '<python>' means this node's interpreter; with
        `call` (a pickled function, Python API) the argument '<call>' becomes its file in this actor's temp dir."""
        argv = resolve(argv)
        if call is not None:
            self.call_file = os.path.join(self.tmp, "call.pkl")
            with open(self.call_file, "wb") as f:
                f.write(call)
            argv = [self.call_file if a == CALL else a for a in argv]
        if not os.path.isdir(cwd):
            raise RuntimeError(f"the launching directory {cwd} does not exist on this node")
        env, note = on_this_node(env)
        if note:
            self._emit(STDERR, note)
        self.error_file = env.get("TORCHELASTIC_ERROR_FILE") or None
        self.show_bars = show_progress(env.get(PROGRESS, "rank0"), env.get("RANK"))
        self.rank = env.get("RANK", "0")
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
            proc = self.child.start(argv, env, cwd, die_with_parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for stream, pipe in ((STDOUT, proc.stdout), (STDERR, proc.stderr)):
                t = threading.Thread(target=self._read, args=(stream, pipe), daemon=True)
                t.start()
                self.readers.append(t)
        except BaseException as e:  # noqa: BLE001 - handed to start()
            failure.append(e)
            return
        finally:
            started.set()
        proc.wait()
        self.end = time.time()
        self.exited.set()

    def _read(self, stream: int, pipe) -> None:
        """Read the pipe; the log file gets every line and redraw, the driver the collapsed lines (progress.py)."""
        _widen(pipe)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        collapser = Collapser(show_bars=self.show_bars)
        log = self._log_line if self.log is not None else None
        while True:
            chunk = pipe.read1(PIPE_BYTES)
            if not chunk:
                break
            for line in collapser.feed(decoder.decode(chunk), log):
                self._emit(stream, line)
            if len(chunk) < PIPE_BYTES // 2:   # a pipe filling up is read on at once
                self.exited.wait(READ_PAUSE_S)   # what arrives meanwhile is read together; the exit, at once
        for line in collapser.feed(decoder.decode(b"", final=True), log) + collapser.close(log):
            self._emit(stream, line)
        pipe.close()

    def _log_line(self, text: str) -> None:
        with self.log_lock:
            if self.log is not None:
                self.log.write(text + "\n")
                self.log.flush()

    def _emit(self, stream: int, text: str) -> None:
        if stream == STDERR and text.strip():
            self.tail.append(text)
        self.queue.put(stream, text)

    def wait(self) -> RankExit:
        """Block until the program exits (Ray notifies the driver); exit code, error text and end time."""
        assert self.proc is not None and self.spawner is not None, "start() was not called"
        self.spawner.join()
        code, end = self.proc.returncode, self.end
        self.child.signal_group(signal.SIGKILL)     # stragglers it left in its session (dataloader workers, ...)
        for t in self.readers:
            t.join(timeout=5)
        if self.log is not None:
            with self.log_lock:
                self.log.close()
                self.log = None
        self.result = RankExit(code, end, self._error(code) if code else None, self._value())
        self.queue.close()
        return self.result

    def _value(self) -> bytes | None:
        """Python API: the pickled return value the rank left beside its call file (bytes travel back)."""
        if self.call_file is None:
            return None
        from dualrun.contract.calls import result_path

        try:
            with open(result_path(self.call_file, self.rank), "rb") as f:
                return f.read()
        except OSError:
            return None

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
        return self.queue.take(timeout)

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc

    def stop(self, grace: float = 3.0) -> int | None:
        """SIGTERM the program's process group, SIGKILL after `grace` s. Idempotent."""
        return self.child.stop(grace)

    def cleanup(self) -> None:
        """Remove the job's temp dir on this node (also what an actor that died left there)."""
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _widen(pipe) -> None:
    """Give the pipe PIPE_BYTES of buffer where Linux allows it (else it keeps its 64 KiB; the reader just wakes
    more often when a rank writes fast)."""
    import fcntl

    try:
        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (OSError, ValueError):
        pass
