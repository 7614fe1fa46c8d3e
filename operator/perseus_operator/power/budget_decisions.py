"""The decisions of one PerseusPowerBudget round: whether to solve the allocation again, which
jobs to re-target to which frontier point, and the budget's status.

Pure, like :mod:`perseus_operator.policies.policy_sync`: the controller that lists the domain's
nodes and jobs, measures the draw and writes the results is a thin executor around
:func:`decide_budget`. A job is re-targeted through the same path as around a straggler: its
plans are rebuilt from its stored frontier for a target iteration time (no re-solve).

Re-solved when the budget's spec changes (its generation), a job starts or ends, a straggler
appears or recovers (a job's floor changes), or the unmanaged GPUs' draw moves by more than
``rebalanceBandRatio`` of the budget; otherwise the last allocation stands. Hysteresis on each
job: after a re-solve a job keeps its current point when the new one is within the band of its
own watts and keeping it still fits the budget, so small changes do not rewrite every plan.

With ``enforcement: PlansAndPowerLimits``, :func:`gpu_power_limits` gives each managed GPU its
share of its job's allocated watts plus the safety margin, as a per-GPU power limit.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from perseus_api.conventions import now_rfc3339
from perseus_api.node_plan import MAX_POWER_LIMIT_W, MIN_POWER_LIMIT_W
from perseus_api.power_budget import (
    MAX_JOBS_REPORTED,
    BudgetCondition,
    BudgetConditionType,
    Enforcement,
    JobAllocation,
    PerseusPowerBudgetSpec,
    PerseusPowerBudgetStatus,
)
from perseus_api.resources import JOB_LABEL, object_key
from perseus_planner.power import JobPoints, allocate

JobKey = tuple[str, str]
"""(namespace, name) of a PerseusJob."""

_NODES_NAMED = 5


@dataclass(frozen=True)
class DomainJob:
    """A managed job running in the domain.

    Attributes:
        namespace, name: The PerseusJob.
        points: Its frontier as (frontier time, replayed watts of all its GPUs), with its
            weight and straggler floor (:func:`perseus_planner.power.frontier_points`).
        frontier_indices: The frontier index of each point.
        gpus: Its GPUs in the domain.
    """

    namespace: str
    name: str
    points: JobPoints
    frontier_indices: npt.NDArray[np.int64]
    gpus: int = 0

    @property
    def key(self) -> JobKey:
        return (self.namespace, self.name)

    @property
    def t_min_position(self) -> int:
        return int(np.argmin(self.points.times_s))


@dataclass(frozen=True)
class Assigned:
    """A job's point: its position in the job's points, watts and slowdown."""

    position: int
    watts: float
    slowdown: float


@dataclass(frozen=True)
class BudgetMemo:
    """What the allocation in force was solved for, kept by the controller between rounds."""

    generation: int
    floors: Mapping[JobKey, float | None]
    unmanaged_w: float
    assigned: Mapping[JobKey, Assigned]
    missing_w: float = 0.0


@dataclass(frozen=True)
class Retarget:
    """Rewrite a job's plans for ``target_s`` (``None``: its ``T_min`` plan, or its straggler's
    ``T'`` when it has one) from frontier point ``frontier_index``."""

    namespace: str
    name: str
    target_s: float | None
    frontier_index: int


@dataclass(frozen=True)
class BudgetDecision:
    """The outcome of one round."""

    status: PerseusPowerBudgetStatus
    retargets: tuple[Retarget, ...]
    memo: BudgetMemo
    resolved: str | None = None  # why the allocation was solved again (None: it stood)


def resolve_reason(
    memo: BudgetMemo | None,
    generation: int,
    jobs: Sequence[DomainJob],
    unmanaged_w: float,
    band_w: float,
) -> str | None:
    """Why the allocation must be solved again, or ``None`` when the last one stands."""
    if memo is None:
        return "first allocation"
    if generation != memo.generation:
        return "the budget changed"
    floors = {j.key: j.points.floor_s for j in jobs}
    if set(floors) != set(memo.floors):
        return "jobs started or ended"
    if floors != dict(memo.floors):
        return "a straggler appeared or recovered"
    if abs(unmanaged_w - memo.unmanaged_w) > band_w:
        return f"the unmanaged draw moved {unmanaged_w - memo.unmanaged_w:+.0f} W"
    return None


