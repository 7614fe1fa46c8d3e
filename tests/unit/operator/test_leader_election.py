"""Leader election on a Lease: the pure decision, and the elector against an in-memory store
with the API server's conditional writes (a replace at a stale resource version is refused)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from perseus_operator.cluster.kube.lease_api import lease_object, lease_record
from perseus_operator.cluster.leader_election import (
    Elector,
    LeaseRecord,
    Observation,
    Timings,
    next_record,
    observe,
    released,
)
from perseus_operator.config import ConfigError, OperatorConfig

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
HELD = LeaseRecord("a", 15, T0, T0, 2, resource_version="7")


def decide(current: LeaseRecord | None, seen: Observation | None, identity: str, now_s: float):
    return next_record(current, seen, identity, now=T0, now_s=now_s, lease_duration_s=15)


def test_no_lease_is_created_for_the_first_replica() -> None:
    record = decide(None, None, "a", 0.0)
    assert record == LeaseRecord("a", 15, T0, T0, 0)


def test_the_holder_renews_and_keeps_its_acquire_time() -> None:
    later = T0 + timedelta(seconds=4)
    record = next_record(HELD, None, "a", now=later, now_s=0.0, lease_duration_s=15)
    assert record == replace(HELD, renew_time=later)


def test_a_standby_waits_while_the_lease_is_fresh_on_its_own_clock() -> None:
    seen = observe(HELD, None, 100.0)
    assert decide(HELD, seen, "b", 114.9) is None
    # An unchanged record seen again keeps its first sighting; only the taker's clock counts.
    assert observe(HELD, seen, 110.0) is seen


def test_a_standby_takes_over_a_lease_unrenewed_for_its_duration() -> None:
    seen = observe(HELD, None, 100.0)
    record = decide(HELD, seen, "b", 115.0)
    assert record is not None
    assert (record.holder, record.transitions, record.acquire_time) == ("b", 3, T0)
    assert record.resource_version == "7"  # the write is conditional on what was read


def test_a_renewal_restarts_the_standby_s_count() -> None:
    seen = observe(HELD, None, 100.0)
    renewed = replace(HELD, resource_version="8")
    seen = observe(renewed, seen, 114.0)
    assert seen == Observation("8", 114.0)
    assert decide(renewed, seen, "b", 120.0) is None


def test_a_released_lease_is_taken_at_once() -> None:
    gone = released(HELD, "a")
    assert gone is not None and gone.holder == ""
    record = decide(gone, None, "b", 0.0)
    assert record is not None and record.holder == "b"
    assert released(HELD, "b") is None  # only the holder releases


def test_a_lease_round_trips_through_its_api_object() -> None:
    obj = lease_object("perseus-system", "perseus-operator", HELD)
    assert obj["metadata"]["resourceVersion"] == "7"
    assert obj["spec"]["renewTime"] == "2026-12-01T12:00:00.000000Z"
    assert lease_record(obj) == HELD


class Store:
    """A Lease with the API server's optimistic concurrency."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0
        self.writes: list[str] = []
        self.down = False

    def get(self) -> LeaseRecord | None:
        if self.down:
            raise OSError("connection refused")
        return self.record

    def create(self, record: LeaseRecord) -> bool:
        if self.record is not None:
            return False
        return self._store(record)

    def update(self, record: LeaseRecord) -> bool:
        if self.down:
            raise OSError("connection refused")
        if self.record is None or record.resource_version != self.record.resource_version:
            return False
        return self._store(record)

    def _store(self, record: LeaseRecord) -> bool:
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        self.writes.append(record.holder)
        return True


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


TIMINGS = Timings(lease_duration_s=6, renew_deadline_s=4, retry_period_s=1)


def elector(store: Store, identity: str, clock: Clock) -> Elector:
    return Elector(store, identity, TIMINGS, clock=clock, sleep=clock.sleep)


