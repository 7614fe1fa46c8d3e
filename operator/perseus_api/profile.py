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

Columns may come in any order and extra columns are ignored. Times are seconds, energies joules
and frequencies MHz. Rows are kept in file order because downstream code sorts stably and must
reproduce the reference results tie for tie.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from perseus_api.errors import ProfileError

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

_SIMPLE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
_RICH_COLUMNS = (
    "rank",
    "dp_rank",
    "pp_rank",
    "tp_rank",
    "instruction",
    "frequency",
    "time",
    "energy",
)
_RANK_COLUMNS = frozenset(("rank", "dp_rank", "pp_rank", "tp_rank"))
_ACCEPTED_FORMS = (
    f"accepted forms are '{','.join(_SIMPLE_COLUMNS)}' (one row per stage) or "
    f"'{','.join(_RICH_COLUMNS)}' (one row per GPU rank)"
)

# ``int()`` alone would also accept "1_0" and surrounding whitespace; stage and rank numbers are
# identifiers, so only plain decimal digits are taken.
_INTEGER_RE = re.compile(r"[+-]?[0-9]+")

# Frequencies end up in an int64 array.
_MAX_FREQUENCY_MHZ = 2**63 - 1

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
    rows = _read_rows(text.removeprefix("\ufeff"), source)
    header = next(rows, None)
    if header is None:
        raise ProfileError(source, f"file is empty; expected a CSV header ({_ACCEPTED_FORMS})")
    header_line, header_fields = header
    columns = _column_index(header_fields, source, header_line)

    if "stage" in columns or not (_RANK_COLUMNS & columns.keys()):
        _require_columns(columns, _SIMPLE_COLUMNS, source, header_line)
        entries = _parse_simple(rows, columns, len(header_fields), source)
    else:
        _require_columns(columns, _RICH_COLUMNS, source, header_line)
        entries = _parse_rich(rows, columns, len(header_fields), source)
    return _build_profile(entries, source)


@dataclass(frozen=True, slots=True)
class _Entry:
    """One validated (stage, instruction, frequency) option; ``line`` is where it came from."""

    line: int
    stage: int
    instruction: str
    frequency_mhz: int
    time_s: float
    energy_j: float


def _read_rows(text: str, source: str) -> Iterator[tuple[int, list[str]]]:
    """Yield ``(line, fields)`` for every non-blank CSV record."""
    # ``line_num`` counts physical lines, so quoted newlines inside a field do not throw off
    # the line numbers reported to the user. It is read before the next record is parsed.
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise ProfileError(source, f"malformed CSV: {exc}", reader.line_num) from exc
        # Blank lines (commonly trailing ones) carry no data.
        if not fields or all(not f.strip() for f in fields):
            continue
        yield reader.line_num, fields


def _column_index(fields: Sequence[str], source: str, line: int) -> dict[str, int]:
    columns: dict[str, int] = {}
    for position, raw_name in enumerate(fields):
        name = raw_name.strip().lower()
        if name in columns:
            raise ProfileError(source, f"column {name!r} appears more than once in header", line)
        columns[name] = position
    return columns


def _require_columns(
    columns: Mapping[str, int], required: Sequence[str], source: str, line: int
) -> None:
    missing = [name for name in required if name not in columns]
    if missing:
        listed = ", ".join(repr(name) for name in missing)
        raise ProfileError(source, f"header is missing column(s) {listed}; {_ACCEPTED_FORMS}", line)


class _Row:
    """Typed access to the cells of one data row, raising errors that point at the row."""

    def __init__(
        self, source: str, line: int, columns: Mapping[str, int], fields: Sequence[str]
    ) -> None:
        self.source = source
        self.line = line
        self._columns = columns
        self._fields = fields

    def error(self, problem: str) -> ProfileError:
        return ProfileError(self.source, problem, self.line)

    def text(self, column: str) -> str:
        value = self._fields[self._columns[column]].strip()
        if not value:
            raise self.error(f"missing {column} value")
        return value

    def index(self, column: str) -> int:
        """A stage or rank number: a non-negative integer."""
        value = self.text(column)
        if not _INTEGER_RE.fullmatch(value):
            raise self.error(f"{column} must be a non-negative integer, got {value!r}")
        number = int(value)
        if number < 0:
            raise self.error(f"{column} must be non-negative, got {value!r}")
        return number

    def instruction(self) -> str:
        value = self.text("instruction")
        name = value.lower()
        if name not in INSTRUCTIONS:
            expected = ", ".join(INSTRUCTIONS)
            raise self.error(f"unknown instruction {value!r}; expected one of {expected}")
        return name

    def number(self, column: str) -> float:
        value = self.text(column)
        try:
            number = float(value)
        except ValueError:
            raise self.error(f"{column} is not a number: {value!r}") from None
        if not math.isfinite(number):
            raise self.error(f"{column} must be a finite number, got {value!r}")
        return number

    def frequency_mhz(self) -> int:
        value = self.text("frequency")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        # Some profilers write integral clocks as floats ("1410.0"); anything else is a typo.
        if not (math.isfinite(number) and number.is_integer() and number > 0):
            raise self.error(f"frequency must be a positive integer in MHz, got {value!r}")
        if number > _MAX_FREQUENCY_MHZ:
            raise self.error(f"frequency is out of range, got {value!r}")
        return int(number)

    def positive(self, column: str, unit: str) -> float:
        number = self.number(column)
        if number <= 0:
            value = self._fields[self._columns[column]].strip()
            raise self.error(f"{column} must be positive ({unit}), got {value!r}")
        return number

    def energy_j(self) -> float:
        number = self.positive("energy", "joules")
        if number > MAX_ENERGY_J:
            value = self._fields[self._columns["energy"]].strip()
            raise self.error(
                f"energy {value} J is above the {MAX_ENERGY_J:.3g} J the planner can count "
                "(integer micro-joules below 2**50); check that energies are joules"
            )
        return number


