"""The ``status`` documents of node plans (pure): applied, not applied, agent stopped.

:class:`~perseus_agent.kube.report_writer.ReportWriter` writes them (adding each condition's
``lastTransitionTime``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from perseus_api import resources
from perseus_api.node_report import (
    GpuReport,
    GpuStatus,
    NodePlanStatus,
    NodeReport,
    StatusCondition,
    status_document,
)

__all__ = ["invalid_status", "report_status", "stopped_status"]


def report_status(report: NodeReport, denied: Sequence[GpuReport] = ()) -> dict[str, Any]:
    """The ``status`` of a node plan applied as ``report`` says (plus GPUs ``denied`` to it)."""
    if denied:
        report = report.model_copy(update={"gpus": [*report.gpus, *denied]})
    failed = [g for g in report.gpus if g.status == GpuStatus.FAILED]
    counts: dict[str, int] = {}
    for g in report.gpus:
        counts[g.status] = counts.get(g.status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no GPUs assigned"
    if failed:
        details = "; ".join(f"GPU {_gpu_name(g)}: {g.message}" for g in failed)
        condition = _condition(False, resources.REASON_FAILED, f"{summary}: {details}")
    else:
        condition = _condition(True, resources.REASON_APPLIED, summary)
    status = NodePlanStatus.of_report(
        report,
        # Changes with every periodic report, so that each is written: the operator tells a
        # live agent from a dead one by it.
        reported_at=datetime.now(tz=UTC).isoformat(timespec="milliseconds"),
        conditions=[condition],
    )
    return status_document(status)


def invalid_status(
    message: str, revision: int | None, reason: str = resources.REASON_INVALID_SPEC
) -> dict[str, Any]:
    """The ``status`` of a node plan that is not applied at all; ``message`` says why (the
    report's fields are written null, which removes a previous report's)."""
    status = NodePlanStatus(
        observed_revision=revision, conditions=[_condition(False, reason, message)]
    )
    return status_document(status)


def stopped_status(revision: int | None, *, reset_ok: bool) -> dict[str, Any]:
    """The ``status`` of a node plan whose agent stopped (its clocks reset, if ``reset_ok``)."""
    if reset_ok:
        message = (
            "the node agent stopped and reset every GPU clock of this plan; "
            "it applies the plan again when it restarts"
        )
    else:
        message = (
            "the node agent stopped but could not reset every GPU clock it changed on this "
            "node (see the agent's log); it resets them when it restarts"
        )
    return invalid_status(message, revision, reason=resources.REASON_AGENT_STOPPED)


def _condition(ok: bool, reason: str, message: str) -> StatusCondition:
    return StatusCondition(
        type=resources.CONDITION_APPLIED,
        status="True" if ok else "False",
        reason=reason,
        message=message,
    )


def _gpu_name(g: GpuReport) -> str:
    if g.index is not None:
        return str(g.index)
    return g.uuid if g.uuid is not None else f"of rank {g.rank}"
