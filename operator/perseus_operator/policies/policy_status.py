"""The status a ``PerseusPolicy`` shows after a round: conditions, counts, a message.

Pure: :mod:`perseus_operator.policies.policy_sync` gathers what the round found for each
policy and asks :func:`get_policy_status`; a condition keeps its transition time while its
status stays the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from perseus_api.conventions import percent, transition_time
from perseus_api.policy import PolicyConditionType
from perseus_operator.workloads.objects import listed

__all__ = ["get_policy_status"]

Obj = Mapping[str, Any]

_LISTED: Final = 5
"""Most items one status message names (then "and N more")."""


def get_policy_status(
    body: Obj,
    problem: str | None,
    *,
    now: str,
    managed: Sequence[str],
    jobs: Sequence[Obj],
    unmanageable: Sequence[str],
    losses: Sequence[str],
) -> dict[str, Any]:
    """The status of the policy ``body`` after a round.

    Args:
        body: The policy as the API server returns it (its stored status and generation).
        problem: Why its spec is invalid; None when it is valid.
        now: RFC 3339 time for the conditions that change in this round.
        managed: The workloads it manages (as messages name them).
        jobs: Its PerseusJobs after the round.
        unmanageable: Why the workloads it selects but cannot manage are so.
        losses: The workloads it selects that another policy manages ("workload (winner)").
    """
    stored = body.get("status")
    previous: Mapping[str, Any] = stored if isinstance(stored, Mapping) else {}
    generation = (body.get("metadata") or {}).get("generation")
    if problem is not None:
        accepted = _condition(False, "InvalidSpec", problem)
        overlapping = _condition(False, "NotEvaluated", "the spec is invalid")
        counts: dict[str, Any] = {"matchedWorkloads": 0, "managedJobs": 0}
        message = problem
    else:
        accepted = _condition(True, "Valid", "")
        overlapping = (
            _condition(
                True,
                "OtherPolicyWins",
                f"more specific or higher-priority policies manage {listed(losses, _LISTED, '; ')}",
            )
            if losses
            else _condition(False, "NoOverlap", "")
        )
        counts = {
            "matchedWorkloads": len(managed),
            "managedJobs": len(jobs),
            "expectedSavingsRatio": (savings := _expected_savings(jobs)),
            "expectedSavings": None if savings is None else percent(savings),
        }
        message = f"manages {len(managed)} workloads with {len(jobs)} PerseusJobs"
        if unmanageable:
            message += f"; {len(unmanageable)} without a readable parallelism: "
            message += listed(unmanageable, _LISTED, "; ")
    conditions = [
        _stamped(PolicyConditionType.ACCEPTED, accepted, previous, generation, now),
        _stamped(PolicyConditionType.OVERLAPPING, overlapping, previous, generation, now),
    ]
    status = {"observedGeneration": generation, **counts, "message": message}
    status["conditions"] = conditions
    return {k: v for k, v in status.items() if v is not None}


def _condition(ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"status": "True" if ok else "False", "reason": reason, "message": message}


def _stamped(
    kind: PolicyConditionType,
    condition: Mapping[str, str],
    previous: Mapping[str, Any],
    generation: object,
    now: str,
) -> dict[str, Any]:
    """The condition, with the transition time it had while its status stays the same."""
    before: Mapping[str, Any] = next(
        (c for c in previous.get("conditions") or () if c.get("type") == kind.value), {}
    )
    stamp = transition_time(
        condition["status"], before.get("status"), before.get("lastTransitionTime"), now
    )
    out: dict[str, Any] = {"type": kind.value, **condition, "lastTransitionTime": stamp}
    if isinstance(generation, int):
        out["observedGeneration"] = generation
    return out


def _expected_savings(jobs: Sequence[Obj]) -> float | None:
    """Expected savings over the jobs that have a plan, weighted by their GPUs."""
    weighted = total = 0.0
    for job in jobs:
        plan = (job.get("status") or {}).get("plan") or {}
        ratio = plan.get("expectedSavingsRatio")
        if not isinstance(ratio, int | float):
            continue
        gpus = _gpus(job)
        weighted += ratio * gpus
        total += gpus
    return round(weighted / total, 6) if total else None


def _gpus(job: Obj) -> int:
    p = (job.get("spec") or {}).get("parallelism") or {}
    try:
        return (
            int(p.get("pipelineStages", 1))
            * int(p.get("dataParallel", 1))
            * int(p.get("tensorParallel", 1))
        )
    except (TypeError, ValueError):
        return 1
