"""Shared data formats of the Perseus operator, node agents and planner."""

from perseus_api.errors import ApiError, ProfileError
from perseus_api.node_plan import GpuAssignment, NodePlan
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
    "ApiError",
    "GpuAssignment",
    "Granularity",
    "InstructionClock",
    "NodePlan",
    "PipelinePlan",
    "PlanEstimate",
    "PlanObjective",
    "ProfileError",
    "StagePlan",
]
