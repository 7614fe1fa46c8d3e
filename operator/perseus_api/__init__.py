"""Shared data formats of the Perseus operator, node agents and planner."""

from perseus_api.plan import (
    API_VERSION,
    Granularity,
    InstructionClock,
    PipelinePlan,
    PlanEstimate,
    PlanObjective,
    StagePlan,
)

__all__ = [
    "API_VERSION",
    "Granularity",
    "InstructionClock",
    "PipelinePlan",
    "PlanEstimate",
    "PlanObjective",
    "StagePlan",
]
