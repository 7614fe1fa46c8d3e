"""Pipeline schedules: the order in which each stage runs its forwards and backwards.

Shared by the planner (which builds the iteration's DAG from it), the plan format (whose
per-stage instruction lists follow it) and the node agent and emulated training ranks
(which walk it at run time).
"""

from __future__ import annotations

from enum import StrEnum

from perseus_api.errors import ScheduleError

FORWARD = "forward"
BACKWARD = "backward"


class Schedule(StrEnum):
    """Pipeline schedules Perseus can plan for."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"

    @classmethod
    def parse(cls, value: object) -> Schedule:
        """Accept the user-facing spellings (``1F1B``, ``1f1b``, ``GPipe``, ``gpipe``)."""
        try:
            if not isinstance(value, str):
                raise ValueError(value)
            return cls(value.strip().lower())
        except ValueError:
            choices = ", ".join(s.value for s in cls)
            raise ScheduleError(f"unknown schedule {value!r}; choose one of: {choices}") from None


def stage_instruction_order(
    schedule: Schedule | str, num_stages: int, num_microbatches: int, stage: int
) -> list[tuple[str, int]]:
    """Return ``(instruction, microbatch)`` in the order ``stage`` executes them."""
    if Schedule.parse(schedule) is Schedule.GPIPE:
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
