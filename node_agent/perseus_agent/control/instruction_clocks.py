"""``Instruction`` granularity: the clock of each computation of the stage, in schedule order.

Nothing is locked until the training process on the GPU calls in; then every
``instruction_begin`` locks the clock of the next computation of the stage and every
``instruction_end`` locks the one after already. A computation is the plan's entry of the
same (name, microbatch, chunk): with virtual stages (interleaved 1F1B) an entry's chunk is
its ``virtual_stage // num_stages``, the rank-local index the client names (protocol
version 2); a client that names no chunk (version 1) matches any, and a zero-bubble plan's
``backward_input``/``backward_weight`` are matched by name like ``forward`` and ``backward``.
A computation out of the plan's order resynchronises the position and counts
``schedule_mismatch``.
"""

from __future__ import annotations

import logging

from perseus_agent.control.gpu_clocks import GpuClocks, wait
from perseus_agent.control.plan_state import GpuState
from perseus_agent.errors import GpuError
from perseus_agent.exporter import AgentMetrics
from perseus_agent.log_limit import RateLimitedLog
from perseus_api.node_report import GpuStatus
from perseus_api.plan import Granularity

__all__ = ["InstructionClocks"]

log = logging.getLogger(__name__)


class InstructionClocks:
    """Follows each GPU's place in its stage's schedule and locks the clock the plan gives it.

    Not thread-safe: the applier calls it under its lock.
    """

    def __init__(self, clocks: GpuClocks, metrics: AgentMetrics) -> None:
        self._clocks = clocks
        self._metrics = metrics
        # A client controls how often this happens: the counter counts each, the log samples.
        self._mismatch_log = RateLimitedLog(log)

    def prepare(self, g: GpuState, old: GpuState | None) -> None:
        """A new plan for ``g`` (``old``: its previous state): nothing is locked until the
        training process calls in."""
        try:  # learn the supported clocks now, not on the training process's critical path
            for clock in sorted({i.frequency_mhz for i in g.stage_plan.instructions}):
                self._clocks.nearest_clock(g.info.index, clock)
        except GpuError as exc:
            self._clocks.fail(g, exc.reason, str(exc), None)
            return
        if old is not None and old.session is not None and old.status != GpuStatus.FAILED:
            # The training process is already in: keep the clock in effect and its place in
            # the schedule; its next computation gets the new plan's clock.
            g.session = old.session
            g.status, g.target_mhz, g.applied_mhz = old.status, old.target_mhz, old.applied_mhz
            g.message = old.message
            # Profiling locks clocks per iteration and keeps no place in the schedule.
            if (
                old.granularity == Granularity.INSTRUCTION
                and old.profiler is None
                and len(old.stage_plan.instructions) == len(g.stage_plan.instructions)
            ):
                g.position, g.aligned = old.position, old.aligned
            else:  # its place is found from its next computation, not counted as a mismatch
                g.aligned = False
            return
        if old is not None:
            g.session = old.session
        self._clocks.reset_clock(g.info.index)
        wait(g, "waiting for the training process to call in")

    def switch(self, g: GpuState, name: str, microbatch: int | None, chunk: int | None) -> None:
        """Computation ``name`` begins: lock its clock (resynchronising on a mismatch)."""
        instructions = g.stage_plan.instructions
        pos = g.position

        def matches(i: int) -> bool:
            entry = instructions[i]
            return (
                entry.instruction == name
                and (microbatch is None or entry.microbatch == microbatch)
                and (chunk is None or _chunk(entry.virtual_stage, g.num_stages) == chunk)
            )

        found: int | None = pos if pos < len(instructions) and matches(pos) else None
        if found is None and not g.aligned:
            found = next((i for i in range(len(instructions)) if matches(i)), None)
            if found is None:
                return
        if found is None:
            expected = (
                _describe(
                    instructions[pos].instruction,
                    instructions[pos].microbatch,
                    _chunk(instructions[pos].virtual_stage, g.num_stages)
                    if g.virtual_stages > 1
                    else None,
                )
                if pos < len(instructions)
                else "the end of the iteration"
            )
            order = [*range(pos, len(instructions)), *range(pos)]
            found = next((i for i in order if matches(i)), None)
            self._metrics.count_error("schedule_mismatch")
            self._mismatch_log.warning(
                ("schedule_mismatch", g.info.index),
                "GPU %d: the training process runs %s where the plan expects %s; %s",
                g.info.index,
                _describe(name, microbatch, chunk),
                expected,
                f"resynchronised at position {found}" if found is not None else "not in the plan",
            )
            if found is None:
                return
        g.position, g.aligned = found + 1, True
        self._clocks.set_clock(g, instructions[found].frequency_mhz)

    def prepare_next(self, g: GpuState) -> None:
        """Lock the clock of ``g``'s next computation, if the iteration has one."""
        instructions = g.stage_plan.instructions
        if g.position < len(instructions):
            self._clocks.set_clock(g, instructions[g.position].frequency_mhz)


def _chunk(virtual_stage: int | None, num_stages: int) -> int:
    """The rank-local chunk of a plan entry: model stage ``v * P + p`` is chunk ``v``."""
    return 0 if virtual_stage is None else virtual_stage // num_stages


def _describe(name: str, microbatch: int | None, chunk: int | None) -> str:
    where = "" if chunk is None else f" on chunk {chunk}"
    return f"{name} of microbatch {'?' if microbatch is None else microbatch}{where}"
