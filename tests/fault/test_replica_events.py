"""The replica groups' record of failures, heals and steps with fewer groups (``plait.fault.replica_events``), from
torchft quorum results written out by hand: what three groups' processes make of one timeline, and the run's merge.

Timeline (3 groups): all start at step 0 (torchft's start agreement: no heal); group 2 dies and is gone from the
quorum at boundary 4; its replacement joins at boundary 7 while group 1 dies (one quorum: a leave and a join, which
a count of participants alone would miss), and heals; group 1's replacement joins at boundary 9 and heals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plait.config import ConfigError
from plait.fault.replica_events import QuorumRecorder, ReplicaEvents, combine, describe, group_of

A, B, C = "plait_replica_0:a", "plait_replica_1:b", "plait_replica_2:c"
B2, C2 = "plait_replica_1:b2", "plait_replica_2:c2"  # the replacements: new processes, new ids


def _quorum(ids: list[str], at_max: int, heal: bool = False) -> SimpleNamespace:
    return SimpleNamespace(replica_ids=ids, replica_world_size=len(ids), max_world_size=at_max, heal=heal)


def test_a_timeline_of_two_failures_and_two_heals() -> None:
    g0 = ReplicaEvents(0, 3, restarts=0)
    g0.quorum(_quorum([A, B], 2), 0, start=True)  # group 2 still starting: no failure, no join
    g0.quorum(_quorum([A, B, C], 3), 0, start=True)
    for step in range(1, 5):
        g0.trained(step, 3)
    g0.quorum(_quorum([A, B], 2), 4)
    for step in range(5, 8):
        g0.trained(step, 2)
    g0.quorum(_quorum([A, C2], 1), 7)  # group 1 gone, group 2's replacement healing
    g0.trained(8, 2)
    g0.trained(9, 2)
    g0.quorum(_quorum([A, B2, C2], 2), 9)
    g0.trained(10, 3)
    s0 = g0.summary()
    assert s0 == {"group": 0, "restarts": 0, "groups": 3, "failures": 2,
                  "left": [{"group": 2, "step": 4}, {"group": 1, "step": 7}], "heals": 2,
                  "healed": [{"step": 7, "count": 1, "groups": [2]}, {"step": 9, "count": 1, "groups": [1]}],
                  "fewer_groups_steps": 5, "fewer_groups": [[5, 9]]}
    # group 2's replacement: its own heal at 7, then group 1's departure and heal
    g2 = ReplicaEvents(2, 3, restarts=1)
    g2.quorum(_quorum([A, C2], 1, heal=True), 7)
    g2.trained(8, 2)
    g2.trained(9, 2)
    g2.quorum(_quorum([A, B2, C2], 2), 9)
    s2 = g2.summary()
    assert (s2["failures"], s2["heals"], s2["fewer_groups"]) == (0, 2, [[8, 9]])
    assert s2["healed"] == s0["healed"]
    run = combine([s0, ReplicaEvents(1, 3, restarts=1).summary(), s2])
    assert run == {"restarts": 2, **{k: v for k, v in s0.items() if k not in ("group", "restarts")}}
    assert describe(run) == ("2 replica failure(s) (group 2 at step 4, group 1 at step 7), 2 heal(s) (step 7, step 9), "
                             "5 step(s) with fewer than 3 groups")


def test_the_start_agreement_is_not_a_heal_and_foreign_ids_are_refused() -> None:
    events = ReplicaEvents(1, 2, restarts=0)
    events.quorum(_quorum([A, B], 2, heal=True), 0, start=True)  # init_sync at step 0: everyone at the max step
    assert events.summary()["heals"] == 0
    with pytest.raises(ConfigError, match="give each run a Lighthouse of its own"):
        group_of("someone_else:1234")


def test_the_recorder_keeps_the_last_quorum_and_passes_the_rest_through() -> None:
    client = SimpleNamespace(_quorum=lambda **kw: ("result", kw["step"]), should_commit=lambda: True)
    recorder = QuorumRecorder(client)
    assert recorder._quorum(step=3) == ("result", 3) and recorder.last == ("result", 3)
    assert recorder.should_commit() is True
