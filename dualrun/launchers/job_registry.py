"""The per-user registry of running jobs that `dualrun scale` can reach: one JSON file per job.

Why files: `dualrun scale` runs later, in another shell, and must find the job's control channel (its address and
its secret) with nothing passed by hand. Each file holds the job's secret, so the directory is this user's alone
(mode 0700, owned by them, refused otherwise) and each file is mode 0600: only the user who launched the job (and
root) can reach it. Where: `DUALRUN_JOBS_DIR`, else `$XDG_RUNTIME_DIR/dualrun/jobs` (a per-login tmpfs), else
`~/.cache/dualrun/jobs`. A file whose process no longer runs (a launcher killed with SIGKILL) is removed by the next
reader. Standard library only.
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from dualrun.contract.errors import DualrunError
from dualrun.contract.protocol import JOBS_DIR   # overrides where the registry lives (tests; a private directory)

SUFFIX = ".json"


class RegistryRefused(DualrunError):
    """The registry directory is not this user's alone: nothing is read from it or written to it."""

    exit_code = 2


@dataclass(frozen=True)
class JobRecord:
    """One running job's entry: where its control channel listens and the secret it answers to."""

    run_id: str
    pid: int
    address: str        # host:port of its control channel (loopback)
    token: str          # the job's secret: the channel answers only requests carrying it
    started: float      # wall clock (time.time()) when the channel came up
    config: str         # the config file the job was launched with, as given
    roles: dict[str, dict[str, int]] = field(default_factory=dict)   # resizable role -> replicas, min, max at start

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "JobRecord | None":
        """The record a file holds, None when it holds no valid one (a half-written or foreign file)."""
        try:
            data = json.loads(text)
            record = JobRecord(str(data["run_id"]), int(data["pid"]), str(data["address"]), str(data["token"]),
                               float(data["started"]), str(data.get("config", "")),
                               {str(k): {str(a): int(b) for a, b in v.items()} for k, v in
                                dict(data.get("roles", {})).items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return record if _safe_name(record.run_id) else None


def _safe_name(run_id: str) -> bool:
    return bool(run_id) and len(run_id) <= 100 and all(c.isalnum() or c in "-_." for c in run_id) and \
        not run_id.startswith(".")


def jobs_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where this user's registry lives (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    if env.get(JOBS_DIR):
        return Path(env[JOBS_DIR])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "dualrun" / "jobs"
    return Path(os.path.expanduser("~")) / ".cache" / "dualrun" / "jobs"


def private_dir(path: Path, create: bool) -> bool:
    """Check (and with `create`, make: mode 0700) the registry directory; False when it does not exist (and was not
    to be made). RegistryRefused, one line, when it is no directory, is not this user's, or others may read it."""
    if create and not os.path.lexists(path):
        for parent in reversed([path, *path.parents][:3]):   # dualrun/ and jobs/ (and a missing base) as 0700
            if not os.path.lexists(parent):
                try:
                    os.mkdir(parent, 0o700)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise RegistryRefused(f"{path}: cannot make the job registry ({e.strerror}); set "
                                          f"{JOBS_DIR} to a directory of yours") from None
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode):
        raise RegistryRefused(f"{path}: the job registry must be a directory (not a link or a file); remove it or set "
                              f"{JOBS_DIR}")
    if info.st_uid != os.getuid():
        raise RegistryRefused(f"{path}: the job registry belongs to uid {info.st_uid}, not to this user "
                              f"({os.getuid()}); set {JOBS_DIR} to a directory of yours")
    if info.st_mode & 0o077:
        raise RegistryRefused(f"{path}: the job registry holds jobs' secrets but others may use it (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}); run: chmod 700 {path}")
    return True


def register(record: JobRecord, environ: Mapping[str, str] | None = None) -> Path:
    """Write `record` as RUN_ID.json (mode 0600, whole or not at all); its path. RegistryRefused as `private_dir`."""
    where = jobs_dir(environ)
    private_dir(where, create=True)
    path = where / f"{record.run_id}{SUFFIX}"
    partial = where / f".{record.run_id}.{os.getpid()}.tmp"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(record.to_json())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    return path


def unregister(path: Path) -> None:
    """Remove a job's file (idempotent)."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def running_jobs(environ: Mapping[str, str] | None = None) -> list[JobRecord]:
    """The jobs of this user's registry whose launcher still runs, oldest first; the files of the others removed.
    A file not this user's alone, or no record, is passed over. RegistryRefused as `private_dir`."""
    where = jobs_dir(environ)
    if not private_dir(where, create=False):
        return []
    found = []
    for path in sorted(where.glob(f"*{SUFFIX}")):
        record = _read(path)
        if record is None:
            continue
        if not alive(record.pid):
            unregister(path)
            continue
        found.append(record)
    return sorted(found, key=lambda r: (r.started, r.run_id))


def path_of(record: JobRecord, environ: Mapping[str, str] | None = None) -> Path:
    return jobs_dir(environ) / f"{record.run_id}{SUFFIX}"


def _read(path: Path) -> JobRecord | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        text = f.read(1 << 16)
    record = JobRecord.from_json(text)
    return record if record is not None and path.name == f"{record.run_id}{SUFFIX}" else None


def alive(pid: int) -> bool:
    """Whether process `pid` runs (signal 0: nothing is sent)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False   # another user's process holds the pid now: the launcher that wrote the file is gone
    return True