def decide_budget(
    spec: PerseusPowerBudgetSpec,
    generation: int,
    jobs: Sequence[DomainJob],
    *,
    unmanaged_w: float,
    measured_w: float | None,
    memo: BudgetMemo | None,
    previous: PerseusPowerBudgetStatus | None = None,
    nodes: int = 0,
    overlapping_nodes: Iterable[str] = (),
) -> BudgetDecision:
    """One round of a budget (see the module docstring).

    Args:
        spec: The budget.
        generation: Its ``metadata.generation``.
        jobs: The managed jobs running in the domain.
        unmanaged_w: Measured draw of the domain's GPUs no job manages (averaged).
        measured_w: The domain's whole GPU draw, averaged over the window (None: no data yet).
        memo: What the allocation in force was solved for (None: none yet).
        previous: The status written last (keeps the conditions' transition times).
        nodes: Nodes in the domain.
        overlapping_nodes: Nodes of the domain another budget selects too.
    """
    band_w = spec.rebalance_band_ratio * spec.budget_watts
    reason = resolve_reason(memo, generation, jobs, unmanaged_w, band_w)
    retargets: list[Retarget] = []
    if reason is None:
        assert memo is not None
        new_memo = memo
    else:
        result = allocate([j.points for j in jobs], spec.planned_watts, unmanaged_w)
        fresh = {
            j.key: Assigned(s.index, s.power_w, s.slowdown)
            for j, s in zip(jobs, result.shares, strict=True)
        }
        before = {} if memo is None else dict(memo.assigned)
        assigned = _with_hysteresis(
            fresh, before, spec.rebalance_band_ratio, spec.planned_watts - unmanaged_w
        )
        for j in jobs:
            now = assigned[j.key]
            if j.key in before and before[j.key].position == now.position:
                continue
            at_t_min = now.position == j.t_min_position
            target_s = None if at_t_min else float(j.points.times_s[now.position])
            index = int(j.frontier_indices[now.position])
            retargets.append(Retarget(j.namespace, j.name, target_s, index))
        new_memo = BudgetMemo(
            generation,
            {j.key: j.points.floor_s for j in jobs},
            unmanaged_w,
            assigned,
            result.missing_w,
        )
    status = _status(spec, generation, jobs, new_memo, unmanaged_w, measured_w, nodes, previous,
                     sorted(set(overlapping_nodes)))  # fmt: skip
    return BudgetDecision(status, tuple(retargets), new_memo, reason)


def _with_hysteresis(
    fresh: Mapping[JobKey, Assigned],
    before: Mapping[JobKey, Assigned],
    band_ratio: float,
    available_w: float,
) -> dict[JobKey, Assigned]:
    """``fresh``, except that a job whose new watts are within the band of its current ones
    keeps its current point, while the total still fits (the ones that free watts first)."""
    out = dict(fresh)
    total = math.fsum(a.watts for a in fresh.values())
    candidates = [
        (old.watts - fresh[key].watts, key, old)
        for key, old in before.items()
        if key in fresh
        and old.position != fresh[key].position
        and abs(fresh[key].watts - old.watts) <= band_ratio * old.watts
    ]
    for extra_w, key, old in sorted(candidates, key=lambda c: c[0]):
        if total + extra_w <= available_w:
            out[key] = old
            total += extra_w
    return out


def _status(
    spec: PerseusPowerBudgetSpec,
    generation: int,
    jobs: Sequence[DomainJob],
    memo: BudgetMemo,
    unmanaged_w: float,
    measured_w: float | None,
    nodes: int,
    previous: PerseusPowerBudgetStatus | None,
    overlapping: list[str],
) -> PerseusPowerBudgetStatus:
    budget_w = spec.budget_watts
    allocations = sorted(
        (
            JobAllocation(
                namespace=j.namespace,
                name=j.name,
                allocatedWatts=round(memo.assigned[j.key].watts, 1),
                slowdownRatio=round(memo.assigned[j.key].slowdown, 6),
                weight=j.points.weight,
                gpus=j.gpus,
            )
            for j in jobs
        ),
        key=lambda a: (-a.allocated_watts, a.namespace, a.name),
    )
    allocated_w = math.fsum(memo.assigned[j.key].watts for j in jobs)
    conditions = [_met(budget_w, measured_w), _infeasible(spec, memo.missing_w)]
    if overlapping:
        named = ", ".join(overlapping[:_NODES_NAMED])
        more = (
            f" and {len(overlapping) - _NODES_NAMED} more"
            if len(overlapping) > _NODES_NAMED
            else ""
        )
        conditions.append(
            BudgetCondition(
                type=BudgetConditionType.OVERLAPPING,
                status="True",
                reason="NodeInTwoDomains",
                message=f"{named}{more} also selected by another PerseusPowerBudget",
            )
        )
    else:
        conditions.append(
            BudgetCondition(type=BudgetConditionType.OVERLAPPING, status="False", reason="Disjoint")
        )
    return PerseusPowerBudgetStatus(
        observedGeneration=generation,
        budgetWatts=budget_w,
        measuredWatts=None if measured_w is None else round(measured_w, 1),
        headroomWatts=None if measured_w is None else round(budget_w - measured_w, 1),
        allocatedWatts=round(allocated_w, 1),
        unmanagedWatts=round(unmanaged_w, 1),
        missingWatts=round(memo.missing_w, 1) if memo.missing_w > 0 else None,
        nodes=nodes,
        managedJobs=len(jobs),
        jobs=allocations[:MAX_JOBS_REPORTED],
        conditions=_stamped(conditions, previous, generation),
    )