def test_two_electors_one_leader_then_takeover_after_the_lease_duration() -> None:
    store, clock = Store(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_once() and not b.try_once()
    for _ in range(10):  # a keeps renewing: b never leads
        clock.sleep(1)
        assert a.try_once() and not b.try_once()
    # a dies: b takes over once it has seen the same record for the lease duration.
    died_at_s = clock.now_s
    b.acquire()
    assert store.record is not None and store.record.holder == "b"
    assert store.record.transitions == 1
    assert (
        TIMINGS.lease_duration_s
        <= clock.now_s - died_at_s
        <= (TIMINGS.lease_duration_s + TIMINGS.retry_period_s)
    )
    assert not a.try_once()  # a, back, finds b holding it


def test_a_race_to_take_the_lease_has_one_winner() -> None:
    store, clock = Store(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    stale = store.get()
    assert a.try_once()
    # b decided on the record read before a's write: its conditional write is refused.
    assert not store.create(LeaseRecord("b", 6, T0, T0, 0)) and stale is None
    assert not b.try_once()
    assert store.writes == ["a"]


def test_api_errors_are_failed_attempts_not_leadership() -> None:
    store, clock = Store(), Clock()
    store.down = True
    assert not elector(store, "a", clock).try_once()


def test_release_lets_a_standby_take_over_without_waiting() -> None:
    store, clock = Store(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_once() and not b.try_once()
    assert a.release()
    assert b.try_once()


@pytest.mark.parametrize(
    ("lease", "renew", "retry"), [(10, 10, 2), (10, 5, 5), (10, 12, 2), (10, 5, 0)]
)
def test_timings_out_of_order_are_refused(lease: float, renew: float, retry: float) -> None:
    env = {
        "PERSEUS_OPERATOR_LEASE_DURATION_S": str(lease),
        "PERSEUS_OPERATOR_RENEW_DEADLINE_S": str(renew),
        "PERSEUS_OPERATOR_RETRY_PERIOD_S": str(retry),
    }
    with pytest.raises(ConfigError, match="retry period < renew deadline < lease duration"):
        OperatorConfig.from_env(env)


def test_an_empty_identity_is_refused() -> None:
    with pytest.raises(ValueError, match="identity"):
        Elector(Store(), "", TIMINGS)


def test_the_leader_learns_at_once_that_another_replica_holds_the_lease() -> None:
    import threading

    store = Store()
    fast = Timings(lease_duration_s=0.5, renew_deadline_s=0.3, retry_period_s=0.01)
    a = Elector(store, "a", fast)
    assert a.try_once()
    lost: list[str] = []
    done = threading.Event()
    a.keep(lambda why: (lost.append(why), done.set()))
    assert store.record is not None
    store._store(replace(store.record, holder="b"))  # b took it (a was cut off meanwhile)
    assert done.wait(timeout=10)
    a.stop()
    assert lost == ["the Lease is held by 'b' now"]


def test_a_leader_whose_api_calls_hang_gives_up_at_its_renew_deadline() -> None:
    """A slow or half-reachable API server: the renewal's call hangs (as one answering just
    under each timeout, or dripping its answer). The renew deadline is kept all the same, by a
    watchdog, before a standby may take the Lease (issue 30, next cases)."""
    import threading

    class Hanging(Store):
        def __init__(self) -> None:
            super().__init__()
            self.hang = threading.Event()
            self.release = threading.Event()

        def get(self) -> LeaseRecord | None:
            if self.hang.is_set():
                self.release.wait()
            return super().get()

    store = Hanging()
    fast = Timings(lease_duration_s=1.0, renew_deadline_s=0.3, retry_period_s=0.05)
    a = Elector(store, "a", fast)
    assert a.try_once()
    lost: list[str] = []
    done = threading.Event()
    a.keep(lambda why: (lost.append(why), done.set()))
    store.hang.set()
    try:
        assert done.wait(timeout=10)  # it used to wait for the hung call, however long
        assert lost == ["not renewed for 0.3 s"]
    finally:
        store.release.set()
        a.stop()
    assert lost == ["not renewed for 0.3 s"]  # once
