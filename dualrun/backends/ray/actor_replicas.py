"""The supervisor's primitives on Ray (supervisor.py's `Replicas`): one engine replica's actor and placement group
started afresh, looked at, stopped, given back.

Why apart from the set (actor_servers.py): these are the only steps that differ between a restart on the dead
replica's node, a spare that starts wherever the cluster has room (fleet_follow.py hands it the group Ray placed
when room appeared) and a replica that leaves (resized away, or its node gone: nothing of it may keep holding the
node's resources). `RayServers` mixes them in; they use its actors, groups, gangs and start calls.
"""
from __future__ import annotations

from typing import Any

from dualrun.servers.process import ServerError


class ActorReplicas:
    """`respawn`, `rearm`, `alive`, `kill` of `RayServers` (which gives every attribute used here)."""

    _actors: list[Any]
    _pg_of: list[Any]
    _gangs: list[Any]
    infos: list[Any]
    _joins: int

    def respawn(self, index: int, restart: int) -> str | None:
        """A restart (`restart` >= 1): a fresh actor in a fresh placement group on the dead replica's node (its old
        group removed first, so the node's resources it held are free: Ray gives the new one the same shape there).
        A spare that starts (0): on any node with room (the placement group room appeared in, fleet_follow.py; else
        one placed now, within `ray.placement_timeout_s`). The server on a fresh port, healthy. ServerError naming
        the replica when any step fails."""
        from dualrun.contract.errors import LaunchError

        label = self.plan.servers[index].label

        def check() -> None:
            if self.stopping:
                raise ServerError(label, "was being restarted when the job ended")

        with self._lock:
            if self.stopping:
                return None
            info = self.infos[index] if index < len(self.infos) else None
            gang = self.new_gang(check)
            self._gangs.append(gang)
            if not restart:
                self._joins += 1
        if info is not None:
            self.avoid.add(info.address)   # a fresh port, never the dead one's
        self._free(index)
        bundle = dict(self.bundle(self.plan.servers[index]))
        if restart and info is not None:
            bundle[f"node:{info.ip}"] = 0.001   # the same node
        room = None if restart else self.follower.take(self.plan.servers[index].unit)
        name = self._name(index, restart) + ("" if restart else f"-j{self._joins}")
        try:
            pg, actor = self._place_one(gang, index, bundle, name, room, precheck=bool(restart))
            with self._lock:
                if self.stopping:
                    gang.stop()
                    return None
                self._pg_of[index], self._actors[index] = pg, actor
            self._new_output.put(actor)
            address = self._start_phase([index], self.started, check)[index]
        except ServerError:
            raise
        except LaunchError as e:
            raise ServerError(label, "could not be restarted: " + str(e).splitlines()[0].removeprefix(label + " ")) \
                from None
        except Exception as e:  # noqa: BLE001 - a Ray error on the way: the job ends naming the replica
            raise ServerError(label, f"could not be restarted: {str(e).strip().splitlines()[0][:200]}") from None
        return address

    def _free(self, index: int) -> None:
        """Replica `index`'s actor (its server stopped first: the helpers its process group may have left, vLLM's
        engine core) killed and its placement group removed: nothing of it holds the node's resources."""
        import ray

        with self._lock:
            if index >= len(self._actors):
                return
            actor, pg = self._actors[index], self._pg_of[index]
            self._actors[index] = self._pg_of[index] = None
        if actor is None:
            return
        try:
            ray.get(actor.stop.remote(0), timeout=10)
        except Exception:  # noqa: BLE001 - a dead actor: nothing of it to stop
            pass
        for held in list(self._gangs):   # the first set's gang, or an earlier restart's
            held.drop(actor, pg)

    def rearm(self, index: int, address: str) -> bool:
        with self._lock:
            if self.stopping:
                return False
            self.started[index] = address
            self._exit_ref(index, self._actors[index])   # its next death is an event too
        return True

    def alive(self, index: int) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        actor = self._actors[index] if index < len(self._actors) else None
        if actor is None:   # a spare not started, or one given back
            return False
        try:
            return bool(ray.get(actor.alive.remote(), timeout=5.0))
        except (RayError, GetTimeoutError):
            return False

    def kill(self, index: int, grace_s: float) -> tuple[str, str | None]:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        self._exits.pop(self._exit_of.pop(index, None), None)   # its end is reported by the supervisor, as hung
        actor = self._actors[index] if index < len(self._actors) else None
        if actor is None:
            return "", None
        try:
            ray.get(actor.stop.remote(grace_s), timeout=grace_s + 10.0)
            tail = ray.get(actor.tail.remote(), timeout=10.0)
        except (RayError, GetTimeoutError):
            tail = "", None
        self._free(index)   # its actor and its placement group: a restart places fresh ones, a spare holds none
        return tail
