"""Profiling: the time and energy of every computation of a training rank, per SM clock.

During a profiling run (``NodePlan.profiling``) the agent walks a schedule of SM clocks on
each profiled GPU and measures, from the requests of the training process (see
:mod:`perseus_client`), the time and energy of every forward and backward at each clock, plus
the GPU's blocking power. The result is a profile in the simple CSV form the planner reads
(``stage,instruction,frequency,time,energy``, see :mod:`perseus_api.profile`).

:class:`StageProfiler` follows one GPU through the clock schedule, with the energy of any
moment from the GPU's :class:`~perseus_agent.profiling.energy_sampler.EnergySampler`. The
training process's requests are timed by the client (``time.monotonic_ns()``, the sampler's
time source; on receipt for a client that does not say, see
:func:`client_dispatch.event_time_ns`): ``step_begin``/``step_end`` delimit an iteration,
``instruction_begin``/``instruction_end`` one computation. After every clock change the first
``warmup_iterations`` iterations are dropped, the next ``iterations_per_frequency`` are
measured, then the next clock is locked at the next ``step_begin``. Per (instruction, clock)
the median time and energy of a computation are reported; the time of a measured iteration
outside computations is blocking (waiting on other stages, or idle), and blocking power is its
energy over its time.

Schedules beyond 1F1B and GPipe (protocol version 2): a computation may be a
``backward_input`` or ``backward_weight`` (zero-bubble: rows of those names, the profile form
``zb-h1`` plans from), and with ``V`` virtual stages per GPU it names its ``chunk`` ``v``:
its rows are those of model stage ``v * P + p`` for the GPU of pipeline stage ``p`` (the
``P * V``-stage profile ``interleaved-1f1b`` plans from, Megatron-LM's layout). A chunk the
plan does not have, or an interleaved computation without one, makes its iteration invalid.

The energies of an iteration are computed once the sampler holds a point at or after the
iteration's end (:meth:`StageProfiler.poll`), so a run is :attr:`StageProfiler.done` at the
first poll after the counter changed past its last measured iteration. It reads no clock of
its own (times come with the requests, energies from the sampler it is given), so tests drive
it deterministically.

Limits: the counter is interpolated, so a computation much shorter than the counter's update
period is measured as the average power around it, and at each edge of a computation the
interpolation errs by up to (power step) x (sampling or update period) / 4, an error that the
blocking energy (the iteration's energy minus the computations') absorbs: blocking power is
accurate when an iteration's blocking time is long against those edges. So it is reported
only when the measured iterations spent at least :data:`MIN_BLOCKING_FRACTION` of their time
outside computations (a rank that never waits, e.g. a single-stage pipeline, gives none) and
the blocking energy came out positive. An iteration longer than the sampler's buffer
(``capacity`` changes of the counter, about 5 minutes at the default 5 ms) cannot be resolved
and is dropped. The time between ``instruction_begin`` and the GPU
starting (and between the GPU finishing and ``instruction_end``) counts as computation.
"""

from __future__ import annotations

import itertools
import logging
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, cast

from perseus_agent.profiling.energy_sampler import (
    EnergySampler,
)
from perseus_api.node_report import InstructionName, ProfileRow  # re-exported: the agent's rows

__all__ = [
    "MIN_BLOCKING_FRACTION",
    "PROFILE_COLUMNS",
    "ProfileRow",
    "StageProfiler",
    "profile_csv",
]

log = logging.getLogger(__name__)

MIN_BLOCKING_FRACTION: Final = 0.02
"""Least share of the measured iterations' time outside computations to report blocking power."""
EDGE_TRIM_NS: Final = 10_000_000
"""Blocking power is measured this far inside each wait (2 default sampling periods): at the
edges the interpolated counter mixes in the neighbouring computation's power, and a hook's
time stamp lies a little off the GPU's own edge."""
MIN_TRIMMED_FRACTION: Final = 0.01
"""Least share of the measured iterations' time inside trimmed waits to measure blocking power
there; below it, it is measured over all the time outside computations."""

PROFILE_COLUMNS: Final = ("stage", "instruction", "frequency", "time", "energy")
_INSTRUCTIONS: Final[tuple[InstructionName, ...]] = (
    "forward",
    "backward",
    "backward_input",
    "backward_weight",
)
"""The order of a stage's rows at each clock (:data:`perseus_api.profile.INSTRUCTIONS`')."""


