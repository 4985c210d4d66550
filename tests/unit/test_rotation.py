"""The router's rotation table (dualrun/programs/rotation.py): which replicas take requests after which failures,
what brings them back, the launcher's replace / restore / remove. Pure: the clock is passed in."""
from __future__ import annotations

import pytest

from dualrun.programs import rotation as rot
from dualrun.programs import routing
from dualrun.programs.rotation import Rotation

A, B, C = "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"


def _passes(table: Rotation, index: int, count: int, now: float = 10.0) -> list:
    return [table.probed(index, True, "ok", now) for _ in range(count)]


def test_pick_spreads_round_robin_then_by_load_and_skips_what_is_out_or_excluded():
    table = Rotation([A, B, C])
    assert [table.pick() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    table[0].in_flight = 2
    assert {table.pick() for _ in range(4)} == {1, 2}               # the least busy first
    assert table.pick(exclude={1, 2}) == 0
    assert table.pick(prefer=0) == 0 and table.pick(prefer=0, exclude={0}) in (1, 2)
    table.fail(1, rot.UNREACHABLE, "refused", 1.0)
    assert table.in_rotation() == [0, 2] and table.pick(prefer=1) != 1
    assert table.pick(exclude={0, 2}) is None
    assert table.members() == [0, 1, 2]                             # weight transfer: every replica, out or not
    table.remove(2, "died", 2.0)
    assert table.members() == [0, 1]                                # ... but a removed one


@pytest.mark.parametrize("kind, aborts", [(rot.UNREACHABLE, False), (rot.STATUS, False), (rot.TIMEOUT, True)])
def test_a_failed_request_takes_the_replica_out_at_once_with_one_line(kind, aborts):
    table = Rotation([A, B])
    event = table.fail(1, kind, "what happened", now=5.0)
    assert event is not None and event.index == 1 and event.abort is aborts
    assert event.line == f"replica 1 ({B}) out of rotation: what happened; 1 of 2 in rotation"
    assert table.in_rotation() == [0] and table[1].kind == kind and table[1].out_since == 5.0
    assert table.fail(1, kind, "again", now=6.0) is None            # out already: no second line
    assert table.unavailable() == f"replica 1 ({B}) out of rotation: what happened"
    assert table.unavailable(exclude={1}) == ""


def test_the_last_replica_in_rotation_stays_for_a_5xx_but_not_when_unreachable_or_hung():
    table = Rotation([A, B])
    table.fail(0, rot.UNREACHABLE, "refused", 1.0)
    assert table.fail(1, rot.STATUS, "answered 500", 2.0) is None and table.in_rotation() == [1]
    assert table.fail(1, rot.TIMEOUT, "no answer", 3.0) is not None and table.in_rotation() == []
    assert table.pick() is None


def test_a_down_or_sick_replica_is_back_after_two_passing_probes():
    table = Rotation([A, B])
    table.fail(1, rot.UNREACHABLE, "refused", now=1.0)
    assert table.probed(1, False, "refused", 2.0) is None and table[1].passes == 0
    assert table.probed(1, True, "ok", 3.0) is None                 # one pass is not enough
    assert table.probed(1, False, "refused", 4.0) is None           # ... and a miss starts the count again
    assert table.probed(1, True, "ok", 5.0) is None
    event = table.probed(1, True, "ok", 6.5)
    assert event is not None and not event.abort
    assert event.line == f"replica 1 ({B}) back in rotation after 5.5 s; 2 of 2 in rotation"
    assert table.in_rotation() == [0, 1] and table[1].reason is None


def test_a_failed_probe_takes_a_replica_out_and_aborts_its_requests():
    table = Rotation([A, B])
    assert table.probed(0, True, "ok", 1.0) is None                 # in rotation and healthy: nothing happens
    event = table.probed(0, False, "health probe not answered within 5 s", 2.0)
    assert event is not None and event.abort and table[0].kind == rot.PROBE
    assert all(e is None for e in _passes(table, 0, 1)) and _passes(table, 0, 1)[0] is not None


def test_a_hung_replica_stays_out_until_restored_even_when_its_probes_pass():
    table = Rotation([A, B])
    table.fail(0, rot.TIMEOUT, "gave no answer within 30 s", 1.0)
    assert _passes(table, 0, 5) == [None] * 5 and table.in_rotation() == [1]
    event = table.restore(0, now=9.0)                               # its last probes passed: back at once
    assert event is not None and table.in_rotation() == [0, 1]
    # out for a probe, then found hung by a request's timeout: hung wins
    table.probed(1, False, "refused", 10.0)
    assert table.fail(1, rot.TIMEOUT, "gave no answer", 11.0) is None and table[1].kind == rot.TIMEOUT
    assert _passes(table, 1, 3) == [None] * 3


def test_remove_keeps_a_replica_out_until_restored_then_it_needs_its_probes():
    table = Rotation([A, B])
    event = table.remove(1, "hung: the launcher stops it", 1.0)
    assert event is not None and event.abort and table[1].kind == rot.LAUNCHER
    assert table.remove(1, "again", 2.0) is None
    assert _passes(table, 1, 1) == [None]
    table[1].passes = 0
    assert table.restore(1, 3.0) is None                            # no passing probe since: wait for two
    assert _passes(table, 1, 2)[1] is not None and table.in_rotation() == [0, 1]


def test_replace_swaps_in_a_new_address_held_until_restored_and_ignores_the_old_engines_failures():
    table = Rotation([A, B])
    table.fail(1, rot.UNREACHABLE, "refused", 1.0)
    old = table[1].incarnation
    event = table.replace(1, C, now=2.0, hold=True)
    assert event.abort and event.line.startswith(f"replica 1 replaced: {B} -> {C} (replaced, waiting for its health "
                                                 "and its first weight update)")
    assert table[1].address == C and table.membership == 1 and table.in_rotation() == [0]
    assert table.fail(1, rot.UNREACHABLE, "the old engine's request failed", 3.0, incarnation=old) is None
    assert table.probed(1, False, "the old engine's probe", 3.0, incarnation=old) is None and table[1].passes == 0
    assert _passes(table, 1, 3) == [None] * 3                       # healthy, but held (no weights yet)
    event = table.restore(1, now=4.0)
    assert event is not None and table.in_rotation() == [0, 1] and table[1].hold is False
    # without hold: in once healthy; the counters go on across the replacement
    table[1].served = 7
    table.replace(1, B, now=5.0)
    assert table.membership == 2 and table[1].served == 7
    assert _passes(table, 1, 2)[1] is not None and table.in_rotation() == [0, 1]


def test_control_paths():
    assert routing.control("POST", "/router/replicas/2/replace") == (2, "replace")
    assert routing.control("POST", "/router/replicas/0/restore/") == (0, "restore")
    assert routing.control("GET", "/router/replicas/0/restore") is None
    assert routing.control("POST", "/v1/completions") is None
    for bad in ("/router/replicas/x/restore", "/router/replicas/1/reboot", "/router/replicas/1"):
        with pytest.raises(ValueError, match="expected POST /router/replicas/<index>/<replace|restore|remove>"):
            routing.control("POST", bad)


# -- the weight-transfer members and a held replacement (no replica serves stale weights) ------------------------------
def _sync(table: Rotation, now: float, finished: bool = True) -> list:
    """One weight update as the router sees it: every member answers /update_weights, then /finish_weight_update."""
    for i in table.members():
        table.weights_received(i)
    return [table.weights_finished(i, now) for i in table.members()] if finished else []


def test_a_dead_replica_leaves_the_weight_transfer_group_and_its_replacement_joins_held_until_its_first_update():
    table = Rotation([A, B])
    _passes(table, 0, 2)
    assert table.membership == 0 and _sync(table, 1.0) == [None, None]   # nobody held: no event
    table.fail(1, rot.UNREACHABLE, "refused", 2.0)
    assert table.membership == 0 and table.members() == [0, 1]    # out of rotation, still in the group
    table.remove(1, "died; being restarted", 2.1)                 # the launcher: the next sync goes without it
    assert table.membership == 1 and table.members() == [0] and table.in_rotation() == [0]
    assert _sync(table, 3.0) == [None]                            # a sync of the survivor alone
    table.replace(1, C, now=4.0, hold=True)
    assert table.membership == 2 and table.members() == [0, 1]    # joins the group: the trainer re-forms it
    assert table[1].received is False and table[1].member
    assert _passes(table, 1, 3, now=5.0) == [None] * 3 and table.in_rotation() == [0]   # healthy, held
    assert table.weights_finished(1, 6.0) is None                 # a finish without an update it received: held
    events = _sync(table, 7.0)
    assert events[0] is None and events[1] is not None and table.in_rotation() == [0, 1]
    assert events[1].line == (f"replica 1 ({C}) holds the trainer's weights (its first update completed); "
                              f"replica 1 ({C}) back in rotation after 3.0 s; 2 of 2 in rotation")
    assert table[1].hold is False and table.membership == 2       # the group stays as formed


def test_an_update_that_never_finishes_keeps_the_replacement_held_and_one_not_yet_healthy_waits_for_its_probes():
    table = Rotation([A, B])
    table.remove(1, "died", 1.0)
    table.replace(1, C, now=2.0, hold=True)
    _passes(table, 1, 2)
    _sync(table, 3.0, finished=False)                             # the broadcast failed before /finish
    assert table.in_rotation() == [0]
    other = Rotation([A, B])
    other.remove(1, "died", 1.0)
    other.replace(1, C, now=2.0, hold=True)
    event = _sync(other, 3.0)[1]                                  # weights before its probes passed
    assert event is not None and event.line.endswith("in rotation once healthy") and other.in_rotation() == [0]
    assert other[1].hold is False and _passes(other, 1, 2)[1] is not None and other.in_rotation() == [0, 1]


def test_remove_and_restore_change_the_membership_once_each():
    table = Rotation([A, B])
    table.remove(1, "stopping it", 1.0)
    table.remove(1, "again", 1.5)
    assert table.membership == 1
    _passes(table, 1, 2)
    table.restore(1, 2.0)
    assert table.membership == 2 and table.members() == [0, 1] and table.in_rotation() == [0, 1]


# -- the weight-sync group: one snapshot of the members, changed only by a re-form -----------------------------------
def test_the_group_is_the_snapshot_the_last_init_formed_and_a_join_waits_for_the_next_re_form():
    table = Rotation([A, B, rot.SPARE, rot.SPARE])
    assert table.group is None and table.in_group() == [0, 1]          # no group formed yet: the members of now
    assert table.counted() == [0, 1]                                   # /get_world_size
    table.formed(table.forming())                                      # the init every counted member answered
    assert table.group == ((0, 0), (1, 0)) and table.in_group() == [0, 1]
    # (1) a replica starts while an update is open: the rest of that update's calls stay with the group
    table.replace(2, C, now=1.0, hold=True)                            # after /start_weight_update
    assert table.membership == 1 and table.members() == [0, 1, 2] and table.in_group() == [0, 1]
    for i in table.in_group():                                         # /update_weights, /finish_weight_update
        table.weights_received(i)
        assert table.weights_finished(i, 2.0) is None
    assert table[2].hold and not table[2].received and table.in_rotation() == [0, 1]   # held: no weights yet
    # (2) the re-form its membership change asks for; another replica starts between the count and the init
    assert table.counted() == [0, 1, 2]
    table.replace(3, "127.0.0.1:9004", now=3.0, hold=True)
    assert table.membership == 2 and table.forming() == [0, 1, 2]       # the init goes to those counted
    table.formed(table.forming())
    assert table.in_group() == [0, 1, 2] and table.forming() == [0, 1, 2, 3]   # (counted once: next time, now's)
    for i in table.in_group():
        table.weights_received(i)
    _passes(table, 2, 2, now=4.0)
    events = [table.weights_finished(i, 5.0) for i in table.in_group()]
    assert events[2] is not None and table.in_rotation() == [0, 1, 2] and table[3].hold   # 3 waits, held
    # a member removed, retired or replaced leaves the group at once; its slot's new engine joins at the next init
    table.remove(0, "died", 6.0)
    table.retire(1, "scaled down", 6.0)
    assert table.in_group() == [2]
    table.replace(0, A, now=7.0, hold=True)
    assert table.in_group() == [2] and table.counted() == [0, 2, 3]
    table.remove(3, "died", 7.5)                                       # gone between the count and the init
    assert table.forming() == [0, 2]                                   # (its init then counts one worker less)


# -- from which of the trainer's steps a joining replica serves (the launcher's join line) ----------------------------
def test_a_held_replacement_serves_from_the_step_of_the_first_update_it_received():
    table = Rotation([A, B])
    table.heard(None)
    assert table.step is None                                     # a request with no step changes nothing
    table.heard(4)
    table.weights_received(0, 4)
    assert table[0].from_step is None                             # not held: a launch's replica has none
    table.replace(1, C, now=1.0, hold=True)
    _passes(table, 1, 2)
    table.served(1, 5)
    assert table[1].from_step is None                             # held: a request cannot reach it, nor count
    table.weights_received(1, 6)
    table.weights_received(1, 7)                                  # its first update is the one it serves from
    assert table.weights_finished(1, 2.0) is not None and table.in_rotation() == [0, 1]
    assert table[1].from_step == 6 and table.rows()[1]["from_step"] == 6
    table.retire(1, "scaled down", 3.0)
    assert table[1].from_step is None                             # a spare again: the next engine's is its own


def test_a_replacement_that_takes_no_weights_serves_from_the_step_of_the_first_request_it_answered():
    table = Rotation([A, rot.SPARE])
    table.heard(3)
    table.replace(1, B, now=1.0)
    _passes(table, 1, 2)
    assert table.in_rotation() == [0, 1] and table[1].from_step is None and table.step == 3   # asked nothing yet
    table.served(1, 4)
    table.served(1, 5)
    assert table[1].from_step == 4


def test_the_step_header_is_a_non_negative_integer_or_nothing():
    assert [routing.step_of(v) for v in ("12", " 0 ", None, "", "-1", "1.5", "x", "²")] == \
        [12, 0, None, None, None, None, None, None]
