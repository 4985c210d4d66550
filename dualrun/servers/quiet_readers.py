"""vLLM's shared-memory queue readers, made to sleep between checks instead of spinning, in the vLLM CPU engines
dualrun starts.

Why: the message queue between vLLM's engine core and its workers (`shm_broadcast.MessageQueue`) has every reader
spin on `sched_yield` for one second after each message it reads (`SpinCondition`, `busy_loop_s=1`, no setting): the
worker after every call, the engine core while it waits for a worker's answer. On a GPU machine that second costs an
idle core; on a CPU machine it takes a core from the trainer ranks and from the engine's own OpenMP threads: a
100M-parameter training step right after a completion request took about twice as long on 2 cores
(benchmarks/results/quiet_readers.md).

A reader here waits on the writer's zmq signal at once, as vLLM's own readers do after their second, but never for
long (`poll_bound_ms`): vLLM's signal can be lost (its publisher drops a signal while the one before is still
queued, so a reader that never spins can sleep past a message: seen here as an engine hung mid-request), and the
reader's loop checks the queue again after each wait. The bound grows with the time since the last message: a
millisecond while messages come often, up to `LAST_POLL_MS` when idle, so a lost signal costs little either way.

The plan marks every vLLM CPU engine (`protocol.QUIET_READERS`); this module is a vLLM plugin (entry point
`vllm.general_plugins`), which vLLM calls in each of its processes: it changes the readers only where the marker is
set and only if this vLLM has the class.
"""
from __future__ import annotations

import os
import time
from typing import Mapping

from dualrun.contract.protocol import QUIET_READERS

BUSY_LOOP_S = 0.02     # a reader spins this long after a message (vLLM: 1 s): the next of a burst comes soon
FIRST_POLL_MS = 1    # the first wait after that
LAST_POLL_MS = 50    # the longest wait between two checks of an idle queue
IDLE_SHARE = 0.1     # a wait is at most this share of the time since the last message


def poll_bound_ms(idle_s: float, asked_ms: int | None) -> int:
    """Pure: how long a reader idle for `idle_s` waits for a signal before it checks the queue again (never longer
    than the `asked_ms` of vLLM's own read timeout; None: none)."""
    bound = int(min(LAST_POLL_MS, max(FIRST_POLL_MS, idle_s * 1000 * IDLE_SHARE)))
    return bound if asked_ms is None else max(0, min(bound, int(asked_ms)))


def apply(env: Mapping[str, str] = os.environ) -> bool:
    """Make this process's `SpinCondition` readers sleep between checks, if `env` marks the engine; whether it did."""
    if env.get(QUIET_READERS) != "1":
        return False
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:   # a vLLM without the class: its readers do not spin this way
        return False
    if getattr(SpinCondition, "_dualrun_quiet", False):   # vLLM loads its plugins more than once per process
        return True
    init, wait = SpinCondition.__init__, SpinCondition.wait

    def quiet_init(self, *args, **kwargs) -> None:  # noqa: ANN001 - vLLM's signature
        init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = BUSY_LOOP_S   # after it, vLLM's wait polls its signal socket instead of yielding

    def quiet_wait(self, timeout_ms: int | None = None) -> None:  # noqa: ANN001 - vLLM's signature
        if not self.is_reader:
            return wait(self, timeout_ms)
        return wait(self, poll_bound_ms(time.monotonic() - self.last_read, timeout_ms))

    SpinCondition.__init__, SpinCondition.wait = quiet_init, quiet_wait
    SpinCondition._dualrun_quiet = True
    return True
