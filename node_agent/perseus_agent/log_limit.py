"""Rate limit for log messages a client can trigger at will.

A training process that runs its computations out of plan order, or a process flooding the
socket, would otherwise write one line per request: tens of thousands of lines that bury
everything else and cost the agent (and the node's log pipeline) more than the requests.
:class:`RateLimitedLog` writes the first ``burst`` messages of a kind, then counts the rest and
writes one summary with the count per ``interval_s``; the metrics still count every event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_BURST", "DEFAULT_INTERVAL_S", "RateLimitedLog"]

DEFAULT_BURST: Final = 10
DEFAULT_INTERVAL_S: Final = 60.0
_MAX_KEYS: Final = 1024
"""Kinds tracked at once; callers use a few fixed keys, this only bounds a misuse."""


@dataclass
class _Window:
    start_s: float
    logged: int = 0
    suppressed: int = 0


class RateLimitedLog:
    """Writes at most ``burst`` messages per ``key`` per ``interval_s``, plus one summary.

    The summary (how many were left out) is written with the first message of the next
    interval, so a storm that stops leaves its count for the next occurrence; the metric of
    the event is the complete record. Thread-safe.

    Args:
        logger: Where the messages go.
        burst: Messages written at the start of each interval.
        interval_s: Length of an interval, in seconds.
        clock: Monotonic clock, in seconds (tests pass a fake).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = DEFAULT_BURST,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1:
            raise ValueError(f"burst must be at least 1, got {burst}")
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: dict[Hashable, _Window] = {}

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` is over its budget; returns whether
        it was written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock()
        with self._lock:
            window = self._windows.get(key)
            suppressed = 0
            if window is None or now - window.start_s >= self.interval_s:
                if window is not None:
                    suppressed = window.suppressed
                elif len(self._windows) >= _MAX_KEYS:
                    self._windows.clear()
                window = self._windows[key] = _Window(start_s=now)
            write = window.logged < self.burst
            if write:
                window.logged += 1
            else:
                window.suppressed += 1
            last = write and window.logged == self.burst
        if suppressed:
            self.logger.log(
                level,
                "%d more message(s) like the next one left out of the log in the last %.0f s",
                suppressed,
                self.interval_s,
            )
        if last:
            self.logger.log(
                level,
                msg + " (further messages like this one: at most one summary per %.0f s)",
                *args,
                self.interval_s,
            )
        elif write:
            self.logger.log(level, msg, *args)
        return write

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def suppressed(self, key: Hashable) -> int:
        """Messages of ``key`` left out in its current interval (for tests)."""
        with self._lock:
            window = self._windows.get(key)
            return 0 if window is None else window.suppressed
