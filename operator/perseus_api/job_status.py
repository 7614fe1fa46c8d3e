"""The status of a ``PerseusJob`` (what the operator reports) and the whole object.

:mod:`perseus_api.job` owns the spec users write; this module owns what the operator writes
back (phase, conditions, frontier, plan, stragglers), the ``kubectl get`` columns, and
:class:`PerseusJob`, the object as the API server returns it (spec and status together). It
imports the spec, never the reverse.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, model_validator

from perseus_api.conventions import percent
from perseus_api.job import JOB_KIND, Mode, PerseusJobSpec
from perseus_api.plan import API_VERSION, Granularity
from perseus_api.spec_model import _Spec


class Phase(StrEnum):
    PENDING = "Pending"
    PROFILING = "Profiling"
    OPTIMIZING = "Optimizing"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"


# Reasons the operator gives for Profiled=False include Profiling, ProfileRequired (Observe, no
# stored profile), NoTrainingProcess and ProfilingStalled (profiling.trainingProcessTimeoutSeconds).
class ConditionType(StrEnum):
    PROFILED = "Profiled"
    OPTIMIZED = "Optimized"
    PLAN_APPLIED = "PlanApplied"
    STRAGGLER_DETECTED = "StragglerDetected"
    DEGRADED = "Degraded"


class _Status(_Spec):
    model_config = ConfigDict(frozen=False, extra="ignore")


class Condition(_Status):
    """One aspect of the job's state, as Kubernetes conditions say it."""

    type: ConditionType
    """Profiled, Optimized, PlanApplied, StragglerDetected or Degraded."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str = Field(min_length=1)
    """Why, in one CamelCase word (for example ProfileRequired)."""
    message: str = ""
    """Why, in words: what happened and what to do about it."""
    last_transition_time: str | None = None
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The spec generation the condition was set for."""


class FrontierSummary(_Status):
    """The iteration time-energy frontier the job is planned from."""

    t_min_seconds: float
    """Shortest iteration time on the frontier (T_min), in seconds."""
    t_star_seconds: float
    """Iteration time of the frontier's minimum-energy point (T*), in seconds."""
    t_max_seconds: float
    """Longest iteration time on the frontier (T_max), in seconds."""
    points: int
    """Number of points on the frontier."""
    profile_config_map: str = Field(description="ConfigMap holding the profile planned from.")


class PlanStatus(_Status):
    """The plan the node agents apply now."""

    target_iteration_seconds: float
    """Iteration time the plan is for: T_min, or a straggler's T' (at most T*), in seconds."""
    expected_savings_ratio: float = Field(
        description="Expected energy saved vs. all GPUs at max clock, at the same throughput."
    )
    expected_savings: str = ""
    """expectedSavingsRatio as a percent (14.5%), for kubectl get."""
    revision: int
    """Revision of the node plans that carry the plan."""

    @model_validator(mode="after")
    def _savings_percent(self) -> PlanStatus:
        # Derived, so that no writer can forget it and older statuses gain it when read.
        object.__setattr__(self, "expected_savings", percent(self.expected_savings_ratio))
        return self


class StragglerStatus(_Status):
    """A data-parallel replica that straggles."""

    data_parallel_rank: int
    """The straggling data-parallel replica."""
    node: str
    """A node that runs the straggling replica."""
    slowdown: float = Field(description="T'/T: the straggler's iteration time over the others'.")
    since: str
    """When the replica was first seen straggling (RFC 3339)."""


class PerseusJobStatus(_Status):
    """What the operator observed and did. Written by the operator only."""

    phase: Phase = Phase.PENDING
    """Pending, Profiling, Optimizing, Running, Completed or Failed."""
    observed_generation: int | None = None
    """The spec generation this status describes."""
    mode: Mode | None = Field(default=None, description="The policy in effect (with defaults).")
    granularity: Granularity | None = None
    """The granularity in effect (with defaults): Stage or Instruction."""
    revision: int = Field(default=0, description="Last revision of the node plans written.")
    profiling_started_at: str | None = Field(
        default=None,
        description="When the profiling plans were written (RFC 3339): the training "
        "processes' wait (profiling.trainingProcessTimeoutSeconds) counts from then.",
    )
    profiling_progress: int = Field(
        default=0,
        description="While profiling: iterations measured or dropped and clocks done, over "
        "all GPUs, when last seen (the sweep stands still while it does not change).",
    )
    profiling_progress_at: str | None = Field(
        default=None,
        description="When profilingProgress last changed (RFC 3339).",
    )
    message: str = ""
    """What the operator is doing or waiting for, in words."""
    conditions: list[Condition] = Field(default_factory=list)
    """Profiled, Optimized, PlanApplied, StragglerDetected and Degraded, each with a reason and a
    message."""
    frontier: FrontierSummary | None = None
    """The iteration time-energy frontier the job is planned from."""
    plan: PlanStatus | None = None
    """The plan the node agents apply now."""
    stragglers: list[StragglerStatus] = Field(default_factory=list)
    """The data-parallel replicas straggling now."""
    nodes: list[str] = Field(default_factory=list, description="Nodes running the workload.")


PRINTER_COLUMNS: Final = (
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Mode", "type": "string", "jsonPath": ".status.mode"},
    {
        "name": "Target T",
        "type": "number",
        "jsonPath": ".status.plan.targetIterationSeconds",
        "description": "Target iteration time, seconds.",
    },
    {
        "name": "Expected savings",
        "type": "string",
        "jsonPath": ".status.plan.expectedSavings",
        "description": "Expected energy saved vs. all GPUs at max clock.",
    },
    {
        "name": "Stragglers",
        "type": "string",
        "jsonPath": ".status.stragglers[*].dataParallelRank",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


class PerseusJob(_Spec):
    """A whole ``PerseusJob`` object as the API server returns it."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["perseus.energy/v1alpha1"] = API_VERSION
    kind: Literal["PerseusJob"] = JOB_KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: PerseusJobSpec
    status: PerseusJobStatus = Field(default_factory=PerseusJobStatus)
