"""The hand-offs between an emulated job's pipeline stages, and the sleep that keeps them on
time.

A computation that a later one needs (the forward of microbatch ``m`` on stage ``s`` for stage
``s+1``, its backward for stage ``s-1``) is announced once its end is final, in its last
stretch; the rank that needs it sleeps until that end (:meth:`HandOffs.wait`), so that a
thread's wake-up does not add to every hand-off along the critical path. Each hand-off has one
waiter. :meth:`HandOffs.abort` wakes every waiter when the job is torn down.
:func:`sleep_until` makes up for the usual oversleep of ``time.sleep``; the computations of
:class:`perseus_emulation.job.job.EmulatedJob` sleep with it too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["AbortedError", "DepKey", "HandOffs", "sleep_until"]

# Oversleep compensation (see sleep_until): how fast the estimate follows, and its cap.
_SLACK_GAIN = 0.25
_MAX_SLACK_S = 0.001


class AbortedError(Exception):
    """Raised in a rank whose job is being torn down because of an error elsewhere."""


# (step, replica, stage, instruction, microbatch): one finished computation a later one needs.
DepKey = tuple[int, int, int, str, int]


class HandOffs:
    """The announced ends of the computations that other ranks wait on, and whether the job
    is being torn down (``aborted``: set once, under the lock, by :meth:`abort`)."""

    def __init__(self) -> None:
        # When each announced computation ends (time.monotonic()), for the rank that needs it.
        self._ends_s: dict[DepKey, float] = {}
        self._lock = threading.Lock()
        self._deps: dict[DepKey, threading.Event] = {}
        self.aborted = False

    def event(self, key: DepKey) -> threading.Event:
        """The event of ``key``, made on first use; already set once the job is aborted."""
        with self._lock:
            event = self._deps.get(key)
            if event is None:
                event = self._deps[key] = threading.Event()
                if self.aborted:
                    event.set()
            return event

    def signal(self, key: DepKey, end_s: float) -> None:
        """Announce that the computation ``key`` ends at ``end_s`` (``time.monotonic()``)."""
        event = self.event(key)
        with self._lock:
            self._ends_s[key] = end_s
        event.set()

    def ready(self, key: DepKey, event: threading.Event) -> bool:
        """Whether the computation ``key`` has ended (not only been announced)."""
        if not event.is_set():
            return False
        with self._lock:
            end_s = self._ends_s.get(key)
        return end_s is None or end_s <= time.monotonic()

    def wait(
        self, key: DepKey, event: threading.Event, slack_s: float, overheads: dict[str, float]
    ) -> float:
        """Wait until the computation ``key`` (its :meth:`event`) ends; each key has one
        waiter. Returns ``slack_s`` updated as :func:`sleep_until` does.

        The producer announces the end in its last stretch, a few milliseconds early, and this
        rank sleeps until then: on a real GPU the next stage starts when the data arrives, and
        a thread's wake-up (~0.2-1 ms on a loaded 2-core machine) would otherwise add to every
        hand-off along the critical path. A wait that blocked or slept counts as a hand-off in
        ``overheads``: from the end to now, what is left of the wake-up.
        """
        blocked = not event.is_set()
        event.wait()
        if self.aborted:
            raise AbortedError
        with self._lock:
            del self._deps[key]
            end_s = self._ends_s.pop(key, None)
        if end_s is None:
            return slack_s
        slept = end_s > time.monotonic()
        if slept:
            slack_s = sleep_until(end_s, slack_s)
            while time.monotonic() < end_s:  # woken early by the slack: never before the end
                time.sleep(0)
        if blocked or slept:
            overheads["handoffs"] += 1
            overheads["handoff_s"] += max(0.0, time.monotonic() - end_s)
        return slack_s

    def abort(self, first: Callable[[], None]) -> None:
        """Call ``first`` (recording the first error) under the lock, mark the job aborted and
        wake every waiter."""
        with self._lock:
            first()
            self.aborted = True
            events = list(self._deps.values())
        for event in events:
            event.set()


def sleep_until(end_s: float, slack_s: float) -> float:
    """Sleep until ``time.monotonic()`` is ``end_s``, waking ``slack_s`` early to make up for
    the usual oversleep of ``time.sleep``; returns ``slack_s`` updated with this oversleep."""
    delay_s = end_s - time.monotonic() - slack_s
    if delay_s > 0:
        time.sleep(delay_s)
        late_s = time.monotonic() - end_s
        slack_s = min(max(slack_s + _SLACK_GAIN * late_s, 0.0), _MAX_SLACK_S)
    return slack_s
