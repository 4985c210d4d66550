"""A torch.distributed rendezvous of a role group's own: its workers can form a process group among themselves.

Why: ms-swift-style programs shard a sampler or reward model over the workers of one group (tensor parallel
vLLM, an all-gather of scores). Each worker gets torchrun's names for its group - RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT - so `torch.distributed.init_process_group()` with no
arguments joins its group. MASTER_ADDR is the node of the group's rank 0 (its placement bundle), the port one
that was free there, picked before any worker starts (as the Ray backend does for the trainer ranks).

Imported inside Ray tasks: no torch, no Ray at import time.
"""
from __future__ import annotations

from typing import Mapping

from dualrun.contract import protocol
from dualrun.role_programs.spec import GroupSpec


def group_env(rank: int, size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables worker `rank` of a group of `size` needs for `init_process_group()` within its group."""
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def member_env(common: Mapping[str, str], spec: GroupSpec, rank: int, master: tuple[str, int]) -> dict[str, str]:
    """What worker `rank` of group `spec` gets on either backend (a Ray actor, a local child process): the
    config's and the role's `env:`, its role and rank, and its group's rendezvous."""
    return {**common, **spec.env, protocol.ROLE: spec.name, protocol.GROUP_RANK: str(rank),
            protocol.GROUP_SIZE: str(spec.size), **group_env(rank, spec.size, *master)}
