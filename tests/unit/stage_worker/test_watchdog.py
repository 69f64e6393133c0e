"""The worker's watchdog: a guarded wait past its limit exits the process, nothing else does."""

from __future__ import annotations

import time

import pytest

from stage_worker.watchdog import Watchdog


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[Watchdog, FakeClock, list[int]]:
    clock, exits = FakeClock(), []
    dog = Watchdog(3, exits.append, clock)
    dog.stop()  # checked by hand below
    return dog, clock, exits


def test_a_wait_past_its_limit_exits_with_the_code() -> None:
    dog, clock, exits = make()
    with dog.guard("receiving the previous stage's activations", 10.0):
        clock.now += 9.9
        assert not dog.check() and exits == []
        clock.now += 0.2
        assert dog.check()
    assert exits == [3]


def test_time_outside_a_guard_never_counts() -> None:
    dog, clock, exits = make()
    with dog.guard("sending", 1.0):
        clock.now += 0.5
    clock.now += 3600.0  # idle between steps, however long
    assert not dog.check()
    with dog.guard("sending", 1.0):  # each wait has its own deadline
        clock.now += 0.5
        assert not dog.check()
    assert exits == []


def test_the_thread_exits_a_real_blocked_wait() -> None:
    exits: list[int] = []
    dog = Watchdog(3, exits.append)
    try:
        with dog.guard("a peer behind a cut link", 0.1):
            deadline = time.monotonic() + 5
            while not exits and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        dog.stop()
    assert exits == [3]


def test_a_renewed_wait_gets_its_limit_again_from_the_renewal() -> None:
    dog, clock, exits = make()
    with dog.guard("receiving the previous stage's activations", 10.0) as guard:
        clock.now += 9.0
        assert dog.renew(guard, 10.0)  # the neighbour is still stepping
        clock.now += 9.0
        assert not dog.check()
        clock.now += 1.1
        assert dog.check()
    assert exits == [3]


def test_a_renewal_after_its_wait_ended_arms_nothing() -> None:
    dog, clock, exits = make()
    with dog.guard("receiving", 1.0) as first:
        pass
    assert not dog.renew(first, 1.0)  # the thread saw the wait just before it ended
    clock.now += 3600.0
    assert not dog.check()
    with dog.guard("sending", 1.0):
        assert not dog.renew(first, 100.0)  # nor does it stretch the next wait
        clock.now += 1.1
        assert dog.check()
    assert exits == [3]


def test_an_expired_wait_exits_at_the_next_look_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dog, _, exits = make()
    with dog.guard("receiving", 1.0) as first:
        pass
    assert not dog.expire(first, "too late")  # its wait is over: nothing to end
    with dog.guard("receiving the previous stage's activations", 10.0) as guard:
        assert dog.expire(guard, "the controller took the pipeline down")
        assert dog.check()
    assert exits == [3]
    assert "activations (the controller took the pipeline down)" in caplog.text
