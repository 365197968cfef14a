"""The launcher's restart decision (``plait.fault.restart.decide``), case by case."""

from __future__ import annotations

from plait.fault.restart import decide

TIMEOUT = "CollectiveTimeout: collective 'gradient bucket 0' did not complete"


def test_repeating_the_same_failure_from_the_same_checkpoint_is_no_progress() -> None:
    prev = {"steps": 50, "saved": 40, "start": 40}
    d = decide(TIMEOUT, 2, 100, {"steps": 50, "saved": 40, "start": 40}, prev, 1.0)
    assert not d.restart and d.no_progress and "without new progress" in d.reason


def test_an_attempt_that_had_to_start_earlier_is_restarted() -> None:
    # the newest checkpoint (step 40) was damaged, so this attempt resumed at 20 and met a new fault at 21
    prev = {"steps": 50, "saved": 40, "start": 40}
    d = decide(TIMEOUT, 3, 100, {"steps": 21, "saved": 40, "start": 20}, prev, 1.0)
    assert d.restart and not d.no_progress


def test_new_steps_or_a_new_save_are_progress() -> None:
    prev = {"steps": 50, "saved": 40, "start": 40}
    assert decide(TIMEOUT, 2, 100, {"steps": 55, "saved": 40, "start": 40}, prev, 1.0).restart
    assert decide(TIMEOUT, 2, 100, {"steps": 50, "saved": 50, "start": 40}, prev, 1.0).restart


def test_what_a_restart_cannot_fix_is_not_restarted() -> None:
    assert not decide("ConfigError: bad key", 1, 100, {"steps": 5}, None, 1.0).restart
    assert "before completing one step" in decide(TIMEOUT, 0, 100, {"steps": 0}, None, 1.0).reason
    spent = decide(TIMEOUT, 3, 3, {"steps": 9, "saved": 5, "start": 0}, {"steps": 5, "saved": 0, "start": 0}, 1.0)
    assert not spent.restart and "restarts allowed" in spent.reason
