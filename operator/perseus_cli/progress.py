"""A one-line progress indicator for long solver runs (standard library only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

TTY_INTERVAL_S = 0.1
"""Redraws per second on a terminal stay at about ten: faster only costs solver time."""

LOG_INTERVAL_S = 5.0
"""Off a terminal every update is a new line of a log, so they come much less often."""


class Progress:
    """Shows ``done/expected steps, percent, elapsed time, rate`` on one line of ``stream``.

    On a terminal the line is redrawn in place; elsewhere (CI logs, files) each update is a
    separate line, written at most every ``LOG_INTERVAL_S``. The expected count is an estimate:
    if the work turns out longer, the total grows with it instead of passing 100 %.
    """

    def __init__(
        self,
        expected: int,
        stream: TextIO,
        label: str = "",
        *,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.expected = max(expected, 1)
        self.stream = stream
        self.label = label
        self._tty = _isatty(stream)
        default_interval_s = TTY_INTERVAL_S if self._tty else LOG_INTERVAL_S
        self._interval_s = default_interval_s if interval_s is None else interval_s
        self._clock = clock
        self._start_s = clock()
        self._last_draw_s = -float("inf")
        self._width = 0
        self._done = 0
        self._closed = False

    def update(self, done: int) -> None:
        """Record ``done`` steps; redraws only if the last draw is old enough."""
        self._done = done
        now_s = self._clock()
        if now_s - self._last_draw_s >= self._interval_s:
            self._last_draw_s = now_s
            self._draw(now_s)

    def close(self) -> None:
        """Draw the final state and end the line (so later output starts on a fresh one)."""
        if self._closed:
            return
        self._closed = True
        self._draw(self._clock())
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def line(self, now_s: float) -> str:
        """The text of the indicator at time ``now_s`` (of the same clock)."""
        total = max(self.expected, self._done)
        elapsed_s = max(now_s - self._start_s, 0.0)
        rate = self._done / elapsed_s if elapsed_s > 0 else 0.0
        prefix = f"{self.label}: " if self.label else ""
        return (
            f"{prefix}{self._done}/{total} steps {100.0 * self._done / total:5.1f}% "
            f"elapsed {format_duration(elapsed_s)} {rate:,.0f} steps/s"
        )

    def _draw(self, now_s: float) -> None:
        text = self.line(now_s)
        if self._tty:
            # Pad over the previous, possibly longer, text instead of relying on ANSI escapes.
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def format_duration(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a non-negative duration."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or stream-like objects without a terminal
        return False
