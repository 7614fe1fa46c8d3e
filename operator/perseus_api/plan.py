"""Frequency plan: the wire format between planner, operator and node agents.

One ``PipelinePlan`` describes one pipeline (all data-parallel replicas of a job
share it unless they are re-targeted). The node agent applies, per GPU of stage
``s``, either ``stages[s].frequency_mhz`` (``Stage`` granularity: one locked
clock) or ``stages[s].instructions`` in schedule order (``Instruction``
granularity: the clock switches at every forward/backward).

Interleaved 1F1B runs several model (virtual) stages per GPU: each instruction then names
its ``virtual_stage`` (``v * num_stages + s``). Zero-bubble schedules list
``backward_input`` and ``backward_weight`` where the others list ``backward``. Plans of the
other schedules are unchanged (``virtual_stage`` is left out).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from perseus_api.conventions import wire_name
from perseus_api.schedule import Step, gpu_computation_order

API_VERSION: Final = "perseus.energy/v1alpha1"


class Granularity(StrEnum):
    """How finely clocks are controlled."""

    STAGE = "Stage"
    INSTRUCTION = "Instruction"


class PlanObjective(StrEnum):
    """Why this point of the frontier was chosen."""

    MIN_TIME = "MinTime"  # T_min: no slowdown, intrinsic bloat removed
    STRAGGLER = "Straggler"  # slowest replica runs at T': min energy with T <= T'
    MAX_SLOWDOWN = "MaxSlowdown"  # min energy within a slowdown budget


class _Model(BaseModel):
    """camelCase on the wire with units spelled out (``numStages``, ``unitTimeSeconds``), as
    in a node plan's status; snake_case in Python; unknown fields are errors.

    The snake_case keys are read too: node plans and plan files written before the wire
    format was camelCase (``num_stages``) stay valid (see docs/operations/install.md).
    """

    model_config = ConfigDict(
        alias_generator=wire_name,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        # A field's docstring is its description in the CRD (kubectl explain).
        use_attribute_docstrings=True,
    )


class InstructionClock(_Model):
    """Clock of one computation, in the stage's execution order."""

    instruction: Literal["forward", "backward", "backward_input", "backward_weight"]
    """The computation: forward, backward, or (zero-bubble schedules) backward_input and
    backward_weight."""
    microbatch: int = Field(ge=0)
    """The microbatch the computation works on, from 0."""
    frequency_mhz: int = Field(gt=0)
    """SM clock for this computation (MHz)."""
    virtual_stage: int | None = Field(
        default=None,
        ge=0,
        description="Model stage (v * num_stages + stage) with virtual stages; else omitted.",
    )

    @model_serializer(mode="wrap")
    def _omit_no_virtual_stage(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Plans without virtual stages serialize exactly as before the field existed.
        data: dict[str, Any] = handler(self)
        for key in ("virtual_stage", "virtualStage"):  # by field name or by alias
            if key in data and data[key] is None:
                del data[key]
        return data


class StagePlan(_Model):
    """Clocks for every GPU of one pipeline stage."""

    stage: int = Field(ge=0)
    """Pipeline stage (pp rank) these clocks are for, from 0."""
    frequency_mhz: int = Field(gt=0, description="Stage granularity: one locked SM clock.")
    instructions: list[InstructionClock] = Field(
        description="Instruction granularity: clock per computation, in schedule order."
    )


class PlanEstimate(_Model):
    """Predicted iteration time and energy of one pipeline under a plan."""

    iteration_time_s: float = Field(
        gt=0, description="The planner's iteration time (in its time unit; targets are met on it)."
    )
    energy_j: float = Field(
        gt=0,
        description="Per iteration: the plan's clocks replayed on the profile's measured rows, "
        "incl. blocking power while waiting for a straggler.",
    )
    savings_ratio: float = Field(
        description="Energy saved vs. every GPU at its highest clock, at the same iteration time, "
        "both on the profile's measured rows."
    )


class PipelinePlan(_Model):
    """Per-GPU frequency plan of one pipeline."""

    api_version: Literal["perseus.energy/v1alpha1"] = API_VERSION
    """Version of the plan format: perseus.energy/v1alpha1."""
    kind: Literal["PipelinePlan"] = "PipelinePlan"
    """Always PipelinePlan."""
    schedule: Literal["1f1b", "gpipe", "interleaved-1f1b", "zb-h1"]
    """Pipeline schedule the training runs: it fixes the order of each stage's computations."""
    num_stages: int = Field(ge=1)
    """Pipeline stages (GPUs per pipeline)."""
    num_microbatches: int = Field(ge=1)
    """Microbatches per iteration."""
    virtual_stages: int = Field(default=1, ge=1, description="Model stages per GPU.")
    granularity: Granularity = Field(description="Which part of each StagePlan to apply.")
    objective: PlanObjective
    """Why this point of the time-energy frontier was chosen: MinTime (no slowdown),
    Straggler (as slow as the slowest replica) or MaxSlowdown (within a slowdown budget)."""
    target_iteration_time_s: float | None = Field(
        default=None, gt=0, description="T' of a straggler or the slowdown deadline, if any."
    )
    unit_time_s: float = Field(gt=0)
    """The planner's time quantum (seconds): its iteration times are multiples of it."""
    blocking_power_w: float = Field(ge=0)
    """Power of one GPU while it waits for another stage (watts), from the profile."""
    t_min_s: float = Field(gt=0, description="Fastest iteration time on the frontier.")
    t_star_s: float = Field(gt=0, description="Iteration time of the minimum-energy point.")
    baseline_iteration_time_s: float = Field(gt=0, description="All GPUs at max clock.")
    instruction_estimate: PlanEstimate
    """Predicted time and energy when the clocks change at every computation (Instruction)."""
    stage_estimate: PlanEstimate
    """Predicted time and energy with one clock per stage (Stage)."""
    stages: list[StagePlan]
    """The clocks of every stage, stage 0 first."""

    @property
    def estimate(self) -> PlanEstimate:
        """The estimate of the granularity the plan is applied at."""
        if self.granularity == Granularity.INSTRUCTION:
            return self.instruction_estimate
        return self.stage_estimate

    @model_validator(mode="after")
    def _consistent(self) -> PipelinePlan:
        if [s.stage for s in self.stages] != list(range(self.num_stages)):
            raise ValueError(f"stages must list stages 0..{self.num_stages - 1} in order")
        try:
            orders = [
                gpu_computation_order(
                    self.schedule, self.num_stages, self.num_microbatches, s, self.virtual_stages
                )
                for s in range(self.num_stages)
            ]
        except ValueError as exc:  # ScheduleError: sizes the schedule does not accept
            raise ValueError(str(exc)) from None
        for s, order in zip(self.stages, orders, strict=True):
            if len(s.instructions) != len(order):
                raise ValueError(
                    f"stage {s.stage} lists {len(s.instructions)} computations, expected "
                    f"{len(order)} ({self.schedule} with {self.num_microbatches} microbatches)"
                )
            # Agents follow this order to know which computation comes next.
            listed = [_step(i, s.stage, self.virtual_stages) for i in s.instructions]
            if listed != order:
                k = next(k for k, (a, b) in enumerate(zip(listed, order, strict=True)) if a != b)
                raise ValueError(
                    f"stage {s.stage} must list its computations in {self.schedule} order: "
                    f"computation {k} is {_label(listed[k], self.virtual_stages)}, expected "
                    f"{_label(order[k], self.virtual_stages)}"
                )
        return self


def _step(clock: InstructionClock, stage: int, virtual_stages: int) -> Step:
    """The computation an instruction names; ``virtual_stage`` is required with virtual
    stages (else ambiguous) and, without, may only repeat the stage."""
    virtual = clock.virtual_stage
    if virtual is None:
        virtual = stage if virtual_stages == 1 else -1
    return Step(clock.instruction, clock.microbatch, virtual)


def _label(step: Step, virtual_stages: int) -> str:
    where = ""
    if virtual_stages > 1:
        where = f" on virtual stage {step.virtual_stage}" if step.virtual_stage >= 0 else ""
        where = where or " without a virtual stage"
    return f"{step.instruction} of microbatch {step.microbatch}{where}"


def placeholder_plan(
    schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int, clock_mhz: int
) -> PipelinePlan:
    """A plan that only says which computations each stage runs, in ``schedule``'s order (one
    of the planner's spellings, e.g. ``interleaved-1f1b``), all at ``clock_mhz``: what a
    profiling node plan carries (the agents measure instead of applying it). The operator's
    profiling phase and ``perseus profile-plan`` both write it."""
    estimate = PlanEstimate(iteration_time_s=1.0, energy_j=1.0, savings_ratio=0.0)
    return PipelinePlan(
        schedule=schedule,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        virtual_stages=virtual_stages,
        granularity=Granularity.INSTRUCTION,
        objective=PlanObjective.MIN_TIME,
        unit_time_s=0.001,
        blocking_power_w=1.0,
        t_min_s=1.0,
        t_star_s=1.0,
        baseline_iteration_time_s=1.0,
        instruction_estimate=estimate,
        stage_estimate=estimate,
        stages=[
            StagePlan(
                stage=s,
                frequency_mhz=clock_mhz,
                instructions=[
                    InstructionClock(
                        instruction=step.instruction,
                        microbatch=step.microbatch,
                        frequency_mhz=clock_mhz,
                        virtual_stage=step.virtual_stage if virtual_stages > 1 else None,
                    )
                    for step in gpu_computation_order(
                        schedule, num_stages, num_microbatches, s, virtual_stages
                    )
                ],
            )
            for s in range(num_stages)
        ],
    )
