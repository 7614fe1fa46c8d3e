"""Pipeline schedules: the order in which each GPU runs its forwards and backwards.

Shared by the planner (which builds the iteration's DAG from it), the plan format (whose
per-GPU instruction lists follow it) and the node agent and emulated training ranks
(which walk it at run time).

Schedules and where their orders come from:

- ``1f1b``: synchronous 1F1B as in DeepSpeed and Megatron-LM (and torch's ``Schedule1F1B``).
- ``gpipe``: all forwards, then all backwards.
- ``interleaved-1f1b``: Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21,
  arXiv:2104.04473) with ``V`` virtual stages per GPU: virtual stage ``v * P + p`` runs on
  GPU ``p``. The per-GPU order is the one of torch's ``ScheduleInterleaved1F1B``
  (``torch/distributed/pipelining/schedules.py``: ``_calculate_single_rank_operations`` and
  ``_get_1f1b_rank_ops``), re-derived here because torch is not a dependency. Microbatches
  must be a multiple of ``P`` (then torch's "microbatches per round" is ``P``, as Megatron).
- ``zb-h1``: ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR'24,
  arXiv:2401.10241): each backward is split into ``backward_input`` (B, sent upstream) and
  ``backward_weight`` (W, local); GPU ``p`` runs 1F1B with B in place of the backward and
  delays its first ``p`` Ws, which it runs in the cooldown (so the last GPU fills the tail
  bubble and its peak memory matches 1F1B). The order is torch's
  ``ScheduleInterleavedZeroBubble`` for one local stage (``_get_1f1b_rank_ops`` with
  ``enable_zero_bubble=True`` and ``num_1f1b_microbatches = rank``); torch only pads it with
  idle slots, which do not change the order.
"""

from __future__ import annotations

import numbers
from enum import StrEnum
from typing import NamedTuple

from perseus_api.errors import ScheduleError

FORWARD = "forward"
BACKWARD = "backward"
BACKWARD_INPUT = "backward_input"
BACKWARD_WEIGHT = "backward_weight"


class Schedule(StrEnum):
    """Pipeline schedules Perseus can plan for."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZB_H1 = "zb-h1"

    @classmethod
    def parse(cls, value: object) -> Schedule:
        """Accept the user-facing spellings: ``1F1B``, ``GPipe``, ``Interleaved1F1B`` (the
        CRD's), ``interleaved-1f1b`` (the CLI's), ``ZBH1``, ``zb-h1``, in any case."""
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "").replace("_", "")
            for schedule in cls:
                if schedule.value.replace("-", "") == key:
                    return schedule
        choices = ", ".join(s.value for s in cls)
        raise ScheduleError(f"unknown schedule {value!r}; choose one of: {choices}")

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into ``backward_input`` and ``backward_weight``."""
        return self is Schedule.ZB_H1

    @property
    def backward_instructions(self) -> tuple[str, ...]:
        """The instructions a backward of this schedule consists of."""
        return (BACKWARD_INPUT, BACKWARD_WEIGHT) if self.splits_backward else (BACKWARD,)

    @property
    def instructions(self) -> tuple[str, ...]:
        """Every instruction a computation of this schedule can be, forward first."""
        return (FORWARD, *self.backward_instructions)


class Step(NamedTuple):
    """One computation in a GPU's order: ``instruction`` of ``microbatch`` on model stage
    ``virtual_stage`` (``v * P + p`` for chunk ``v`` of GPU ``p``; ``p`` without virtual
    stages)."""

    instruction: str
    microbatch: int
    virtual_stage: int


