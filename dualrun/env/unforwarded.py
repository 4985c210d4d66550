"""Name the launching environment's variables that look meant for the job but do not reach the workers.

Why: only an allow-list of the launching environment is forwarded (envspec.FORWARD_ALLOWLIST), so
`MY_FLAG=1 dualrun launch ...` would silently drop MY_FLAG. We name such variables once at start-up (names only,
never values) with the way to forward them. "Meant for the job": not forwarded, not a well-known shell/desktop
variable, and - where the launching shell's environment is readable (Linux) - set for this command or since
the shell started (absent from, or different in, that shell's start-up environment). The shell is the nearest
ancestor that is one, not the parent: under `timeout`, `nohup`, `env` or `srun` the parent is a wrapper that
inherited the variable, and comparing with it would hide every one; with no shell among the ancestors (a
scheduler's step daemon) every candidate is named.
"""
from __future__ import annotations

import fnmatch
import os
from typing import Mapping

from dualrun.env.worker import forwarded_env

# Variables of shells, terminals, desktops and schedulers that nobody means for a training script.
_SYSTEM = (
    "_", "OLDPWD", "SHLVL", "PS1", "PS2", "PS4", "PROMPT_COMMAND", "HISTFILE", "HISTSIZE", "HISTCONTROL",
    "HISTFILESIZE", "HOSTNAME", "HOSTTYPE", "MACHTYPE", "OSTYPE", "MAIL", "MAILCHECK", "LS_COLORS", "LSCOLORS",
    "LESS*", "PAGER", "EDITOR", "VISUAL", "MANPATH", "INFOPATH", "COLORTERM", "COLUMNS", "LINES", "TERM_*",
    "SSH_*", "DISPLAY", "XAUTHORITY", "WAYLAND_DISPLAY", "DBUS_*", "DESKTOP_SESSION", "GDM*", "GNOME_*", "KDE_*",
    "QT_*", "GTK_*", "WINDOWID", "TMUX*", "STY", "SCREENDIR", "VTE_*", "ITERM_*", "WT_*", "VSCODE_*",
    "TERMINAL_*", "GPG_*", "MOTD_SHOWN", "SUDO_*", "LOGINSHELL", "DEBIAN_FRONTEND", "SYSTEMD_*", "INVOCATION_ID",
    "JOURNAL_STREAM", "MANAGERPID", "NOTIFY_SOCKET", "LISTEN_*", "BASH_*", "ZSH*", "FPATH", "OPTERR", "OPTIND",
    "IFS", "PPID", "UID", "EUID", "GROUPS", "DIRSTACK", "PIPESTATUS", "SECONDS", "RANDOM", "LINENO", "COMP_*",
    "SLURM_*", "PBS_*", "LSB_*", "MODULE*", "LMOD_*", "__*",
)


SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "tcsh", "csh", "ash", "busybox", "xonsh",
                    "nu", "elvish"})
_MAX_ANCESTORS = 32


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _ancestors(pid: int) -> list[int]:
    """This process's ancestors, parent first (from /proc/<pid>/stat; [] where /proc is not there)."""
    out: list[int] = []
    while pid > 1 and len(out) < _MAX_ANCESTORS:
        stat = _read(f"/proc/{pid}/stat")
        if stat is None:
            break
        pid = int(stat[stat.rindex(b")") + 2:].split()[1])   # the field after the state; comm may hold spaces
        if pid <= 0:
            break
        out.append(pid)
    return out


def _parent_environ() -> dict[str, str] | None:
    """The start-up environment of the nearest ancestor that is a shell (the one the user typed `VAR=1 dualrun
    ...` or `VAR=1 timeout ... dualrun ...` into); None if there is none or it is unreadable."""
    for pid in _ancestors(os.getpid()):
        comm = (_read(f"/proc/{pid}/comm") or b"").strip().decode("utf-8", "replace")
        if comm.lstrip("-") not in SHELLS:
            continue
        raw = _read(f"/proc/{pid}/environ")
        if raw is None:
            return None
        out = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep:
                out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        return out
    return None


def dropped_names(environ: Mapping[str, str] | None = None,
                  parent: Mapping[str, str] | None | bool = True) -> list[str]:
    """Sorted names of variables that look meant for the job but are not forwarded (`parent=True`: read the
    launching shell's start-up environment)."""
    environ = os.environ if environ is None else environ
    parent_env = _parent_environ() if parent is True else (parent or None)
    forwarded = forwarded_env(environ)
    names = []
    for name, value in environ.items():
        if name in forwarded or any(fnmatch.fnmatchcase(name, p) for p in _SYSTEM):
            continue
        if parent_env is not None and parent_env.get(name) == value:
            continue    # inherited unchanged from the shell's own start-up environment: not set for this job
        names.append(name)
    return sorted(names)


def dropped_line(environ: Mapping[str, str] | None = None, parent: Mapping[str, str] | None | bool = True,
                 limit: int = 12) -> str | None:
    """One start-up line naming the dropped variables and how to forward them; None when there are none."""
    names = dropped_names(environ, parent)
    if not names:
        return None
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    return (f"not forwarded to the workers: {shown} (forward with DUALRUN_FORWARD_ENV=\"{','.join(names[:limit])}\" "
            f"or set them under `env:` in the config)")
