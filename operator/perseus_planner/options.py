"""Execution options of one computation: which clock gives which (time, energy).

The recipe is the one the Perseus artifact used to produce its published
frontiers, so results are comparable:

1. keep the Pareto-optimal (time, energy) measurements,
2. floor-quantize time to integer multiples of the unit time,
3. among options with equal quantized time keep the highest energy (its real
   time is the closest to the quantized one, since quantization rounds down),
4. when three or fewer options survive, filter again with a 5% tolerance so the
   cost model has enough points to be fit,
5. subtract the blocking power over the option's time: the solver then minimizes
   the *effective* energy, and blocking energy is added back for the whole
   iteration (every GPU draws at least blocking power while it waits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from perseus_api.profile import Measurements
from perseus_planner.errors import SolverError

SOFT_FILTER_TOLERANCE = 0.95
"""Noise factor of the second, softer Pareto filter."""

MIN_OPTIONS_BEFORE_SOFT_FILTER = 3


@dataclass(frozen=True)
class ExecutionOptions:
    """Candidate options of one computation, by quantized time, slowest first.

    Attributes:
        quant_times: Integer durations in units of ``unit_time_s``, strictly decreasing.
        energies_j: Measured energy of each option.
        costs_j: Effective energy (energy minus blocking power over the quantized time).
        frequencies_mhz: SM clock of each option.
        unit_time_s: The time quantum.
    """

    quant_times: npt.NDArray[np.int64]
    energies_j: npt.NDArray[np.float64]
    costs_j: npt.NDArray[np.float64]
    frequencies_mhz: npt.NDArray[np.int64]
    unit_time_s: float

    @property
    def min_quant_time(self) -> int:
        return int(self.quant_times[-1])

    @property
    def max_quant_time(self) -> int:
        return int(self.quant_times[0])

    def frequency_for(self, quant_time: int) -> int:
        """The slowest clock whose quantized time fits in ``quant_time`` (fastest if none)."""
        fitting = np.nonzero(self.quant_times <= quant_time)[0]
        return int(self.frequencies_mhz[fitting[0] if len(fitting) else -1])


def _quantize(time_s: float, unit_time_s: float) -> int:
    # Python's float floor division, exactly as the artifact quantized times.
    return int(time_s // unit_time_s)


def pareto_filter(
    rows: list[tuple[float, float, int]], noise_factor: float
) -> list[tuple[float, float, int]]:
    """The ``(time, energy, frequency)`` rows that no other row beats on both, in their order.

    Row ``r`` is dropped when some row ``o`` has ``o.time < r.time * noise_factor`` and
    ``o.energy < r.energy * noise_factor`` (the artifact's rule, ties kept). Instead of
    comparing every pair (a 25,000-clock profile took a minute), rows are sorted by time
    once: the rows faster than ``r.time * noise_factor`` are a prefix of that order, found
    by binary search, and ``r`` is dominated iff the least energy in the prefix is below
    ``r.energy * noise_factor``. O(n log n), and the same float comparisons as the pairwise
    rule, so the same rows survive.
    """
    if not rows:
        return []
    times_s = np.array([r[0] for r in rows], dtype=np.float64)
    energies_j = np.array([r[1] for r in rows], dtype=np.float64)
    order = np.argsort(times_s, kind="stable")
    least_energy_j = np.minimum.accumulate(energies_j[order])
    # Rows strictly faster than each row's threshold: side="left" excludes equal times.
    faster = np.searchsorted(times_s[order], times_s * noise_factor, side="left")
    best_faster_j = least_energy_j[np.maximum(faster - 1, 0)]
    dominated = (faster > 0) & (best_faster_j < energies_j * noise_factor)
    return [r for r, drop in zip(rows, dominated.tolist(), strict=True) if not drop]


def _candidates(
    m: Measurements, unit_time_s: float, noise_factor: float
) -> list[tuple[int, float, int]]:
    """(quant_time, energy, frequency) after Pareto filter, quantization and dedupe."""
    rows = list(
        zip(m.times_s.tolist(), m.energies_j.tolist(), m.frequencies_mhz.tolist(), strict=True)
    )
    rows.sort(key=lambda r: r[0], reverse=True)  # stable, like the artifact
    pareto = pareto_filter(rows, noise_factor)
    pareto.sort(key=lambda r: r[1], reverse=True)
    kept: dict[int, tuple[int, float, int]] = {}
    for time_s, energy_j, freq in pareto:
        q = _quantize(time_s, unit_time_s)
        kept.setdefault(q, (q, energy_j, freq))
    return sorted(kept.values(), key=lambda r: r[0], reverse=True)


def build_options(m: Measurements, unit_time_s: float, blocking_power_w: float) -> ExecutionOptions:
    """Turn raw measurements of one computation into solver options.

    Raises:
        SolverError: When the unit time or blocking power is invalid, or when
            quantization leaves fewer than two distinct durations (the unit time
            is too coarse for this computation).
    """
    if not unit_time_s > 0 or not np.isfinite(unit_time_s):
        raise SolverError(f"unit time must be a positive number of seconds, got {unit_time_s}")
    if not blocking_power_w >= 0 or not np.isfinite(blocking_power_w):
        raise SolverError(f"blocking power must be >= 0 W, got {blocking_power_w}")
    rows = _candidates(m, unit_time_s, 1.0)
    if len(rows) <= MIN_OPTIONS_BEFORE_SOFT_FILTER:
        rows = _candidates(m, unit_time_s, SOFT_FILTER_TOLERANCE)
    if len(rows) < 2:
        raise SolverError(
            f"only {len(rows)} distinct duration(s) remain after quantizing to "
            f"{unit_time_s} s; use a smaller unit time"
        )
    quant = np.array([r[0] for r in rows], dtype=np.int64)
    energies = np.array([r[1] for r in rows], dtype=np.float64)
    # Same operation order as the artifact (power * quant_time * unit) for equal rounding.
    costs = np.array([e - blocking_power_w * q * unit_time_s for q, e, _ in rows], dtype=np.float64)
    return ExecutionOptions(
        quant_times=quant,
        energies_j=energies,
        costs_j=costs,
        frequencies_mhz=np.array([r[2] for r in rows], dtype=np.int64),
        unit_time_s=unit_time_s,
    )