def _data_rows(
    rows: Iterator[tuple[int, list[str]]],
    columns: Mapping[str, int],
    num_fields: int,
    source: str,
) -> Iterator[_Row]:
    for line, fields in rows:
        if len(fields) != num_fields:
            raise ProfileError(
                source, f"expected {num_fields} fields as in the header, got {len(fields)}", line
            )
        yield _Row(source, line, columns, fields)


def _parse_simple(
    rows: Iterator[tuple[int, list[str]]],
    columns: Mapping[str, int],
    num_fields: int,
    source: str,
) -> list[_Entry]:
    entries: list[_Entry] = []
    first_line: dict[tuple[int, str, int], int] = {}
    for row in _data_rows(rows, columns, num_fields, source):
        entry = _Entry(
            line=row.line,
            stage=row.index("stage"),
            instruction=row.instruction(),
            frequency_mhz=row.frequency_mhz(),
            time_s=row.positive("time", "seconds"),
            energy_j=row.energy_j(),
        )
        key = (entry.stage, entry.instruction, entry.frequency_mhz)
        if key in first_line:
            raise row.error(
                f"duplicate row for stage {entry.stage} {entry.instruction} at "
                f"{entry.frequency_mhz} MHz; first given on line {first_line[key]}"
            )
        first_line[key] = row.line
        entries.append(entry)
    return entries


@dataclass
class _Group:
    """Rows of the tensor-parallel ranks of one stage for one (instruction, frequency)."""

    line: int
    time_s: float
    energy_j: float
    tp_ranks: set[int]


def _parse_rich(
    rows: Iterator[tuple[int, list[str]]],
    columns: Mapping[str, int],
    num_fields: int,
    source: str,
) -> list[_Entry]:
    first_line: dict[tuple[int, str, int], int] = {}
    # rank <-> (dp, pp, tp) must be one-to-one; otherwise two rows could describe the same GPU
    # under different rank numbers and be aggregated twice.
    coords_of_rank: dict[int, tuple[tuple[int, int, int], int]] = {}
    rank_of_coords: dict[tuple[int, int, int], tuple[int, int]] = {}
    groups: dict[tuple[int, str, int], _Group] = {}
    tp_ranks_of_stage: dict[int, set[int]] = {}

    for row in _data_rows(rows, columns, num_fields, source):
        rank = row.index("rank")
        coords = (row.index("dp_rank"), row.index("pp_rank"), row.index("tp_rank"))
        instruction = row.instruction()
        frequency_mhz = row.frequency_mhz()
        time_s = row.positive("time", "seconds")
        energy_j = row.energy_j()

        known_coords = coords_of_rank.setdefault(rank, (coords, row.line))
        if known_coords[0] != coords:
            (dp, pp, tp), line = known_coords
            raise row.error(
                f"rank {rank} has dp_rank/pp_rank/tp_rank {coords[0]}/{coords[1]}/{coords[2]} "
                f"but {dp}/{pp}/{tp} on line {line}"
            )
        known_rank = rank_of_coords.setdefault(coords, (rank, row.line))
        if known_rank[0] != rank:
            raise row.error(
                f"dp_rank/pp_rank/tp_rank {coords[0]}/{coords[1]}/{coords[2]} is rank {rank} "
                f"but rank {known_rank[0]} on line {known_rank[1]}"
            )
        key = (rank, instruction, frequency_mhz)
        if key in first_line:
            raise row.error(
                f"duplicate row for rank {rank} {instruction} at {frequency_mhz} MHz; "
                f"first given on line {first_line[key]}"
            )
        first_line[key] = row.line

        dp_rank, stage, tp_rank = coords
        if dp_rank != 0:
            continue
        tp_ranks_of_stage.setdefault(stage, set()).add(tp_rank)
        group = groups.get((stage, instruction, frequency_mhz))
        if group is None:
            groups[(stage, instruction, frequency_mhz)] = _Group(
                row.line, time_s, energy_j, {tp_rank}
            )
        else:
            group.time_s = max(group.time_s, time_s)
            group.energy_j += energy_j
            group.tp_ranks.add(tp_rank)

    if first_line and not groups:
        raise ProfileError(
            source, "no rows with dp_rank 0; the rich form uses data-parallel rank 0"
        )

    entries: list[_Entry] = []
    for (stage, instruction, frequency_mhz), group in groups.items():
        # A missing tensor-parallel rank would silently under-count the group's energy.
        absent = sorted(tp_ranks_of_stage[stage] - group.tp_ranks)
        if absent:
            raise ProfileError(
                source,
                f"stage {stage} {instruction} at {frequency_mhz} MHz has no dp_rank 0 row for "
                f"tp_rank {', '.join(map(str, absent))}",
                group.line,
            )
        entries.append(
            _Entry(group.line, stage, instruction, frequency_mhz, group.time_s, group.energy_j)
        )
    return entries


def _build_profile(entries: Sequence[_Entry], source: str) -> Profile:
    if not entries:
        raise ProfileError(source, "profile has no data rows; at least one stage is required")

    by_key: dict[tuple[int, str], list[_Entry]] = {}
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
