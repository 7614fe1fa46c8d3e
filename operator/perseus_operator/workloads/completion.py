"""Whether a workload ended, and how: by its own status conditions, or by its pods' phases.

Pure functions over objects as the API server returns them; the job's reconcile reads them to
end a PerseusJob when its workload ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from perseus_api.job import WorkloadKind
from perseus_operator.workloads.objects import get_path, listed
from perseus_operator.workloads.pods import Pod, phase_of, pod_name

_LISTED_PODS: Final = 5


def workload_finished(pods: Sequence[Pod]) -> bool:
    """Whether every pod of the workload has succeeded (and there is at least one)."""
    return bool(pods) and all(phase_of(p) == "Succeeded" for p in pods)


# Status conditions that say a workload object ended: (succeeded, failed) condition types.
_END_CONDITIONS: Final = {
    WorkloadKind.PYTORCH_JOB: ("Succeeded", "Failed"),  # Kubeflow training operator v1
    WorkloadKind.JOB_SET: ("Completed", "Failed"),
    WorkloadKind.TRAIN_JOB: ("Complete", "Failed"),  # Kubeflow Trainer v2
}


@dataclass(frozen=True)
class WorkloadEnd:
    """How a workload object says it ended: ``failure`` is None when it succeeded."""

    failure: str | None


def workload_end(kind: WorkloadKind, workload: Mapping[str, Any]) -> WorkloadEnd | None:
    """How the workload ended by its own status conditions, or None while it runs (or for
    kind Pods, which has no object). Its pods may be gone by then (``cleanPodPolicy``, a TTL),
    so this is read before them."""
    types = _END_CONDITIONS.get(kind)
    conditions = get_path(workload, "status", "conditions")
    if types is None or not isinstance(conditions, list):
        return None
    succeeded, failed = types
    for condition in conditions:
        if not isinstance(condition, Mapping) or condition.get("status") != "True":
            continue
        if condition.get("type") == failed:
            why = ": ".join(
                str(part) for part in (condition.get("reason"), condition.get("message")) if part
            )
            name = get_path(workload, "metadata", "name") or "?"
            return WorkloadEnd(f"{kind.value} {name} failed" + (f" ({why})" if why else ""))
        if condition.get("type") == succeeded:
            return WorkloadEnd(None)
    return None


def workload_failed(pods: Sequence[Pod]) -> str | None:
    """Which pods failed and why, or ``None`` when none has."""
    failed = sorted((pod_name(p), _failure(p)) for p in pods if phase_of(p) == "Failed")
    if not failed:
        return None
    names = listed([f"{name} ({why})" if why else name for name, why in failed], _LISTED_PODS)
    return f"pod {names} failed" if len(failed) == 1 else f"{len(failed)} pods failed: {names}"


def _failure(pod: Pod) -> str:
    """The pod's own reason (e.g. Evicted), else its first container that exited badly."""
    reason, message = get_path(pod, "status", "reason"), get_path(pod, "status", "message")
    if reason:
        return f"{reason}: {message}" if message else str(reason)
    statuses = get_path(pod, "status", "containerStatuses")
    for status in statuses if isinstance(statuses, list) else []:
        terminated = get_path(status, "state", "terminated")
        code = get_path(terminated, "exitCode")
        if code not in (None, 0):
            why = get_path(terminated, "reason")
            return f"{why}, exit code {code}" if why else f"exit code {code}"
    return ""
