"""How the job's processes meet and how long they wait: what a launcher needs of the config, carried by the plan.

Why a record: a launcher is built from the plan and the program (TorchX's `AppDef` + scheduler shape); it reads
no config. Everything the config says about the rendezvous (which machine this is, of how many, machine 0's
address and port, the timeouts, the restart budget, the log directory) is read once, here, and the backend's
own section (`ray:`, `torchrun:`, or a plug-in's) travels as `options`, read only by that backend. Pure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rendezvous:
    """`master_addr`/`master_port`: main_process_ip/port as given (None: the launcher picks: loopback and a free
    port on one machine, torchrun's default port on several). `port_origin`: (file, key) a refusal of the port
    names (`--main_process_port` when it came as a flag). `options`: the backend's own config section."""

    backend: str
    source: str
    num_machines: int = 1
    machine_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    port_origin: tuple[str, str] = ("", "main_process_port")
    max_failures: int = 0
    log_dir: str | None = None
    per_machine: bool = False     # launched on every machine by hand (config/backends.py BackendKind)
    options: Any = None

    @property
    def several(self) -> bool:
        return self.num_machines > 1

    @property
    def address(self) -> str:
        """Machine 0's address as the machines dial it (loopback unless given)."""
        return self.master_addr or "127.0.0.1"


def rendezvous_of(cfg: Any) -> Rendezvous:
    """The config's rendezvous facts (a `config.model.JobConfig`), once."""
    from dualrun.config.backends import backend_object

    section = backend_object(cfg.backend).section   # the config section its launcher reads (a subclass's: its base's)
    options = (cfg.sections[section] if section in cfg.sections else getattr(cfg, section)) if section else None
    return Rendezvous(cfg.backend, cfg.source, cfg.num_machines, cfg.machine_rank, cfg.main_process_ip,
                      cfg.main_process_port, cfg.where("main_process_port"), cfg.max_failures, cfg.log_dir,
                      cfg.backend_kind.per_machine, options)
