"""One job per GPU (pure): which plan of this node's jobs may drive which GPU.

When plans of several jobs claim the same GPU, the *older* plan keeps it — older meaning
delivered first by :class:`~perseus_agent.kube.plan_source.NodePlanSource`, which delivers the
objects of its first listing in ``creationTimestamp`` order, so a restarted agent picks the
same winners — and the newer plan gets that GPU reported ``Failed``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from perseus_agent.gpu.base import GpuInfo
from perseus_api.node_plan import GpuAssignment, NodePlan
from perseus_api.node_report import GpuReport, GpuStatus
from perseus_api.plan import Granularity

__all__ = ["GpuGrant", "arbitrate_gpus", "resolve_gpu", "restrict_plan"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class GpuGrant:
    """What one plan may apply after arbitration."""

    plan: NodePlan
    """The plan without the assignments of GPUs an older plan holds."""
    gpu_indices: frozenset[int]
    """The GPUs of this node the plan holds."""
    denied: tuple[GpuReport, ...]
    """A ``Failed`` report for each GPU an older plan holds."""


def resolve_gpu(assignment: GpuAssignment, devices: Sequence[GpuInfo]) -> GpuInfo | None:
    """The GPU of ``devices`` an assignment means: by UUID if it has one, else by index."""
    for gpu in devices:
        if assignment.gpu_uuid is not None:
            if gpu.uuid == assignment.gpu_uuid:
                return gpu
        elif gpu.index == assignment.gpu_index:
            return gpu
    return None


def arbitrate_gpus(
    plans: Sequence[tuple[K, NodePlan]], devices: Sequence[GpuInfo]
) -> dict[K, GpuGrant]:
    """One job per GPU: ``plans`` oldest first; a GPU goes to the first plan that claims it.

    Assignments of GPUs that do not exist on the node are left in the plan (the applier
    reports them); so are two assignments of one GPU in the same plan.
    """
    owners: dict[int, NodePlan] = {}
    grants: dict[K, GpuGrant] = {}
    for key, plan in plans:
        granted: list[GpuAssignment] = []
        denied: list[GpuReport] = []
        mine: set[int] = set()
        for a in plan.assignments:
            gpu = resolve_gpu(a, devices)
            owner = None if gpu is None else owners.get(gpu.index)
            if gpu is None or owner is None:
                granted.append(a)
                if gpu is not None:
                    mine.add(gpu.index)
                continue
            stage_plan = plan.plans[a.plan].stages[a.stage]
            denied.append(
                GpuReport(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    plan=a.plan,
                    stage=a.stage,
                    dp_rank=a.dp_rank,
                    rank=a.rank,
                    target_mhz=(
                        stage_plan.frequency_mhz if plan.granularity == Granularity.STAGE else None
                    ),
                    applied_mhz=None,
                    status=GpuStatus.FAILED,
                    message=(
                        f"gpu_conflict: GPU {gpu.index} ({gpu.uuid}) is used by job "
                        f"{owner.namespace}/{owner.job}, whose plan is older"
                    ),
                )
            )
        for index in mine:
            owners[index] = plan
        restricted = plan.model_copy(update={"assignments": granted}) if denied else plan
        grants[key] = GpuGrant(restricted, frozenset(mine), tuple(denied))
    return grants


def restrict_plan(plan: NodePlan, devices: Sequence[GpuInfo], keep: frozenset[int]) -> NodePlan:
    """``plan`` without its assignments of GPUs (of ``devices``) outside ``keep``."""
    assignments = [
        a for a in plan.assignments if (gpu := resolve_gpu(a, devices)) is None or gpu.index in keep
    ]
    if len(assignments) == len(plan.assignments):
        return plan
    return plan.model_copy(update={"assignments": assignments})
