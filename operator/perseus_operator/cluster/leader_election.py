"""Leader election on a ``coordination.k8s.io/v1`` Lease: one operator replica reconciles.

Why a Lease and not kopf's peering: kopf's peering is not leader election. Peers of equal
priority (every replica of one Deployment) all keep running, with a warning; a peer of higher
priority pauses the others only once its keep-alive is seen, so two replicas can handle the
same event. A Lease, taken and renewed with the API server's optimistic concurrency, is held
by one identity at a time, as kube-controller-manager's and every client-go controller's is.

Semantics (client-go's ``leaderelection``):

- a replica takes the Lease when there is none, when it is released (no holder), or when the
  holder has not renewed it for ``lease_duration_s`` *as measured on the taker's own clock*
  (since it last saw the record change; holders' clocks are never compared);
- the holder renews every ``retry_period_s``; if it cannot renew for ``renew_deadline_s``
  (< ``lease_duration_s``), or finds another holder, it has lost: the process must stop
  reconciling at once (``perseus-operator`` exits; Kubernetes restarts it as a standby). The
  gap between the two durations is the margin in which a cut-off leader stops before a
  standby may start;
- a leader that shuts down cleanly releases the Lease, so a standby takes over within
  ``retry_period_s`` instead of ``lease_duration_s``.

A leader killed without warning is replaced within ``lease_duration_s + retry_period_s``
(plus the new leader's start-up).

:func:`next_record` is the decision, pure; :class:`Elector` runs it against a
:class:`LeaseStore` (the Kubernetes I/O is
:class:`perseus_operator.cluster.kube.lease_api.LeaseApi`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Protocol

log = logging.getLogger("perseus_operator.cluster.leader_election")


@dataclass(frozen=True)
class LeaseRecord:
    """The spec of a Lease, and the version it was read at (empty: not yet stored)."""

    holder: str
    lease_duration_s: int
    acquire_time: datetime | None
    renew_time: datetime | None
    transitions: int
    resource_version: str = ""


@dataclass(frozen=True)
class Observation:
    """When (monotonic seconds, this process's clock) a record version was first seen."""

    resource_version: str
    seen_at_s: float


@dataclass(frozen=True)
class Timings:
    """Leader election durations, seconds (client-go's defaults)."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def check(self) -> None:
        """Raises ValueError unless 0 < retry period < renew deadline < lease duration."""
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period_s} s, {self.renew_deadline_s} s, {self.lease_duration_s} s"
            )


def observe(current: LeaseRecord, seen: Observation | None, now_s: float) -> Observation:
    """The observation of ``current``: kept while its version is unchanged, else new."""
    if seen is not None and seen.resource_version == current.resource_version:
        return seen
    return Observation(current.resource_version, now_s)


def next_record(
    current: LeaseRecord | None,
    seen: Observation | None,
    identity: str,
    *,
    now: datetime,
    now_s: float,
    lease_duration_s: float,
) -> LeaseRecord | None:
    """The record ``identity`` writes to take or renew the Lease; None: another replica holds it.

    Args:
        current: the stored record (None: no Lease yet).
        seen: when this replica first saw ``current``'s version (:func:`observe`).
        now: wall-clock time written into the record.
        now_s: monotonic seconds, compared with ``seen`` only.
        lease_duration_s: how long a record stays valid without renewal.
    """
    duration = max(1, round(lease_duration_s))
    if current is None:
        return LeaseRecord(identity, duration, now, now, 0)
    if current.holder == identity:
        return replace(current, lease_duration_s=duration, renew_time=now)
    expired = (
        seen is not None
        and seen.resource_version == current.resource_version
        and now_s - seen.seen_at_s >= current.lease_duration_s
    )
    if current.holder and not expired:
        return None
    return replace(
        current,
        holder=identity,
        lease_duration_s=duration,
        acquire_time=now,
        renew_time=now,
        transitions=current.transitions + 1,
    )


def released(current: LeaseRecord, identity: str) -> LeaseRecord | None:
    """The record that gives the Lease up (None: ``identity`` does not hold it)."""
    if current.holder != identity:
        return None
    return replace(current, holder="", lease_duration_s=1)


class LeaseStore(Protocol):
    """Reads and writes one Lease; writes are conditional on the record's resource version."""

    def get(self) -> LeaseRecord | None: ...

    def create(self, record: LeaseRecord) -> bool:
        """False: someone created it first."""
        ...

    def update(self, record: LeaseRecord) -> bool:
        """False: the Lease changed since ``record.resource_version`` was read."""
        ...


class Elector:
    """Takes, keeps and releases the Lease for ``identity``.

    :meth:`acquire` blocks until this replica leads; :meth:`keep` renews it in a daemon thread
    and calls ``on_lost`` once if leadership is lost; :meth:`release` gives it up.
    """

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        timings: Timings,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        timings.check()
        if not identity:
            raise ValueError("leader election needs a non-empty identity")
        self.store = store
        self.identity = identity
        self.timings = timings
        self._clock = clock
        self._wall_clock = wall_clock or _utc_now
        self._sleep = sleep
        self._seen: Observation | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self.last_attempt_s: float | None = None
        """When (``clock``) the last attempt ended, failed or not: a standby's sign of life
        (its health endpoint's, :mod:`perseus_operator.endpoints`)."""

    def try_once(self) -> bool:
        """One attempt to take or renew the Lease; True: this replica holds it now.

        API errors count as a failed attempt (logged), never as success.
        """
        try:
            return self._attempt()
        finally:
            self.last_attempt_s = self._clock()

    def _attempt(self) -> bool:
        try:
            current = self.store.get()
            now_s = self._clock()
            if current is not None:
                self._seen = observe(current, self._seen, now_s)
            record = next_record(
                current,
                self._seen,
                self.identity,
                now=self._wall_clock(),
                now_s=now_s,
                lease_duration_s=self.timings.lease_duration_s,
            )
            if record is None:
                return False
            if current is None:
                return self.store.create(record)
            if record.holder != current.holder:
                log.info("taking the Lease over from %r", current.holder or "(released)")
            return self.store.update(record)
        except Exception as exc:
            log.warning("leader election: %s", exc)
            return False

    def acquire(self) -> None:
        """Block until this replica holds the Lease (or :meth:`stop` is called)."""
        log.info("waiting to lead (Lease holder identity %s)", self.identity)
        while not self._stop.is_set():
            if self.try_once():
                log.info("leading as %s", self.identity)
                return
            self._sleep(self.timings.retry_period_s)

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew in the background; ``on_lost(reason)`` once when the Lease is lost.

        The renew deadline is kept by a watchdog of its own, not by the renew loop: an API
        server that answers slowly (each call just under its timeout, or dripping) holds the
        loop in a call for longer than the deadline, and a standby may take the Lease
        ``lease_duration_s`` after the last renewal whatever this replica is waiting for.
        """
        lock = threading.Lock()
        renewed_at_s = [self._clock()]
        lost = threading.Event()

        def lose(reason: str) -> None:
            with lock:
                if lost.is_set():
                    return
                lost.set()
            self._stop.set()
            on_lost(reason)

        def renew() -> None:
            while not self._stop.wait(self.timings.retry_period_s):
                if self.try_once():
                    with lock:
                        if not lost.is_set():
                            renewed_at_s[0] = self._clock()
                    continue
                current = self._current_holder()
                if current is not None and current != self.identity:
                    lose(f"the Lease is held by {current!r} now")
                    return

        def watchdog() -> None:
            while True:
                with lock:
                    left_s = renewed_at_s[0] + self.timings.renew_deadline_s - self._clock()
                if left_s <= 0:
                    lose(f"not renewed for {self.timings.renew_deadline_s:g} s")
                    return
                if self._stop.wait(left_s):
                    return

        self._thread = threading.Thread(target=renew, name="perseus-lease", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=watchdog, name="perseus-lease-dog", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        """Stop renewing (and waiting to lead)."""
        self._stop.set()
        for thread in (self._thread, self._watchdog):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=self.timings.retry_period_s + 5)

    def release(self) -> bool:
        """Stop renewing and give the Lease up; True if it was released."""
        self.stop()
        try:
            current = self.store.get()
            record = None if current is None else released(current, self.identity)
            return record is not None and self.store.update(record)
        except Exception as exc:
            log.warning("could not release the Lease (it expires by itself): %s", exc)
            return False

    def _current_holder(self) -> str | None:
        try:
            current = self.store.get()
        except Exception:
            return None
        return None if current is None else current.holder


def _utc_now() -> datetime:
    from datetime import UTC

    return datetime.now(UTC)
