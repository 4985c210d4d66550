"""Each vLLM CPU engine on a machine gets its own cores.

Why: vLLM's CPU build binds an engine's OpenMP threads itself (`VLLM_CPU_OMP_THREADS_BIND=auto`) and every engine
picks the same first cores of the machine, so two replicas on one machine share one core and the second one's
tokens/s halves. The plan marks each of k engines on a machine with its share (`protocol.CPU_SHARE`, 'j/k'); the
cores themselves are a fact of the machine the engine starts on (its allowed CPUs, a cgroup's cpuset), so the share
becomes `VLLM_CPU_OMP_THREADS_BIND` there, in `ServerProcess`. A binding the user set (the role's `env:` or the
environment the server gets) is kept. vLLM applies the binding in its worker process only: with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` (the worker inside the engine core) the engine runs unbound, and where engines
share a machine `unbound_note` says so in the engine's output.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

from dualrun.contract.protocol import CPU_SHARE

OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"   # '0': vLLM's model worker runs inside its engine-core process


def cores_for(allowed: Sequence[int], index: int, count: int) -> list[int]:
    """The `index`-th of `count` contiguous, disjoint shares of `allowed` (the first shares one core larger where
    they do not divide evenly); with more engines than cores, one core each, in turn."""
    n = len(allowed)
    if count >= n:
        return [allowed[index % n]]
    per, extra = divmod(n, count)
    start = index * per + min(index, extra)
    return list(allowed[start:start + per + (1 if index < extra else 0)])


def bind_share(env: Mapping[str, str], allowed: Sequence[int] | None = None) -> dict[str, str]:
    """`env` with `VLLM_CPU_OMP_THREADS_BIND` set from its `CPU_SHARE` (unless a binding is set already)."""
    out = dict(env)
    share = out.get(CPU_SHARE)
    if not share or OMP_BIND in out:
        return out
    index, count = (int(x) for x in share.split("/"))
    cores = cores_for(sorted(allowed if allowed is not None else os.sched_getaffinity(0)), index, count)
    out[OMP_BIND] = ",".join(map(str, cores))
    return out


def unbound_note(env: Mapping[str, str]) -> str | None:
    """One line for an engine whose share cannot apply: it shares its machine with other engines, but its env runs
    vLLM's worker inside the engine core, where vLLM binds no threads (so the engines compete for the same cores)."""
    share = env.get(CPU_SHARE)
    if not share or env.get(IN_PROCESS, "").strip() != "0":
        return None
    count = share.split("/")[-1]
    if not count.isdigit() or int(count) < 2:
        return None
    return (f"dualrun: {IN_PROCESS}=0 in this engine's env: vLLM binds its OpenMP threads only in a separate worker "
            f"process, so this engine runs unbound while {count} engines share this machine's cores (unset it to "
            f"give each engine its own cores)")
