"""What a server set reports when one of its servers ends (or stops answering) while the job runs: a value the
set, its supervisor and the launchers pass along, in a module of its own so that none of them imports another
for it."""
from __future__ import annotations

from dataclasses import dataclass

from dualrun.servers.process import ServerError


@dataclass(frozen=True)
class ServerDeath:
    """One server of the set ended (or stopped answering) while the job ran.

    `index`: its place in `plan.servers` (None: not one server, e.g. the machines' address exchange failed).
    `text`: the full error (its label, exit code or signal, its log's last lines); `str()` gives it.
    `node_gone`: its machine left the cluster (Ray: the node died or was drained), so it cannot be restarted
    there: it leaves its role (`Supervision.leaves`) or its death is the job's."""

    index: int | None
    label: str
    text: str
    line: str
    node_gone: bool = False

    @classmethod
    def of(cls, index: int | None, error: ServerError) -> "ServerDeath":
        return cls(index, error.label, str(error), error.one_line())

    def one_line(self) -> str:
        """Label, how it ended, and its log's last line: for the restart line."""
        return self.line

    def __str__(self) -> str:
        return self.text