def _inner_waits(m: _Measured) -> list[tuple[int, int]]:
    """The iteration's waits (time outside computations), each cut :data:`EDGE_TRIM_NS`
    short at both ends; those too short for that are left out."""
    edges = sorted((b, e) for _, b, e in m.instructions)
    waits, at = [], m.begin_ns
    for begin, end in [*edges, (m.end_ns, m.end_ns)]:
        if begin - at > 2 * EDGE_TRIM_NS:
            waits.append((at + EDGE_TRIM_NS, begin - EDGE_TRIM_NS))
        at = max(at, end)
    return waits


def profile_csv(rows: Iterable[ProfileRow]) -> str:
    """``rows`` in the simple profile CSV form (``stage,instruction,frequency,time,energy``).

    :func:`perseus_api.profile.parse_profile` reads it back exactly when the rows cover stages
    ``0..n-1``, each with a forward and a backward (whole, or both halves) at two clocks or
    more.
    """
    lines = [",".join(PROFILE_COLUMNS)]
    lines.extend(
        f"{r.stage},{r.instruction},{r.frequency_mhz},{r.time_s!r},{r.energy_j!r}" for r in rows
    )
    return "\n".join(lines) + "\n"


_Key = tuple[int, InstructionName]
"""(chunk, instruction) of a computation."""


@dataclass
class _Open:
    """The iteration in progress."""

    frequency_index: int
    warmup: bool
    begin_ns: int
    instructions: list[tuple[_Key, int, int]] = field(default_factory=list)
    running: tuple[_Key, int] | None = None
    valid: bool = True


@dataclass(frozen=True)
class _Measured:
    """A measured iteration, waiting for the energy counter to cover it."""

    frequency_mhz: int
    begin_ns: int
    end_ns: int
    instructions: tuple[tuple[_Key, int, int], ...]


@dataclass
class _Sum:
    """The measured computations of one (instruction, clock)."""

    times_ns: list[int] = field(default_factory=list)
    energies_j: list[float] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.times_ns)


