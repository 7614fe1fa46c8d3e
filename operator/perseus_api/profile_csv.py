"""The two CSV forms of a profile read into checked rows, one per (stage, instruction, clock).

Each row is checked where it stands (its numbers, units and ranks, duplicates, the rich form's
rank layout), so that an error names its line; :mod:`perseus_api.profile` then checks the
profile as a whole and builds it. Which instruction names a row may hold and the largest
energy it may state are the profile's (:data:`perseus_api.profile.INSTRUCTIONS`,
:data:`~perseus_api.profile.MAX_ENERGY_J`), passed in: this module sits below it.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from perseus_api.errors import ProfileError

__all__ = ["ProfileEntry", "RowLimits", "read_entries"]

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


@dataclass(frozen=True)
class RowLimits:
    """What a row may hold: its instruction names, and the largest energy (J) it may state."""

    instructions: tuple[str, ...]
    max_energy_j: float


def read_entries(text: str, source: str, limits: RowLimits) -> list[ProfileEntry]:
    """The checked rows of profile CSV ``text`` (either form), in file order; ``source`` names
    it in error messages.

    Raises:
        ProfileError: the header or a row is malformed.
    """
    rows = _read_rows(text, source)
    header = next(rows, None)
    if header is None:
        raise ProfileError(source, f"file is empty; expected a CSV header ({_ACCEPTED_FORMS})")
    header_line, header_fields = header
    columns = _column_index(header_fields, source, header_line)

    if "stage" in columns or not (_RANK_COLUMNS & columns.keys()):
        _require_columns(columns, _SIMPLE_COLUMNS, source, header_line)
        return _parse_simple(rows, columns, len(header_fields), source, limits)
    _require_columns(columns, _RICH_COLUMNS, source, header_line)
    return _parse_rich(rows, columns, len(header_fields), source, limits)


@dataclass(frozen=True, slots=True)
class ProfileEntry:
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
        self,
        source: str,
        line: int,
        columns: Mapping[str, int],
        fields: Sequence[str],
        limits: RowLimits,
    ) -> None:
        self.source = source
        self.line = line
        self._columns = columns
        self._fields = fields
        self._limits = limits

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
        if name not in self._limits.instructions:
            expected = ", ".join(self._limits.instructions)
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
        max_energy_j = self._limits.max_energy_j
        if number > max_energy_j:
            value = self._fields[self._columns["energy"]].strip()
            raise self.error(
                f"energy {value} J is above the {max_energy_j:.3g} J the planner can count "
                "(integer micro-joules below 2**50); check that energies are joules"
            )
        return number


def _data_rows(
    rows: Iterator[tuple[int, list[str]]],
    columns: Mapping[str, int],
    num_fields: int,
    source: str,
    limits: RowLimits,
) -> Iterator[_Row]:
    for line, fields in rows:
        if len(fields) != num_fields:
            raise ProfileError(
                source, f"expected {num_fields} fields as in the header, got {len(fields)}", line
            )
        yield _Row(source, line, columns, fields, limits)


def _parse_simple(
    rows: Iterator[tuple[int, list[str]]],
    columns: Mapping[str, int],
    num_fields: int,
    source: str,
    limits: RowLimits,
) -> list[ProfileEntry]:
    entries: list[ProfileEntry] = []
    first_line: dict[tuple[int, str, int], int] = {}
    for row in _data_rows(rows, columns, num_fields, source, limits):
        entry = ProfileEntry(
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
    limits: RowLimits,
) -> list[ProfileEntry]:
    first_line: dict[tuple[int, str, int], int] = {}
    # rank <-> (dp, pp, tp) must be one-to-one; otherwise two rows could describe the same GPU
    # under different rank numbers and be aggregated twice.
    coords_of_rank: dict[int, tuple[tuple[int, int, int], int]] = {}
    rank_of_coords: dict[tuple[int, int, int], tuple[int, int]] = {}
    groups: dict[tuple[int, str, int], _Group] = {}
    tp_ranks_of_stage: dict[int, set[int]] = {}

    for row in _data_rows(rows, columns, num_fields, source, limits):
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

    entries: list[ProfileEntry] = []
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
            ProfileEntry(
                group.line, stage, instruction, frequency_mhz, group.time_s, group.energy_j
            )
        )
    return entries
