"""Loading of per-stage GPU frequency profiles.

A profile lists, for every pipeline stage and every instruction (forward or backward pass of
one microbatch), how long the instruction takes and how much energy it draws at each GPU clock
that was measured. Every stage has a ``forward`` and a backward: ``backward``, or its two
halves ``backward_input`` and ``backward_weight`` (zero-bubble schedules run them apart), or
both. (Which stages and instructions a schedule needs: :mod:`perseus_planner.model_stages`.)
Two CSV layouts are accepted:

Simple form, one row per (stage, instruction, frequency)::

    stage,instruction,frequency,time,energy

Rich form, one row per GPU rank, as written by a profiler running on every GPU of a 3D-parallel
job (no ``stage`` column)::

    rank,dp_rank,pp_rank,tp_rank,instruction,frequency,time,energy

In the rich form the stage is ``pp_rank``. Data-parallel replicas run the same stage on the same
data shapes, so only replica ``dp_rank == 0`` is used; the other replicas' rows are validated but
otherwise ignored. All tensor-parallel ranks of a stage execute each instruction in lock step as
one GPU group, so the group's time is the slowest rank's time (max over ``tp_rank``) and its
energy is the sum over ``tp_rank``.

Columns may come in any order and extra columns are ignored (the rows are read by
:mod:`perseus_api.profile_csv`). Times are seconds, energies joules and frequencies MHz. Rows
are kept in file order because downstream code sorts stably and must reproduce the reference
results tie for tie.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from perseus_api.errors import ProfileError
from perseus_api.profile_csv import ProfileEntry, RowLimits, read_entries

__all__ = [
    "INSTRUCTIONS",
    "MAX_ENERGY_J",
    "Measurements",
    "Profile",
    "load_profile",
    "parse_profile",
]

INSTRUCTIONS: tuple[str, ...] = ("forward", "backward", "backward_input", "backward_weight")
"""Instruction names a profile may hold. The node agent's emulated GPU state file stores an
instruction by its index here, so names are only ever appended. ``backward_input`` and
``backward_weight`` are the two halves of a backward that zero-bubble schedules run apart."""

_SPLIT_BACKWARD = ("backward_input", "backward_weight")

MAX_ENERGY_J = 2**50 * 1e-6 / 16
"""Largest energy (J) of one measurement: the planner counts integer micro-joules below 2**50
and keeps a factor 16 of headroom (``perseus_planner.limits.MAX_CUT_ENERGY_J``, equal by test);
a larger value (7e7 J, 20 MWh, for one forward pass) is a unit mix-up or a corrupt row."""

# How many missing stages to name before eliding; a typo such as stage 1000 in an 8-stage
# profile would otherwise produce a thousand-entry message.
_MAX_LISTED_STAGES = 5


@dataclass(frozen=True, eq=False)
class Measurements:
    """Profiled options of one (stage, instruction): row ``i`` of each array is one clock.

    Rows are in file order. Arrays are made read-only so that the frozen dataclass is frozen
    all the way down. Equality is identity because element-wise array comparison has no single
    truth value.
    """

    frequencies_mhz: npt.NDArray[np.int64]
    times_s: npt.NDArray[np.float64]
    energies_j: npt.NDArray[np.float64]

    def __post_init__(self) -> None:
        frequencies_mhz = np.array(self.frequencies_mhz, dtype=np.int64)
        times_s = np.array(self.times_s, dtype=np.float64)
        energies_j = np.array(self.energies_j, dtype=np.float64)
        shapes = {frequencies_mhz.shape, times_s.shape, energies_j.shape}
        if len(shapes) != 1 or frequencies_mhz.ndim != 1:
            raise ValueError(
                "frequencies_mhz, times_s and energies_j must be 1-D arrays of equal length, "
                f"got shapes {frequencies_mhz.shape}, {times_s.shape}, {energies_j.shape}"
            )
        for array in (frequencies_mhz, times_s, energies_j):
            array.setflags(write=False)
        object.__setattr__(self, "frequencies_mhz", frequencies_mhz)
        object.__setattr__(self, "times_s", times_s)
        object.__setattr__(self, "energies_j", energies_j)

    def __len__(self) -> int:
        return int(self.frequencies_mhz.shape[0])


@dataclass(frozen=True, eq=False)
class Profile:
    """A validated profile: stages ``0..num_stages-1``, each with every instruction.

    Every (stage, instruction) has at least two distinct frequencies and no frequency twice.
    """

    source: str
    num_stages: int
    measurements: Mapping[tuple[int, str], Measurements]
    _frequencies_mhz: npt.NDArray[np.int64] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # A read-only view keeps callers from slipping unvalidated entries into a frozen profile.
        object.__setattr__(self, "measurements", MappingProxyType(dict(self.measurements)))
        if self.measurements:
            frequencies_mhz = np.unique(
                np.concatenate([m.frequencies_mhz for m in self.measurements.values()])
            )[::-1].copy()
        else:
            frequencies_mhz = np.empty(0, dtype=np.int64)
        frequencies_mhz.setflags(write=False)
        object.__setattr__(self, "_frequencies_mhz", frequencies_mhz)

    def __reduce__(
        self,
    ) -> tuple[type[Profile], tuple[str, int, dict[tuple[int, str], Measurements]]]:
        # Pickled to and from planner worker processes; a mappingproxy does not pickle.
        return (Profile, (self.source, self.num_stages, dict(self.measurements)))

    def get(self, stage: int, instruction: str) -> Measurements:
        """Return the measurements of ``instruction`` (case-insensitive) on ``stage``."""
        key = (stage, instruction.lower())
        try:
            return self.measurements[key]
        except KeyError:
            raise ProfileError(
                self.source, f"no measurements for stage {stage} instruction {instruction!r}"
            ) from None

    @property
    def frequencies_mhz(self) -> npt.NDArray[np.int64]:
        """Every frequency that appears anywhere in the profile, unique, highest first."""
        return self._frequencies_mhz

    @property
    def max_frequency_mhz(self) -> int:
        """The highest profiled frequency."""
        if self._frequencies_mhz.size == 0:
            raise ProfileError(self.source, "profile has no measurements")
        return int(self._frequencies_mhz[0])


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate the profile CSV at ``path``.

    Raises:
        ProfileError: the file cannot be read or its content is malformed.
    """
    source = os.fspath(path)
    try:
        # utf-8-sig because spreadsheet programs prepend a byte-order mark that would otherwise
        # become part of the first column name.
        text = Path(source).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ProfileError(source, f"cannot read profile: not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ProfileError(source, f"cannot read profile: {reason}") from exc
    return parse_profile(text, source)


def parse_profile(text: str, source: str) -> Profile:
    """Parse and validate profile CSV ``text``; ``source`` names it in error messages.

    Raises:
        ProfileError: the content is malformed.
    """
    limits = RowLimits(INSTRUCTIONS, MAX_ENERGY_J)
    entries = read_entries(text.removeprefix("\ufeff"), source, limits)
    return _build_profile(entries, source)


def _build_profile(entries: Sequence[ProfileEntry], source: str) -> Profile:
    if not entries:
        raise ProfileError(source, "profile has no data rows; at least one stage is required")

    by_key: dict[tuple[int, str], list[ProfileEntry]] = {}
    for entry in entries:
        by_key.setdefault((entry.stage, entry.instruction), []).append(entry)

    stages = sorted({stage for stage, _ in by_key})
    num_stages = stages[-1] + 1
    num_missing = num_stages - len(stages)
    if num_missing:
        missing = _first_missing(stages, _MAX_LISTED_STAGES)
        listed = ", ".join(map(str, missing))
        if num_missing > len(missing):
            listed += f", ... ({num_missing} in all)"
        noun = "stage" if num_missing == 1 else "stages"
        raise ProfileError(
            source,
            f"{noun} {listed} missing; stages must be numbered contiguously 0..{num_stages - 1}",
        )

    present: dict[int, set[str]] = {}
    for stage, instruction in by_key:
        present.setdefault(stage, set()).add(instruction)
    for stage in range(num_stages):
        _check_stage_instructions(stage, present[stage], source)

    measurements: dict[tuple[int, str], Measurements] = {}
    for (stage, instruction), rows in sorted(
        by_key.items(), key=lambda item: (item[0][0], INSTRUCTIONS.index(item[0][1]))
    ):
        # Duplicates were rejected while parsing, so the row count is the clock count.
        if len(rows) < 2:
            raise ProfileError(
                source,
                f"stage {stage} {instruction} has only one frequency "
                f"({rows[0].frequency_mhz} MHz); profile at least two clocks",
                rows[0].line,
            )
        measurements[(stage, instruction)] = Measurements(
            frequencies_mhz=np.array([r.frequency_mhz for r in rows], dtype=np.int64),
            times_s=np.array([r.time_s for r in rows], dtype=np.float64),
            energies_j=np.array([r.energy_j for r in rows], dtype=np.float64),
        )
    return Profile(source=source, num_stages=num_stages, measurements=measurements)


def _check_stage_instructions(stage: int, present: set[str], source: str) -> None:
    """Every stage needs a forward and a backward: whole (``backward``), split in two
    (``backward_input`` and ``backward_weight``, for zero-bubble schedules), or both."""
    if "forward" not in present:
        raise ProfileError(source, f"stage {stage} has no forward rows")
    halves = [name for name in _SPLIT_BACKWARD if name in present]
    if len(halves) == 1:
        other = next(name for name in _SPLIT_BACKWARD if name not in present)
        raise ProfileError(
            source, f"stage {stage} has {halves[0]} rows but no {other} rows; give both halves"
        )
    if "backward" not in present and not halves:
        raise ProfileError(
            source,
            f"stage {stage} has no backward rows (give backward, or backward_input and "
            "backward_weight)",
        )


def _first_missing(stages: Sequence[int], limit: int) -> list[int]:
    """The first ``limit`` numbers absent from sorted ``stages``, found without enumerating
    the whole range, which a typo such as stage 10**12 would make enormous."""
    missing: list[int] = []
    expected = 0
    for stage in stages:
        while expected < stage and len(missing) < limit:
            missing.append(expected)
            expected += 1
        if len(missing) >= limit:
            break
        expected = stage + 1
    return missing