def check_schedule_sizes(
    schedule: Schedule | str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """Validate the sizes for ``schedule``; return the parsed schedule.

    Raises:
        ScheduleError: A size is not a positive integer, or does not suit the schedule.
    """
    sched = Schedule.parse(schedule)
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    if sched is Schedule.INTERLEAVED_1F1B:
        if virtual_stages < 2:
            raise ScheduleError(
                f"interleaved-1f1b needs at least 2 virtual stages per GPU, got {virtual_stages}"
                " (with one, use 1f1b)"
            )
        if num_microbatches % num_stages:
            raise ScheduleError(
                f"interleaved-1f1b needs microbatches to be a multiple of the pipeline stages "
                f"(as Megatron-LM and torch), got {num_microbatches} microbatches for "
                f"{num_stages} stages"
            )
    elif virtual_stages != 1:
        raise ScheduleError(
            f"{sched.value} has one model stage per GPU; virtual stages ({virtual_stages}) "
            "need interleaved-1f1b"
        )
    return sched


def gpu_computation_order(
    schedule: Schedule | str,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 1,
) -> list[Step]:
    """Every computation GPU ``stage`` (its pipeline rank) runs, in the order it runs them.

    Raises:
        ScheduleError: Invalid sizes for the schedule, or ``stage`` out of range.
    """
    sched = check_schedule_sizes(schedule, num_stages, num_microbatches, virtual_stages)
    if (
        isinstance(stage, bool)
        or not isinstance(stage, numbers.Integral)
        or not 0 <= stage < num_stages
    ):
        raise ScheduleError(f"stage must be in 0..{num_stages - 1}, got {stage!r}")
    if sched is Schedule.INTERLEAVED_1F1B:
        return _interleaved_order(num_stages, num_microbatches, stage, virtual_stages)
    if sched is Schedule.ZB_H1:
        return _zb_h1_order(num_stages, num_microbatches, stage)
    return [
        Step(instruction, mb, stage)
        for instruction, mb in _single_chunk_order(sched, num_stages, num_microbatches, stage)
    ]


def stage_instruction_order(
    schedule: Schedule | str, num_stages: int, num_microbatches: int, stage: int
) -> list[tuple[str, int]]:
    """Return ``(instruction, microbatch)`` in the order ``stage`` executes them.

    For the schedules with one model stage per GPU; an interleaved order needs the virtual
    stage of each computation too (:func:`gpu_computation_order`).

    Raises:
        ScheduleError: For ``interleaved-1f1b``, or invalid sizes.
    """
    sched = Schedule.parse(schedule)
    if sched is Schedule.INTERLEAVED_1F1B:
        raise ScheduleError(
            "interleaved-1f1b runs several virtual stages per GPU: (instruction, microbatch) "
            "is ambiguous; use gpu_computation_order"
        )
    if sched is Schedule.ZB_H1:
        return [
            (s.instruction, s.microbatch) for s in _zb_h1_order(num_stages, num_microbatches, stage)
        ]
    return _single_chunk_order(sched, num_stages, num_microbatches, stage)


def _single_chunk_order(
    schedule: Schedule, num_stages: int, num_microbatches: int, stage: int
) -> list[tuple[str, int]]:
    if schedule is Schedule.GPIPE:
        return [(FORWARD, m) for m in range(num_microbatches)] + [
            (BACKWARD, m) for m in range(num_microbatches)
        ]
    # 1F1B (synchronous, as in DeepSpeed and Megatron): a warm-up of forwards that
    # fills the pipeline below this stage, then alternate, then drain backwards.
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [(FORWARD, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [(FORWARD, warmup + i), (BACKWARD, i)]
    order += [(BACKWARD, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def _interleaved_order(
    num_stages: int, num_microbatches: int, rank: int, virtual_stages: int
) -> list[Step]:
    """torch's ``ScheduleInterleaved1F1B`` order of ``rank`` (microbatches a multiple of P).

    ``P`` microbatches form a round; forwards run chunk by chunk, one round of each chunk in
    turn (depth first), backwards likewise from the last chunk down. The warm-up fills the
    later chunks' rounds and two extra forwards per GPU further from the last one.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    per_round = p  # torch: M // max(1, M // P), which is P when P divides M
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)

    def forward_stage(step: int) -> int:
        return (step // per_round) % v * p + rank

    def backward_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    next_forward: dict[int, int] = {}
    next_backward: dict[int, int] = {}
    order: list[Step] = []

    def add(instruction: str, stage: int, counters: dict[int, int]) -> None:
        mb = counters.get(stage, 0)
        counters[stage] = mb + 1
        order.append(Step(instruction, mb, stage))

    for step in range(total + warmup):
        if step < total:
            add(FORWARD, forward_stage(step), next_forward)
        if step >= warmup:
            add(BACKWARD, backward_stage(step), next_backward)
    return order


def _zb_h1_order(num_stages: int, num_microbatches: int, rank: int) -> list[Step]:
    """torch's zero-bubble order for one chunk per GPU (ZB-H1): 1F1B with ``backward_input``
    in place of the backward, and each ``backward_weight`` as soon as the GPU has run
    ``rank`` more backward-inputs than weights; the rest at the end."""
    m = num_microbatches
    warmup = min(num_stages - 1 - rank, m)
    order = [Step(FORWARD, mb, rank) for mb in range(warmup)]
    weights = 0
    for step in range(warmup, m + warmup):
        if step < m:
            order.append(Step(FORWARD, step, rank))
        order.append(Step(BACKWARD_INPUT, step - warmup, rank))
        if step - warmup >= rank:
            order.append(Step(BACKWARD_WEIGHT, weights, rank))
            weights += 1
    order += [Step(BACKWARD_WEIGHT, mb, rank) for mb in range(weights, m)]
    return order
