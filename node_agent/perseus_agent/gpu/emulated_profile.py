"""How long an emulated GPU takes, and how much power it draws, per a Perseus profile.

:class:`ProfileModel` is the physics of :mod:`perseus_agent.gpu.emulated`: the SM clocks a
profile measured, each (stage, instruction)'s time and power at a clock (the nearest
profiled clock when that one was not measured for it), which activities the profile knows,
and the GPU's name. It holds no state: the backend owns the GPUs' clocks, activities and
energy counters (:mod:`perseus_agent.gpu.emulated_state`) and asks this model about them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perseus_agent.gpu.emulated_state import Activity
from perseus_api.profile import INSTRUCTIONS, Profile

# Numeric-format suffix of bundled profile names (``gpt3-175b+a100_sxm_bf16``).
_DTYPE_SUFFIX_RE = re.compile(r"_(?:bf16|fp16|fp32|tf32|fp8|int8)$", re.IGNORECASE)


@dataclass(frozen=True)
class _Measurement:
    time_s: float
    energy_j: float

    @property
    def power_w(self) -> float:
        return self.energy_j / self.time_s


@dataclass(frozen=True)
class _Table:
    """Measurements of one (stage, instruction) by clock."""

    by_clock_mhz: dict[int, _Measurement] = field(default_factory=dict)

    def at(self, clock_mhz: int) -> _Measurement:
        row = self.by_clock_mhz.get(clock_mhz)
        if row is None:
            nearest = min(self.by_clock_mhz, key=lambda c: (abs(c - clock_mhz), -c))
            row = self.by_clock_mhz[nearest]
        return row


class ProfileModel:
    """Time and power of each (stage, instruction) of ``profile`` at each SM clock.

    Raises:
        ValueError: ``profile`` is not a :class:`Profile` or has no measurements.
    """

    def __init__(self, profile: Profile) -> None:
        if not isinstance(profile, Profile):
            raise ValueError(f"profile must be a Profile, got {type(profile).__name__}")
        if not profile.measurements:
            raise ValueError(f"profile {profile.source!r} has no measurements")
        self.profile = profile
        self.clocks_mhz = [int(f) for f in profile.frequencies_mhz]
        """Profiled SM clocks, highest first."""
        self.clock_set = frozenset(self.clocks_mhz)
        self.max_clock_mhz = self.clocks_mhz[0]
        self._tables: dict[Activity, _Table] = {}
        for (stage, instruction), m in profile.measurements.items():
            self._tables[(stage, instruction)] = _Table(
                {
                    int(f): _Measurement(float(t), float(e))
                    for f, t, e in zip(m.frequencies_mhz, m.times_s, m.energies_j, strict=True)
                }
            )
        self.gpu_name = f"Emulated {gpu_model(profile.source)} ({Path(profile.source).stem})"

    def time_s(self, activity: Activity, clock_mhz: int) -> float:
        """The profiled time of ``activity`` at ``clock_mhz`` (or the nearest profiled clock)."""
        return self._tables[activity].at(clock_mhz).time_s

    def power_w(self, activity: Activity, clock_mhz: int) -> float:
        """The profiled average power of ``activity`` at ``clock_mhz`` (or the nearest)."""
        return self._tables[activity].at(clock_mhz).power_w

    @property
    def max_power_w(self) -> float:
        """The highest average power of any (stage, instruction) at any profiled clock."""
        return max(m.power_w for t in self._tables.values() for m in t.by_clock_mhz.values())

    def capped_clock_mhz(self, activity: Activity, clock_mhz: int, limit_w: float) -> int:
        """The clock ``activity`` runs at when ``clock_mhz`` is asked for under a power limit of
        ``limit_w``: its highest profiled clock not above ``clock_mhz`` whose power fits the
        limit, else its lowest (the firmware throttles no further), as the uniform-cap baseline
        of ``perseus simulate --power-budget`` does (``JobModel.capped_clocks``)."""
        by_clock = self._tables[activity].by_clock_mhz
        lowest = min(by_clock)
        for clock in sorted(by_clock, reverse=True):
            if clock <= clock_mhz and by_clock[clock].power_w <= limit_w:
                return clock
        return min(lowest, clock_mhz)

    def activity(self, stage: int | None, instruction: str | None) -> Activity | None:
        """``(stage, instruction)`` checked against the profile; ``None`` for both: idle.

        Raises:
            ValueError: only one is ``None``, or the stage or instruction is not profiled.
        """
        if stage is None and instruction is None:
            return None
        if stage is None or instruction is None:
            raise ValueError(
                f"stage and instruction must both be given or both be None, "
                f"got {stage!r} and {instruction!r}"
            )
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ValueError(f"stage must be an integer, got {stage!r}")
        if not 0 <= stage < self.profile.num_stages:
            raise ValueError(
                f"stage {stage} is not in the profile (stages 0..{self.profile.num_stages - 1})"
            )
        if not isinstance(instruction, str) or instruction.lower() not in INSTRUCTIONS:
            raise ValueError(
                f"unknown instruction {instruction!r}; expected one of {', '.join(INSTRUCTIONS)}"
            )
        return (stage, instruction.lower())


def finite_number(value: Any, what: str) -> float:
    """``value`` as a float (raises ``ValueError`` naming ``what`` unless finite)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def slowdown_factor(value: Any) -> float:
    """``value`` as a straggler's slowdown factor (raises ``ValueError`` unless finite, >= 1)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 1.0
    ):
        raise ValueError(f"slowdown must be a finite number >= 1, got {value!r}")
    return float(value)


def gpu_model(source: str) -> str:
    """The GPU a profile was measured on, from a bundled-style name (``model+gpu_dtype.csv``)."""
    stem = Path(source).stem
    if "+" not in stem:
        return "GPU"
    gpu = _DTYPE_SUFFIX_RE.sub("", stem.rsplit("+", 1)[1])
    return gpu.upper().replace("_", "-") or "GPU"
