"""A gang: the placement groups and actors one part of a job holds on Ray, and their teardown in one place.

Why one class: the trainers' ranks, the separate roles' servers and the role-program groups each place bundles,
start one actor per bundle and must leave nothing behind (every actor killed, every placement group removed),
also after a signal or a half-done start. `stop()` is idempotent; calls on actors that are already gone are
ignored.
"""
from __future__ import annotations

from typing import Any, Callable

from dualrun.config.model import RayOptions
from dualrun.backends.ray.placement_groups import place


class Gang:
    """Placement groups (`pgs`) and actors (`actors`) that start and stop together."""

    def __init__(self, options: RayOptions, source: str, check: Callable[[], None] = lambda: None) -> None:
        self.options, self.source, self.check = options, source, check
        self.pgs: list[Any] = []
        self.actors: list[Any] = []

    def place(self, name: str, unit: str, bundles: list[dict[str, float]], *, what: str = "worker(s)",
              precheck: bool = True) -> Any:
        """A placed placement group (see `placement.place`), removed again by `stop()`."""
        pg = place(self.options, self.source, name, unit, bundles, what=what, check=self.check, precheck=precheck)
        self.pgs.append(pg)
        return pg

    def spawn(self, cls: Any, pg: Any, index: int, *args: Any, **options: Any) -> Any:
        """An actor of `cls` (a plain class or a `ray.remote` one) on bundle `index` of `pg`."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = cls if hasattr(cls, "options") else _remote_class(cls)
        actor = remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=index), **options).remote(*args)
        self.actors.append(actor)
        return actor

    def call_all(self, method: str, *args: Any, timeout: float | None = None) -> None:
        """`call_each` on every actor of the gang."""
        call_each(self.actors, method, *args, timeout=timeout)

    def drop(self, actor: Any, pg: Any) -> None:
        """Kill one of the gang's actors and remove one of its groups now (a replaced server's: its successor is
        placed afresh); the others stay. Ones the gang does not hold are left alone."""
        import ray

        if cluster_gone():
            return
        if any(a is actor for a in self.actors):
            self.actors[:] = [a for a in self.actors if a is not actor]
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if any(g is pg for g in self.pgs):
            self.pgs[:] = [g for g in self.pgs if g is not pg]
            _remove_each([pg])

    def stop(self) -> None:
        """Kill every actor and remove every placement group (idempotent). Not where the cluster is gone (its GCS
        does not answer): each call would wait 60 s for it and then end the driver (exit 1); Ray drops a job's
        actors and groups with its driver anyway."""
        import ray

        if (self.actors or self.pgs) and not cluster_gone():
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            _remove_each(self.pgs)
        self.actors.clear()
        self.pgs.clear()


GONE_PROBE_S = 0.5   # a refused connect answers at once; this bounds an unreachable host's


def cluster_gone() -> bool:
    """Whether the cluster this driver is connected to is gone: its GCS refuses or does not answer a TCP connect
    within GONE_PROBE_S (a signal to every process of an embedded cluster at once, as systemd's stop sends it; a
    dead head node). Measured: a `remove_placement_group` with the GCS gone waits 60 s, then Ray ends the process
    (exit 1, no summary). Not connected, or a Ray client's connection: not gone (the calls are the client's)."""
    import ray

    from dualrun.backends.ray.connect import reachable

    try:
        if not ray.is_initialized() or ray.util.client.ray.is_connected():
            return False
        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - no runtime context: nothing to probe
        return False
    return not reachable(address, timeout=GONE_PROBE_S)


def remove_groups(pgs: list[Any]) -> None:
    """Remove each placement group (best effort: one already removed is skipped); none where the cluster is gone
    (`cluster_gone`: each removal would wait 60 s for its GCS)."""
    if pgs and not cluster_gone():
        _remove_each(pgs)


def _remove_each(pgs: list[Any]) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already removed
            pass


_REMOTE: dict[type, Any] = {}


def _remote_class(cls: type) -> Any:
    """`ray.remote(cls)`, made once per class: a new remote class per actor is exported to the GCS again for every
    actor (Ray re-exports once per remote class and job), a cost that grew with the rank count."""
    import ray

    if cls not in _REMOTE:
        _REMOTE[cls] = ray.remote(cls)
    return _REMOTE[cls]


def call_each(actors: list[Any], method: str, *args: Any, timeout: float | None = None) -> None:
    """Call `method` on each actor (best effort: one already gone is skipped); wait at most `timeout` s for all
    (None: do not wait)."""
    import ray

    if actors and cluster_gone():   # no actor of a gone cluster answers: waiting would only use up `timeout`
        return
    refs = []
    for actor in actors:
        try:
            refs.append(getattr(actor, method).remote(*args))
        except Exception:  # noqa: BLE001 - an actor already gone needs no call
            pass
    if timeout is not None and refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