def _met(budget_w: float, measured_w: float | None) -> BudgetCondition:
    if measured_w is None:
        return BudgetCondition(
            type=BudgetConditionType.MET,
            status="Unknown",
            reason="NoMeasurement",
            message="no draw measured over the window yet",
        )
    within = measured_w <= budget_w
    return BudgetCondition(
        type=BudgetConditionType.MET,
        status="True" if within else "False",
        reason="WithinBudget" if within else "OverBudget",
        message=f"{measured_w:.0f} W measured of {budget_w:.0f} W",
    )


def _infeasible(spec: PerseusPowerBudgetSpec, missing_w: float) -> BudgetCondition:
    if missing_w <= 0:
        return BudgetCondition(
            type=BudgetConditionType.INFEASIBLE, status="False", reason="Feasible"
        )
    return BudgetCondition(
        type=BudgetConditionType.INFEASIBLE,
        status="True",
        reason="BelowLeastDraw",
        message=f"{missing_w:.0f} W missing: every job at its slowest point plus the unmanaged "
        f"GPUs draws more than the {spec.planned_watts:.0f} W planned for (the budget less "
        f"the safety margin); every job runs its least-power point",
    )


def _stamped(
    conditions: list[BudgetCondition],
    previous: PerseusPowerBudgetStatus | None,
    generation: int,
) -> list[BudgetCondition]:
    """Each condition's transition time: kept while its status stays, now when it changes."""
    before = {c.type: c for c in (previous.conditions if previous else [])}
    now = now_rfc3339()
    out = []
    for c in conditions:
        old = before.get(c.type)
        since = old.last_transition_time if old is not None and old.status == c.status else now
        out.append(c.model_copy(update={"last_transition_time": since,
                                        "observed_generation": generation}))  # fmt: skip
    return out


def overlapping_nodes(domains: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """Per budget, its nodes that another budget selects too."""
    owners: dict[str, set[str]] = {}
    for budget, nodes in domains.items():
        for node in nodes:
            owners.setdefault(node, set()).add(budget)
    shared = {node for node, budgets in owners.items() if len(budgets) > 1}
    return {budget: set(nodes) & shared for budget, nodes in domains.items()}


# -- the backstop: per-GPU power limits (enforcement PlansAndPowerLimits) --------------------------


def job_gpus_by_node(
    nodes: Collection[str], node_plans: Iterable[Mapping[str, Any]]
) -> dict[JobKey, dict[str, int]]:
    """Each job's GPUs on the domain's ``nodes``, by node, from its node plans' assignments."""
    out: dict[JobKey, dict[str, int]] = {}
    for plan in node_plans:
        spec = plan.get("spec") or {}
        node, assignments = spec.get("node"), spec.get("assignments")
        if not isinstance(node, str) or node not in nodes:
            continue
        if not isinstance(assignments, list) or not assignments:
            continue
        namespace, _ = object_key(plan)
        job = spec.get("job") or ((plan.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)
        if not isinstance(job, str) or not job:
            continue
        by_node = out.setdefault((namespace, job), {})
        by_node[node] = by_node.get(node, 0) + len(assignments)
    return out


def gpu_power_limits(
    spec: PerseusPowerBudgetSpec,
    assigned: Mapping[JobKey, Assigned],
    gpus: Mapping[JobKey, Mapping[str, int]],
) -> dict[JobKey, dict[str, float]]:
    """The hard backstop: the power limit of each managed GPU, by job and node.

    Empty unless the budget's enforcement is ``PlansAndPowerLimits``. A job's GPUs share its
    allocated watts equally (the allocation's average draw of all its GPUs, ``assigned``, over
    its GPUs in the domain, ``gpus``), plus the budget's safety margin on top
    (``share x (1 + safetyMarginRatio)``): the limits sum to about the budget while the plans aim
    below it, so the limits bite only when a job draws more than its plan said. Rounded to a
    tenth of a watt and kept within the node plan's bounds; the agents clamp further to what
    each GPU accepts.
    """
    if spec.enforcement != Enforcement.PLANS_AND_POWER_LIMITS:
        return {}
    out: dict[JobKey, dict[str, float]] = {}
    for key, share in sorted(assigned.items()):
        by_node = gpus.get(key) or {}
        count = sum(by_node.values())
        if count <= 0 or not math.isfinite(share.watts) or share.watts <= 0:
            continue
        limit_w = round(share.watts / count * (1.0 + spec.safety_margin_ratio), 1)
        limit_w = min(max(limit_w, MIN_POWER_LIMIT_W), MAX_POWER_LIMIT_W)
        out[key] = dict.fromkeys(sorted(by_node), limit_w)
    return out
