"""The decisions of a ``Running`` job: the agents' reports as straggler samples, what the
detector's verdict does to the status, and whether the plans are written again for a new
straggler target.

Pure, as :mod:`perseus_operator.jobs.job_decisions`; the detector itself
(:class:`~perseus_operator.jobs.stragglers.StragglerDetector`) is kept in the job's memo by
:mod:`perseus_operator.jobs.lifecycle`, which passes its verdict here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from perseus_api import resources
from perseus_api.conventions import now_rfc3339, parse_rfc3339
from perseus_api.job import Mode, PerseusJobSpec
from perseus_api.job_status import ConditionType, StragglerStatus
from perseus_api.job_status import PerseusJobStatus as Status
from perseus_api.node_report import NodePlanStatus
from perseus_operator.jobs.job_decisions import Decision, StatusDraft, TargetFor
from perseus_operator.jobs.node_status import (
    PlanReport,
    expected_iteration_s,
    plan_report,
)
from perseus_operator.jobs.planning import applies_clocks
from perseus_operator.jobs.stragglers import RankSample, StragglerVerdict
from perseus_operator.workloads.ranks import RankPlacement

__all__ = [
    "RunningDecision",
    "decide_running",
    "expected_iteration_s",
    "fastest_planned_s",
    "fastest_reported_s",
    "planned_target_s",
    "rank_samples",
    "report_samples",
    "reports_timed",
]


@dataclass(frozen=True)
class RunningDecision:
    """``replan``: write the plans again, for ``retarget_s`` (None: T_min for all).

    ``iterations``: most iterations a rank reported; ``new_stragglers``: replicas that turned
    stragglers in this round (both for the metrics)."""

    decision: Decision
    iterations: int = 0
    new_stragglers: int = 0
    replan: bool = False
    retarget_s: float | None = None


def decide_running(
    spec: PerseusJobSpec,
    status: Status,
    generation: int,
    plans: Sequence[PlanReport],
    verdict: StragglerVerdict,
    reference_s: float | None,
) -> RunningDecision:
    """What one round of reports (the job's node plans ``plans``, the detector's ``verdict``
    and the ``reference_s`` it measured against) says."""
    d = StatusDraft(status, generation)
    if applies_clocks(spec.policy):
        _applied_condition(d, plans)
    new_stragglers = _report_stragglers(d, verdict)
    replan = spec.policy.mode == Mode.STRAGGLER_AWARE and verdict.changed
    retarget_s = None
    if replan:
        if verdict.stragglers:
            planned_s = fastest_reported_s(plans)
            retarget_s = planned_target_s(verdict.target_s, reference_s, planned_s)
        d.do(TargetFor(retarget_s))
    iterations = max([0, *(r.iterations for p in plans for r in p.status.ranks)])
    return RunningDecision(d.decision(), iterations, new_stragglers, replan, retarget_s)


def _report_stragglers(d: StatusDraft, verdict: StragglerVerdict) -> int:
    """The verdict in the status and events; how many replicas newly straggle."""
    previous = {s.data_parallel_rank: s for s in d.status.stragglers}
    d.status.stragglers = [
        StragglerStatus(
            dataParallelRank=s.dp_rank,
            node=s.node,
            slowdown=round(s.slowdown, 4),
            since=previous[s.dp_rank].since if s.dp_rank in previous else now_rfc3339(),
        )
        for s in sorted(verdict.stragglers.values(), key=lambda s: s.dp_rank)
    ]
    for dp in sorted(set(verdict.stragglers) - set(previous)):
        s = verdict.stragglers[dp]
        d.event(
            "Warning",
            "StragglerDetected",
            f"data-parallel replica {dp} on node {s.node} is {s.slowdown:.3f}x slower",
        )
    for dp in sorted(set(previous) - set(verdict.stragglers)):
        d.event("Normal", "StragglerRecovered", f"data-parallel replica {dp} recovered")
    if verdict.stragglers:
        names = ", ".join(str(r) for r in sorted(verdict.stragglers))
        d.condition(ConditionType.STRAGGLER_DETECTED, True, "Straggler", f"replica(s) {names}")
    else:
        d.condition(ConditionType.STRAGGLER_DETECTED, False, "NoStraggler")
    if verdict.degraded_nodes:
        nodes = ", ".join(sorted(verdict.degraded_nodes))
        d.condition(
            ConditionType.DEGRADED, True, "StaleTelemetry", f"no recent reports from {nodes}"
        )
    elif d.degraded("StaleTelemetry"):
        d.condition(ConditionType.DEGRADED, False, "TelemetryRecovered")
    return len(set(verdict.stragglers) - set(previous))


def _applied_condition(d: StatusDraft, plans: Sequence[PlanReport]) -> None:
    revision = d.status.revision
    behind, failed = [], []
    for p in plans:
        status = p.status
        node = "?" if p.node is None else p.node
        if status.observed_revision != revision:
            behind.append(node)
            continue
        for c in status.conditions:
            if c.type == resources.CONDITION_APPLIED and c.status != "True":
                failed.append(f"{node}: {c.message}")
    if failed:
        d.condition(ConditionType.PLAN_APPLIED, False, "ApplyFailed", "; ".join(failed))
    elif behind:
        message = f"waiting for the agents of {', '.join(sorted(behind))}"
        d.condition(ConditionType.PLAN_APPLIED, False, "Pending", message)
    else:
        d.condition(
            ConditionType.PLAN_APPLIED, True, "Applied", f"revision {revision} on all nodes"
        )


# -- the agents' reports -----------------------------------------------------------------------


def rank_samples(
    plans: Sequence[Mapping[str, Any]], ranks: Sequence[RankPlacement], *, now_s: float
) -> list[RankSample]:
    """:func:`report_samples` of node plans ``plans``."""
    return report_samples([plan_report(p) for p in plans], ranks, now_s=now_s)


def report_samples(
    plans: Sequence[PlanReport], ranks: Sequence[RankPlacement], *, now_s: float
) -> list[RankSample]:
    """The straggler detector's input from the agents' reports in the node plans' status.

    A report's time is its ``reportedAt`` (Unix seconds), else ``now_s``; with it, the agent's
    cadence when it says it writes only what changed (``reportIntervalSeconds``,
    ``heartbeatSeconds``: see :mod:`perseus_operator.jobs.straggler_samples`). A report measured
    under an older revision of its node plan than the one written is left out (agents say which
    revision their mean covers). Each rank's mean is given at the pace of the job's fastest
    plan: times the fastest plan's expected iteration time over that of the rank's own plan.
    So a replica re-targeted to a straggler's ``T'`` on purpose neither looks slow nor moves
    the baseline the straggler is measured against, which would end the straggler state as
    soon as the re-targeted plans took effect, and start it again once they were undone.
    """
    placed = {r.rank: r for r in ranks}
    fastest_s = fastest_reported_s(plans)
    samples = []
    for plan in plans:
        status, expected_s = plan.status, plan.expected_s
        node = plan.node
        reported_at = _reported_at_s(status, now_s)
        for report in status.ranks:
            rank, mean_s, iterations = report.rank, report.mean_iteration_s, report.iterations
            where = placed.get(rank)
            if where is None or not math.isfinite(mean_s) or mean_s <= 0:
                continue
            measured_under = report.revision
            if measured_under is not None and measured_under != plan.revision:
                continue
            own_s = expected_s.get(rank)
            if fastest_s is not None and own_s is not None:
                mean_s *= fastest_s / own_s
            samples.append(
                RankSample(
                    rank=rank,
                    dp_rank=where.dp_rank,
                    pp_rank=where.pp_rank,
                    node=node or where.node,
                    iterations=iterations,
                    mean_iteration_s=mean_s,
                    reported_at_s=reported_at,
                    report_interval_s=_positive(status.report_interval_s),
                    heartbeat_s=_positive(status.heartbeat_s),
                )
            )
    return samples


def reports_timed(plans: Sequence[PlanReport]) -> bool:
    """Whether every report in ``plans`` says when it was made (:func:`report_samples` times
    the others by ``now_s``)."""
    for plan in plans:
        status = plan.status
        if status.ranks and (
            status.reported_at is None or parse_rfc3339(status.reported_at) is None
        ):
            return False
    return True


def fastest_planned_s(plans: Sequence[Mapping[str, Any]]) -> float | None:
    """The planned iteration time of the job's fastest plan: the pace :func:`rank_samples`
    gives every rank's measured time at (None without plans)."""
    return min((s for plan in plans for s in expected_iteration_s(plan).values()), default=None)


