"""The SLURM backend, all of it, in this one folder (it plugs in through the entry-point group `dualrun.backends`,
as an out-of-tree backend would): inside an allocation (`salloc`, `sbatch`) the trainer ranks run as one `srun`
step of N tasks and each separate role's engine replicas as their own `srun` steps on the nodes the plan gives
them. `BACKEND` is what the registry loads; the rest is imported only when a launch asks."""
from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "SlurmBackend"]


def __getattr__(attr: str) -> Any:
    """Lazy: an srun task importing `task` (the rank's shim) loads no driver-side code."""
    if attr in __all__:
        from dualrun.backends.slurm import slurm_backend

        return getattr(slurm_backend, attr)
    raise AttributeError(attr)
