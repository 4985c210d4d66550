"""Which engine replicas behind the router take requests: pure state, no sockets (`router.py` drives it).

Why a table apart from the router: when a replica fails, what happens to it, to the requests on it and to the next
ones is the whole of the router's fault tolerance; kept here as plain data with the clock passed in, every rule is
unit-tested in milliseconds.

The rules. A replica is *in rotation* (it gets generation and scoring requests) or *out* of it, with the reason.
- It leaves at once when a request to it fails — the connection is refused or reset (`UNREACHABLE`), it answers a
  5xx (`STATUS`), it gives no answer within the role's `request_timeout_s` (`TIMEOUT`: a hung engine accepts and
  never answers) — or when its health probe fails (`PROBE`). The request goes to another replica.
- The router probes every replica's `/health` about once a second, in rotation or not. An out replica whose failure said it was down or sick
  (`UNREACHABLE`, `STATUS`, `PROBE`) is back after `RECOVER_PROBES` passing probes in a row. One out for `TIMEOUT`
  stays out until the launcher restores or replaces it: a hung engine may still answer `/health` (vLLM's API process
  answers it while its engine core hangs), so a passing probe proves nothing. So does one the launcher took out.
- The launcher (through the router's control endpoints) can `replace` a replica by a new engine at a new address
  (optionally *held*: kept out of rotation, even when healthy, until restored or until it completes its first
  weight update — a rollout replica that does not yet hold the trainer's weights), `restore` one (it is back once
  healthy) or `remove` one (out until restored).
- The weight-transfer *members* (every replica a weight-transfer call goes to) are the replicas not removed: a
  removed one (dead, about to be restarted) leaves, a replacement joins. Each change grows `membership`, the number
  the trainer's side compares before a sync: changed, it re-forms its weight-sync group with the members of now
  (dualrun/weightsync/trainer/vllm_client.py). A held replica is restored by the router once it has received an update and
  completed it (`weights_received`, `weights_finished`): from then on it serves the trainer's current weights.
- The weight-sync *group* is a snapshot of the members, changed only by a re-form: `/get_world_size` counts the
  members of now (`counted`), the `/init_weight_transfer_engine` that follows goes to those it counted (`forming`),
  and once every one of them answered it they are the group (`formed`). The group's calls (an update's start,
  receive and finish, leaving the group) go to the group's members that are still the same engines and still
  members (`in_group`). So a replica that joins while an update is open, or between the count and the init, gets
  none of that update's or that init's calls (a finish without its start would be refused): it waits, held, for
  the next re-form, which its join's `membership` change asks the trainer for. Before any group is formed the
  group's calls go to the members of now.
- From which of the trainer's steps an engine serves (`from_step`, for the launcher's lines when a replica joins;
  the trainer's requests carry their step, `protocol.STEP_HEADER`): a held one's, the step of the first weight
  update it received (known when it enters rotation); another's (a teacher), the step of the first request it
  answered (known only once the trainer asks: `step`, the latest step a request carried, says where it stood).
  None until then, or where the trainer's requests carry no step (its hook is not installed, no trainer trains).
- A *spare* slot (`SPARE` for its address: a replica the plan placed above the count started at launch) has no
  engine: out of rotation, no member, never probed. The launcher grows the role by `replace`-ing a spare with a new
  engine (held, like a restarted one, when it must first get the trainer's weights) and shrinks it by `retire`-ing
  a replica: out of rotation and of the weight-transfer group (the membership grows), a spare again.
- A 5xx from the only replica in rotation leaves it in: it is alive, and the answer reaches the client as one
  engine's would (so does a request's second 5xx: the request is at fault, not the replicas; `router.forward`).
  Nothing else is spared: the last replica unreachable or hung is an error, as with one engine.
- Leaving rotation for `TIMEOUT`, `PROBE`, `LAUNCHER` or a replacement aborts the requests in flight on it (they
  would never be answered, or are answered by an engine about to go); they are retried elsewhere. For
  `UNREACHABLE` they fail on their own, and for `STATUS` the engine is alive and may still answer them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Collection, Iterable, Mapping

UNREACHABLE = "unreachable"  # connection refused or reset: the engine is down
STATUS = "status"            # it answered a 5xx: alive, sick
TIMEOUT = "timeout"          # no answer within request_timeout_s: hung
PROBE = "probe"              # its health probe failed (refused, an error status, or no answer in time)
LAUNCHER = "launcher"        # taken out by the launcher
JOINING = "joining"          # swapped in by the launcher, not yet healthy (or held)
SPARE = "-"                  # the address of a slot with no engine (a spare replica, or one scaled down)

STICKY = frozenset({TIMEOUT, LAUNCHER})          # out until restored: passing probes do not bring it back
ABORTS = frozenset({TIMEOUT, PROBE, LAUNCHER})   # leaving rotation aborts the requests in flight on it
RECOVER_PROBES = 2
PROBE_INTERVAL_S = 1.0   # between two health probes of one engine (a router's of a replica, a set's of a lone server)
PROBE_TIMEOUT_S = 5.0    # a probe not answered by then fails (a busy engine still answers /health within it)

# What a row of the table says of a replica's health, for those outside the router (`judge`)
SERVING = "serving"          # in rotation
OUT = "out"                  # out of rotation: down or sick; its probes may bring it back
HUNG = "hung"                # accepts requests and never answers: only a restart brings it back
RESTARTING = "restarting"    # its launcher took it out, or swapped in a new engine not yet in rotation


def judge(row: "Replica | Mapping[str, Any]", out_for_s: float, request_timeout_s: float) -> str:
    """The one reading of a replica's health from its row (a `Replica`, or its `rows()` dict over HTTP), shared by
    the router's table and the launchers that watch it: `HUNG` when a request to it timed out, or its health
    probes have failed for `request_timeout_s` (`out_for_s`, as the watcher saw it; a stopped process answers
    nothing, an engine core can hang while its API answers). A failed probe alone is `OUT`: a busy engine may
    miss one or two."""
    get = row.get if isinstance(row, Mapping) else lambda key: getattr(row, key)
    if get("in_rotation"):
        return SERVING
    kind = get("kind")
    if kind in (LAUNCHER, JOINING):
        return RESTARTING
    if kind == TIMEOUT or (kind == PROBE and out_for_s >= request_timeout_s):
        return HUNG
    return OUT


@dataclass
class Replica:
    """One slot behind the router. The counters belong to the slot (they go on across a replacement);
    `incarnation` grows with each replacement, so a failure of a request to the old engine spares the new one."""

    address: str
    in_rotation: bool = True
    kind: str | None = None        # why it is out (one of the kinds above)
    reason: str | None = None      # the same in words
    out_since: float | None = None
    hold: bool = False             # kept out until restored (or its first completed weight update), even when healthy
    member: bool = True            # in the weight-transfer group: gets every weight-transfer call
    received: bool = False         # a weight update reached this engine (since its replacement)
    from_step: int | None = None   # the trainer's step from which this engine serves (since its replacement)
    passes: int = 0                # passing health probes in a row while out
    incarnation: int = 0
    requests: int = 0              # every forwarded call
    served: int = 0                # generation, scoring and weight-transfer calls (what the replica is there for)
    in_flight: int = 0
    errors: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def spare(self) -> bool:
        """No engine stands in this slot (not started, or retired): never probed, never a member."""
        return self.address == SPARE


@dataclass(frozen=True)
class Event:
    """A change of rotation: one line for the router's log, and whether the requests in flight on the replica are
    to be aborted and retried elsewhere."""

    index: int
    line: str
    abort: bool = False


class Rotation:
    """The replicas behind one router and which of them take requests."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self.replicas = [Replica(a) if a != SPARE else Replica(a, in_rotation=False, kind=LAUNCHER, member=False,
                                                               reason="spare: no engine started")
                         for a in addresses]
        if not any(not r.spare for r in self.replicas):
            raise ValueError("the router needs at least one replica address")
        self.membership = 0    # grows with each replacement: the weight-transfer group's members changed
        self.group: tuple[tuple[int, int], ...] | None = None      # (index, incarnation) the group was formed with
        self._counted: tuple[tuple[int, int], ...] | None = None   # the members the last world size counted
        self.step: int | None = None   # the trainer's global step its latest request carried (`heard`)
        self._next = 0

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def in_rotation(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.in_rotation]

    def members(self) -> list[int]:
        """The replicas every weight-transfer call goes to: all but the removed ones, in rotation or not (a dead
        one not yet removed makes the call fail, as with one engine; a held one is there to receive the weights)."""
        return [i for i, r in enumerate(self.replicas) if r.member]

    # -- the weight-sync group: one snapshot of the members, changed only between a finish and the next init ------
    def counted(self) -> list[int]:
        """`/get_world_size`: the members of now, kept for the init that follows (it forms the group with them)."""
        self._counted = self._snapshot()
        return [i for i, _ in self._counted]

    def forming(self) -> list[int]:
        """The members an init goes to: those the last world size counted that are still the same engines and still
        members (one that joined since waits for the next re-form); the members of now when none was counted."""
        return self._still(self._counted) if self._counted is not None else self.members()

    def formed(self, indices: Iterable[int]) -> None:
        """Every one of `indices` answered the init: they are the group until the next init."""
        self.group = tuple((i, self.replicas[i].incarnation) for i in indices)
        self._counted = None

    def in_group(self) -> list[int]:
        """The replicas the group's calls go to: its members still the same engines and still members (a removed or
        replaced one leaves it at once, a new one joins only at the next init); before any init, the members."""
        return self._still(self.group) if self.group is not None else self.members()

    def _snapshot(self) -> tuple[tuple[int, int], ...]:
        return tuple((i, self.replicas[i].incarnation) for i in self.members())

    def _still(self, snapshot: Iterable[tuple[int, int]]) -> list[int]:
        return [i for i, incarnation in snapshot
                if self.replicas[i].member and self.replicas[i].incarnation == incarnation]

    def pick(self, exclude: Collection[int] = (), prefer: int | None = None) -> int | None:
        """The replica for the next attempt of a request: `prefer` when it is in rotation and not excluded, else the
        least busy one in rotation, ties round-robin (sequential requests still visit every replica); None when
        none is left."""
        usable = [i for i, r in enumerate(self.replicas) if r.in_rotation and i not in exclude]
        if not usable:
            return None
        if prefer in usable:
            return prefer
        n = len(self.replicas)
        start, self._next = self._next, (self._next + 1) % n
        return min(usable, key=lambda i: (self.replicas[i].in_flight, (i - start) % n))

    # -- what happened -------------------------------------------------------------------------------------------
    def fail(self, index: int, kind: str, detail: str, now: float, incarnation: int | None = None) -> Event | None:
        """A request to the replica failed (`UNREACHABLE`, `STATUS`, `TIMEOUT`). The event when it leaves rotation
        now; None when it was out already, the failure was its predecessor's, or it is the last one in rotation
        and answered a 5xx (it stays)."""
        r = self.replicas[index]
        if incarnation is not None and incarnation != r.incarnation:
            return None
        if not r.in_rotation:
            if kind in STICKY and r.kind not in STICKY:   # out for a probe, then found hung: now for good
                r.kind, r.reason, r.passes = kind, detail, 0
            return None
        if kind == STATUS and self.in_rotation() == [index]:
            return None
        return self._out(index, kind, detail, now)

    def probed(self, index: int, ok: bool, detail: str, now: float, incarnation: int | None = None) -> Event | None:
        """A health probe's result: a failed one takes the replica out; passing ones bring an out one back unless
        it is held or out for good."""
        r = self.replicas[index]
        if incarnation is not None and incarnation != r.incarnation:
            return None
        if not ok:
            r.passes = 0
            if r.in_rotation:
                return self._out(index, PROBE, detail, now)
            if r.kind not in STICKY:
                r.kind, r.reason = PROBE, detail
            return None
        if r.in_rotation:
            return None
        r.passes += 1
        return self._maybe_back(index, now)

    # -- the launcher's decisions --------------------------------------------------------------------------------
    def replace(self, index: int, address: str, now: float, hold: bool = False) -> Event:
        """A new engine at `address` takes the slot: out until it passes its probes, and, when `hold`, until
        restored. The membership grows (the weight-transfer group needs re-forming)."""
        r = self.replicas[index]
        old = r.address
        r.address, r.incarnation, r.hold, r.passes = address, r.incarnation + 1, hold, 0
        r.in_rotation, r.kind, r.out_since = False, JOINING, now
        r.member, r.received, r.from_step = True, False, None
        r.reason = "replaced, waiting for its health" + (" and its first weight update" if hold else "")
        self.membership += 1
        if old == SPARE:
            r.reason = "joining, waiting for its health" + (" and its first weight update" if hold else "")
            return Event(index, f"replica {index} joining at {address} ({r.reason}); {self._left()}", abort=True)
        return Event(index, f"replica {index} replaced: {old} -> {address} ({r.reason}); "
                            f"{self._left()}", abort=True)

    def remove(self, index: int, reason: str, now: float) -> Event | None:
        """Out until restored or replaced (it died and is being restarted, say), and out of the weight-transfer
        group: the next sync goes to the others."""
        r = self.replicas[index]
        if r.member:
            r.member = False
            self.membership += 1
        if not r.in_rotation:
            r.kind, r.reason, r.passes = LAUNCHER, reason, 0
            return None
        return self._out(index, LAUNCHER, reason, now)

    def retire(self, index: int, reason: str, now: float) -> Event:
        """The replica leaves for good (scaled down, or lost with enough others left): out of rotation and of the
        weight-transfer group, its slot a spare again (a later `replace` may fill it)."""
        r = self.replicas[index]
        old = r.address
        if r.member:
            self.membership += 1
        r.address, r.incarnation, r.member, r.hold, r.received, r.passes = SPARE, r.incarnation + 1, False, False, \
            False, 0
        r.from_step = None
        r.in_rotation, r.kind, r.reason, r.out_since = False, LAUNCHER, f"spare: {reason}", now
        # the requests in flight on it end on their own (answered, or failed and retried elsewhere: its
        # incarnation changed), so a replica resized away drains
        return Event(index, f"replica {index} ({old}) left: {reason}; {self._left()}")

    def restore(self, index: int, now: float) -> Event | None:
        """Back in rotation once healthy (at once when its last probes passed): ends a hold and a stay for good; a
        removed replica is a weight-transfer member again."""
        r = self.replicas[index]
        if r.spare:
            raise ValueError(f"replica {index} is a spare slot with no engine: replace it with one first")
        r.hold = False
        if not r.member:
            r.member = True
            self.membership += 1
        if r.in_rotation:
            return None
        if r.kind in STICKY:
            r.kind = PROBE
            r.reason = (r.reason or "") + "; restored, waiting for its health"
        return self._maybe_back(index, now)

    # -- the weight transfer ---------------------------------------------------------------------------------------
    def heard(self, step: int | None) -> None:
        """A request of the trainer's carried its global step (None: it carried none)."""
        if step is not None:
            self.step = step

    def served(self, index: int, step: int | None) -> None:
        """The replica answered a generation or scoring request of the trainer's `step`: the first since its
        replacement is the step it serves from (a held one's is its first weight update's)."""
        r = self.replicas[index]
        if r.from_step is None and not r.hold:
            r.from_step = step

    def weights_received(self, index: int, step: int | None = None) -> None:
        """The replica answered an `/update_weights` (of the trainer's `step`, when the request said it): it holds
        the weights of that update once it finishes it. A held one serves from that step."""
        r = self.replicas[index]
        if r.hold and not r.received:
            r.from_step = step
        r.received = True

    def weights_finished(self, index: int, now: float) -> Event | None:
        """The replica answered `/finish_weight_update`: a replica held for its weights that received this update
        is restored (back in rotation once healthy: it serves the trainer's current weights)."""
        r = self.replicas[index]
        if not (r.hold and r.received and r.member):
            return None
        r.hold = False
        r.reason = "holds the trainer's weights, waiting for its health"
        line = f"replica {index} ({r.address}) holds the trainer's weights (its first update completed)"
        event = self._maybe_back(index, now)
        return Event(index, line + "; " + (event.line if event else "in rotation once healthy"))

    # -- views ---------------------------------------------------------------------------------------------------
    def unavailable(self, exclude: Iterable[int] = ()) -> str:
        """Why the replicas out of rotation (but those in `exclude`) take no requests: each one's reason."""
        exclude = set(exclude)
        return "; ".join(f"replica {i} ({r.address}) out of rotation: {r.reason}" for i, r in enumerate(self.replicas)
                         if not r.in_rotation and i not in exclude)

    def rows(self) -> list[dict]:
        return [asdict(r) for r in self.replicas]

    # -- internals -----------------------------------------------------------------------------------------------
    def _out(self, index: int, kind: str, detail: str, now: float) -> Event:
        r = self.replicas[index]
        r.in_rotation, r.kind, r.reason, r.out_since, r.passes = False, kind, detail, now, 0
        return Event(index, f"replica {index} ({r.address}) out of rotation: {detail}; {self._left()}",
                     abort=kind in ABORTS)

    def _maybe_back(self, index: int, now: float) -> Event | None:
        r = self.replicas[index]
        if r.hold or r.kind in STICKY or r.passes < RECOVER_PROBES:
            return None
        out_for = now - (r.out_since if r.out_since is not None else now)
        r.in_rotation, r.kind, r.reason, r.out_since = True, None, None, None
        return Event(index, f"replica {index} ({r.address}) back in rotation after {out_for:.1f} s; {self._left()}")

    def _left(self) -> str:
        return f"{len(self.in_rotation())} of {sum(not r.spare for r in self.replicas)} in rotation"