def fastest_reported_s(plans: Sequence[PlanReport]) -> float | None:
    """:func:`fastest_planned_s` of :class:`PlanReport` s."""
    return min((s for plan in plans for s in plan.expected_s.values()), default=None)


def planned_target_s(
    measured_target_s: float | None, reference_s: float | None, planned_s: float | None
) -> float | None:
    """The straggler's ``T'`` in the frontier's time: its slowdown over the other replicas
    (both measured) times the planned iteration time of the plan they were measured at.

    Measured iteration times carry what the profile does not (the gradient all-reduce, data
    loading, framework overhead), so the wall-clock ``T'`` taken as a frontier time would
    re-target the healthy replicas to run slower than the straggler. Without a reference
    (no replica measured yet) or plans, the measured ``T'`` is used as it is.
    """
    if measured_target_s is None:
        return None
    if reference_s is None or reference_s <= 0 or planned_s is None:
        return measured_target_s
    return measured_target_s / reference_s * planned_s


def _reported_at_s(status: NodePlanStatus, now_s: float) -> float:
    """When the agent wrote ``status``, in Unix seconds (``now_s`` when it does not say)."""
    stamp = status.reported_at
    if stamp is None:
        return now_s
    when = parse_rfc3339(stamp)
    return now_s if when is None else when.timestamp()


def _positive(seconds: float | None) -> float | None:
    """A cadence from a status, None unless a finite positive number of seconds."""
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return None
    return seconds