class StageProfiler:
    """Profiles one GPU running pipeline stage ``stage`` through a schedule of SM clocks.

    Not thread-safe: the caller serialises the calls (the applier holds its lock). The caller
    also locks the clocks: :meth:`step_begin` says which one the iteration must run at, and
    :meth:`clock_applied` which one is in effect (a clamped clock is measured as such).

    Args:
        stage: Pipeline stage of the GPU (the rows' ``stage`` for its chunk 0).
        frequencies_mhz: Clocks to measure, in order.
        iterations_per_frequency: Measured iterations per clock.
        warmup_iterations: Iterations dropped after each clock change.
        sampler: The GPU's energy counter.
        num_stages: GPUs in the pipeline ``P``: chunk ``v``'s rows are model stage
            ``v * P + stage``.
        virtual_stages: Chunks per GPU ``V``; with more than one, every computation must
            name its chunk.

    Raises:
        ValueError: An argument is invalid.
    """

    def __init__(
        self,
        stage: int,
        frequencies_mhz: Sequence[int],
        *,
        iterations_per_frequency: int,
        warmup_iterations: int,
        sampler: EnergySampler,
        num_stages: int = 1,
        virtual_stages: int = 1,
    ) -> None:
        if stage < 0 or num_stages < 1 or virtual_stages < 1:
            raise ValueError(
                f"need stage >= 0, num_stages >= 1 and virtual_stages >= 1, got {stage}, "
                f"{num_stages} and {virtual_stages}"
            )
        if virtual_stages > 1 and stage >= num_stages:
            raise ValueError(f"stage {stage} is not one of {num_stages} pipeline stages")
        if not frequencies_mhz or any(f <= 0 for f in frequencies_mhz):
            raise ValueError(f"need one or more positive clocks, got {list(frequencies_mhz)}")
        if iterations_per_frequency < 1 or warmup_iterations < 0:
            raise ValueError(
                f"need iterations_per_frequency >= 1 and warmup_iterations >= 0, got "
                f"{iterations_per_frequency} and {warmup_iterations}"
            )
        self.stage = stage
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.frequencies_mhz: tuple[int, ...] = tuple(frequencies_mhz)
        self.iterations_per_frequency = iterations_per_frequency
        self.warmup_iterations = warmup_iterations
        self.sampler = sampler
        self.applied_mhz: list[int | None] = [None] * len(self.frequencies_mhz)
        """Clock in effect for each scheduled clock (differs when clamped), once reached."""
        self.measured_iterations = 0
        """Measured iterations whose energies are in the results."""
        self.dropped_iterations = 0
        """Iterations that were to be measured but were incomplete or not covered by samples."""
        self._index = 0
        self._warmup_left = warmup_iterations
        self._measured_here = 0
        self._open: _Open | None = None
        self._pending: list[_Measured] = []
        self._sums: dict[tuple[_Key, int], _Sum] = {}
        self._blocking_ns = 0
        self._blocking_j = 0.0
        self._inner_ns = 0  # inside waits, EDGE_TRIM_NS from their edges
        self._inner_j = 0.0
        self._iterations_ns = 0

    # -- progress ------------------------------------------------------------------------------

    @property
    def frequency_index(self) -> int:
        """Index of the clock being measured; ``len(frequencies_mhz)`` once all are."""
        return self._index

    @property
    def measuring(self) -> bool:
        """Clocks remain to be measured."""
        return self._index < len(self.frequencies_mhz)

    @property
    def done(self) -> bool:
        """Every clock is measured and every measured iteration's energy computed."""
        return not self.measuring and not self._pending

    @property
    def current_frequency_mhz(self) -> int | None:
        """The scheduled clock being measured, ``None`` once all are."""
        return self.frequencies_mhz[self._index] if self.measuring else None

    # -- events --------------------------------------------------------------------------------

    def step_begin(self, t_ns: int) -> int | None:
        """An iteration begins: the scheduled clock it must run at; ``None`` when all are done.

        An iteration that began without ending is dropped.
        """
        if not self.measuring:
            return None
        if self._open is not None and not self._open.warmup:
            self.dropped_iterations += 1
        self._open = _Open(self._index, self._warmup_left > 0, t_ns)
        return self.frequencies_mhz[self._index]

    def clock_applied(self, clock_mhz: int) -> None:
        """The clock now in effect for the scheduled clock being measured."""
        if self.measuring:
            self.applied_mhz[self._index] = clock_mhz

    def instruction_begin(self, name: str, t_ns: int, chunk: int | None = None) -> None:
        """A computation of the GPU's ``chunk`` (``None``: its only one) begins."""
        it = self._open
        if it is None:
            return
        if it.running is not None or name not in _INSTRUCTIONS or not self._known_chunk(chunk):
            it.valid = False
        it.running = ((chunk or 0, cast(InstructionName, name)), t_ns)

    def _known_chunk(self, chunk: int | None) -> bool:
        if chunk is None:
            return self.virtual_stages == 1  # else: which model stage would it be?
        return 0 <= chunk < self.virtual_stages

    def instruction_end(self, name: str, t_ns: int, chunk: int | None = None) -> None:
        it = self._open
        if it is None:
            return
        key = (chunk or 0, name)
        if it.running is None or it.running[0] != key or t_ns < it.running[1]:
            it.valid = False
        else:
            it.instructions.append((it.running[0], it.running[1], t_ns))
        it.running = None

    def step_end(self, t_ns: int) -> bool:
        """An iteration ends; ``True`` if it was the last to measure (reset the clock now)."""
        it, self._open = self._open, None
        if it is None or it.frequency_index != self._index:
            return False
        if it.warmup:
            self._warmup_left -= 1
            return False
        applied = self.applied_mhz[self._index]
        if it.valid and it.running is None and applied is not None and t_ns >= it.begin_ns:
            self._pending.append(_Measured(applied, it.begin_ns, t_ns, tuple(it.instructions)))
        else:
            self.dropped_iterations += 1
        self._measured_here += 1
        if self._measured_here >= self.iterations_per_frequency:
            self._index += 1
            self._measured_here = 0
            self._warmup_left = self.warmup_iterations
        self.poll()
        return not self.measuring

    def interrupt(self) -> None:
        """The training process is gone (and the clock reset): drop the iteration in progress
        and warm up again once the clock is locked again."""
        if self._open is not None and not self._open.warmup:
            self.dropped_iterations += 1
        self._open = None
        if self.measuring:
            self._warmup_left = self.warmup_iterations

    def poll(self) -> None:
        """Compute the energies of the measured iterations the sampler now covers."""
        waiting: list[_Measured] = []
        for m in self._pending:
            if self.sampler.covers(m.end_ns):
                self._resolve(m)
            else:
                waiting.append(m)
        self._pending = waiting

    def _resolve(self, m: _Measured) -> None:
        energy_at = self.sampler.energy_at
        begin_j, end_j = energy_at(m.begin_ns), energy_at(m.end_ns)
        parts: list[tuple[_Key, int, float]] = []
        covered = begin_j is not None and end_j is not None
        for name, b, e in m.instructions if covered else ():
            eb, ee = energy_at(b), energy_at(e)
            if eb is None or ee is None:
                covered = False
                break
            parts.append((name, e - b, ee - eb))
        if not covered or begin_j is None or end_j is None:
            log.warning(
                "stage %d at %d MHz: an iteration is not covered by energy samples; dropped",
                self.stage,
                m.frequency_mhz,
            )
            self.dropped_iterations += 1
            return
        for name, time_ns, energy_j in parts:
            s = self._sums.setdefault((name, m.frequency_mhz), _Sum())
            s.times_ns.append(time_ns)
            s.energies_j.append(energy_j)
        self._iterations_ns += m.end_ns - m.begin_ns
        self._blocking_ns += (m.end_ns - m.begin_ns) - sum(p[1] for p in parts)
        self._blocking_j += (end_j - begin_j) - sum(p[2] for p in parts)
        for lo, hi in _inner_waits(m):
            e_lo, e_hi = energy_at(lo), energy_at(hi)
            if e_lo is not None and e_hi is not None:
                self._inner_ns += hi - lo
                self._inner_j += e_hi - e_lo
        self.measured_iterations += 1

    # -- results -------------------------------------------------------------------------------

    def rows(self) -> list[ProfileRow]:
        """Median time and energy per (model stage, instruction, clock) so far: highest clock
        first, then by model stage, forward before the backwards (the order of the bundled
        profiles).

        The median, not the mean: a computation the node stalled (a preempted training
        process, a late hook) is one of a few measured per clock, and a mean carried it into
        the frontier. The planner's prediction is that sensitive: on a loaded 2-core machine,
        profiles whose means were within 0.2 % (median) of the truth, but up to 1.1 % off in
        one row, predicted 5.9-6.1 % savings where the truth gives 5.47 %.
        """
        rows: list[ProfileRow] = []
        for clock in sorted({c for _, c in self._sums}, reverse=True):
            for chunk, name in itertools.product(range(self.virtual_stages), _INSTRUCTIONS):
                s = self._sums.get(((chunk, name), clock))
                if s is None or s.count == 0:
                    continue
                rows.append(
                    ProfileRow(
                        stage=chunk * self.num_stages + self.stage,
                        instruction=name,
                        frequency_mhz=clock,
                        time_s=statistics.median(s.times_ns) / 1e9,
                        energy_j=statistics.median(s.energies_j),
                        samples=s.count,
                    )
                )
        return rows

    @property
    def blocking_power_w(self) -> float | None:
        """Energy over time of the measured iterations while waiting: inside the waits, away
        from their edges (:data:`EDGE_TRIM_NS`) when at least :data:`MIN_TRIMMED_FRACTION` of
        the time is there, else over all the time outside computations.

        ``None`` when the time outside computations is under :data:`MIN_BLOCKING_FRACTION` of
        the measured iterations' time (too short to tell from the counter's interpolation
        error) or the energy is not positive. Over all the time outside computations, an
        emulated 4-stage pipeline's blocking power came out 7-11 % high.
        """
        if self._blocking_ns <= MIN_BLOCKING_FRACTION * self._iterations_ns:
            return None
        energy_j, time_ns = self._blocking_j, self._blocking_ns
        if self._inner_ns >= MIN_TRIMMED_FRACTION * self._iterations_ns:
            energy_j, time_ns = self._inner_j, self._inner_ns
        if energy_j <= 0 or time_ns <= 0:
            return None
        return energy_j / (time_ns / 1e9)

    @property
    def blocking_s(self) -> float:
        """Time outside computations over the measured iterations, in seconds."""
        return self._blocking_ns / 1e9

    def to_csv(self) -> str:
        """:meth:`rows` as profile CSV (see :func:`profile_csv`)."""
        return profile_csv(self.rows())
