"""One GPU's cumulative energy counter, sampled every few milliseconds and interpolated.

:class:`EnergySampler` reads the counter in a background thread into a bounded buffer. NVML
updates that counter coarsely (tens of milliseconds on some GPUs), far too coarsely to read it
at the beginning and end of a computation, so only the points where the counter changes are
kept and the energy at any moment is interpolated linearly between them
(:meth:`EnergySampler.energy_at`); :class:`perseus_agent.profiling.profiler.StageProfiler`
asks it for the energy of each computation. The time source and manual sampling
(``interval_s=None``) are arguments, so tests drive it deterministically.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Final

from perseus_agent.errors import GpuError

__all__ = ["DEFAULT_SAMPLE_CAPACITY", "DEFAULT_SAMPLE_INTERVAL_S", "EnergySampler"]

log = logging.getLogger(__name__)

DEFAULT_SAMPLE_INTERVAL_S: Final = 0.005
DEFAULT_SAMPLE_CAPACITY: Final = 1 << 16
"""Counter changes kept per GPU: about 5 minutes at the default interval."""


class EnergySampler:
    """Samples of one GPU's cumulative energy counter, interpolated linearly in between.

    Only the points where the counter changes are kept (the first time a new value is read),
    at the middle of the read, in a buffer of at most ``capacity`` points; the oldest go first.
    A counter that goes backwards (a reset) drops the history. Thread-safe.

    Args:
        read_energy_j: Reads the counter (e.g. ``lambda: backend.energy_j(index)``); raises
            :class:`GpuError` on failure.
        interval_s: Sampling period of the background thread; ``None`` for manual sampling
            only (:meth:`start` then does nothing; call :meth:`sample`).
        capacity: Points kept.
        time_ns: Time source, ``time.monotonic_ns`` as the local server's receipt times.
        name: Of the background thread, for logs.

    Raises:
        ValueError: ``interval_s`` or ``capacity`` is invalid.
    """

    def __init__(
        self,
        read_energy_j: Callable[[], float],
        *,
        interval_s: float | None = DEFAULT_SAMPLE_INTERVAL_S,
        capacity: int = DEFAULT_SAMPLE_CAPACITY,
        time_ns: Callable[[], int] = time.monotonic_ns,
        name: str = "perseus-energy-sampler",
    ) -> None:
        if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s}")
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {capacity}")
        self._read = read_energy_j
        self.interval_s = interval_s
        self.capacity = capacity
        self._time_ns = time_ns
        self._name = name
        self._lock = threading.Lock()
        self._times: list[int] = []
        self._energies: list[float] = []
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- sampling ------------------------------------------------------------------------------

    def sample(self) -> bool:
        """Read the counter once, now; ``False`` if the read failed (see :attr:`error`)."""
        before = self._time_ns()
        try:
            energy_j = float(self._read())
        except GpuError as exc:
            with self._lock:
                self._error = exc
            return False
        after = self._time_ns()
        self._add(before + (after - before) // 2, energy_j)
        return True

    def _add(self, t_ns: int, energy_j: float) -> None:
        with self._lock:
            if self._times:
                last_t, last_e = self._times[-1], self._energies[-1]
                if t_ns <= last_t or energy_j == last_e:
                    return  # not newer, or the counter has not been updated since
                if energy_j < last_e:
                    log.warning(
                        "%s: the energy counter went back from %.3f J to %.3f J; restarting",
                        self._name,
                        last_e,
                        energy_j,
                    )
                    self._times.clear()
                    self._energies.clear()
            self._times.append(t_ns)
            self._energies.append(energy_j)
            if len(self._times) >= 2 * self.capacity:
                del self._times[: -self.capacity]
                del self._energies[: -self.capacity]

    def start(self) -> None:
        """Sample every ``interval_s`` in a daemon thread until :meth:`stop` or a read fails."""
        if self.interval_s is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (if any) and wait for it; it does not start again.
        :meth:`sample` keeps working."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        assert self.interval_s is not None
        while not self._stop.is_set():
            try:
                ok = self.sample()
            except Exception as exc:  # a bug, not a GPU error: stop sampling, say why
                log.exception("%s: reading the energy counter failed", self._name)
                with self._lock:
                    self._error = exc
                ok = False
            if not ok:
                log.error("%s: stopped: %s", self._name, self.error)
                return
            self._stop.wait(self.interval_s)

    # -- queries -------------------------------------------------------------------------------

    @property
    def error(self) -> Exception | None:
        """Why the last read failed, if it did (the background thread then stops)."""
        with self._lock:
            return self._error

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def span(self) -> tuple[int, int] | None:
        """Times of the oldest and the newest point kept, if any."""
        with self._lock:
            return (self._times[0], self._times[-1]) if self._times else None

    def covers(self, t_ns: int) -> bool:
        """Whether a point at or after ``t_ns`` is kept (so :meth:`energy_at` can answer)."""
        with self._lock:
            return bool(self._times) and self._times[-1] >= t_ns

    def energy_at(self, t_ns: int) -> float | None:
        """The counter at ``t_ns``, interpolated; ``None`` outside the points kept."""
        with self._lock:
            times, energies = self._times, self._energies
            i = bisect.bisect_left(times, t_ns)
            if i < len(times) and times[i] == t_ns:
                return energies[i]
            if i == 0 or i == len(times):
                return None
            t0, t1 = times[i - 1], times[i]
            e0, e1 = energies[i - 1], energies[i]
            return e0 + (e1 - e0) * ((t_ns - t0) / (t1 - t0))
