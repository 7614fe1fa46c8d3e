"""Two PerseusJobs that select the same pods would both plan their GPUs: which one keeps them.

A GPU is claimed by the node plans written for it. When a job's GPUs are already claimed by
another job's node plans, the older job keeps them (``creationTimestamp``, then name, so the
order is total and the same from both sides): the newer one writes no node plans, and says
which job holds its GPUs, until that one lets them go. Two jobs created together may both
write plans before either sees the other's; at the next reconcile the newer one withdraws.

Pure functions; :mod:`perseus_operator.jobs.lifecycle` reads the cluster and acts on the verdict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from perseus_api.conventions import parse_rfc3339
from perseus_api.resources import either

__all__ = [
    "CONFLICT_REASON",
    "GpuClaim",
    "GpuConflict",
    "claims_of_node_plans",
    "decide_gpu_conflict",
    "planned_gpus",
]

CONFLICT_REASON: Final = "GpuConflict"

Gpu = tuple[str, str]
"""``(node, key)``: the key names the GPU by the process on it (``pod#local_rank``, as
:attr:`perseus_operator.workloads.ranks.RankPlacement.gpu_key`); the kubelet, not the operator,
knows its index."""

_MAX_LISTED_GPUS: Final = 4
_UNKNOWN_AGE: Final = datetime.max.replace(tzinfo=UTC)
"""Seniority of a job without a readable creationTimestamp: the newest (it never wins)."""


@dataclass(frozen=True)
class GpuClaim:
    """The GPUs one job holds (or, for the job being reconciled, would hold)."""

    namespace: str
    job: str
    created: str
    """The job's ``metadata.creationTimestamp`` (RFC 3339), "" when unknown."""
    gpus: frozenset[Gpu]

    @property
    def seniority(self) -> tuple[datetime, str]:
        """Smaller is older: creation time, then name."""
        return (parse_rfc3339(self.created) or _UNKNOWN_AGE, self.job)


@dataclass(frozen=True)
class GpuConflict:
    """The job holding some of ours, which keeps them."""

    holder: GpuClaim
    shared: tuple[Gpu, ...]
    """The GPUs both claim, sorted."""

    @property
    def message(self) -> str:
        listed = ", ".join(f"{node}/{key}" for node, key in self.shared[:_MAX_LISTED_GPUS])
        if len(self.shared) > _MAX_LISTED_GPUS:
            listed += f" and {len(self.shared) - _MAX_LISTED_GPUS} more"
        h = self.holder
        created = f", created {h.created}" if h.created else ""
        return (
            f"GPUs {listed} are planned by the older PerseusJob {h.namespace}/{h.job}"
            f"{created}, which selects the same pods; this job writes no node plans until that "
            "one releases them (delete one of the two, or make their pod selectors disjoint)"
        )


def decide_gpu_conflict(me: GpuClaim, others: Iterable[GpuClaim]) -> GpuConflict | None:
    """The oldest job older than ``me`` that claims any of ``me``'s GPUs; None when ``me``
    may plan its GPUs (nobody holds them, or only newer jobs, which withdraw)."""
    holders = [
        o
        for o in others
        if (o.namespace, o.job) != (me.namespace, me.job)
        and o.seniority < me.seniority
        and o.gpus & me.gpus
    ]
    if not holders:
        return None
    holder = min(holders, key=lambda o: o.seniority)
    return GpuConflict(holder, tuple(sorted(holder.gpus & me.gpus)))


def claims_of_node_plans(
    node_plans: Sequence[Mapping[str, Any]], jobs: Sequence[Mapping[str, Any]]
) -> list[GpuClaim]:
    """The claims in ``node_plans`` (the GPUs of their assignments), per job of ``jobs``.

    Plans of a job not in ``jobs`` are left out: their job is gone and the garbage collector
    removes them. Unreadable entries are skipped (they claim nothing an agent would apply).
    """
    created = {}
    for job in jobs:
        metadata = job.get("metadata") or {}
        key = (str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))
        created[key] = str(metadata.get("creationTimestamp") or "")
    gpus: dict[tuple[str, str], set[Gpu]] = {}
    for plan in node_plans:
        spec = plan.get("spec") or {}
        key = (str(spec.get("namespace") or ""), str(spec.get("job") or ""))
        held = planned_gpus([plan])
        if key in created and held:
            gpus.setdefault(key, set()).update(held)
    return [
        GpuClaim(namespace, job, created[(namespace, job)], frozenset(held))
        for (namespace, job), held in sorted(gpus.items())
    ]


def planned_gpus(node_plans: Iterable[Mapping[str, Any]]) -> frozenset[Gpu]:
    """The GPUs the assignments of ``node_plans`` name (unreadable entries skipped)."""
    gpus: set[Gpu] = set()
    for plan in node_plans:
        spec = plan.get("spec") or {}
        node = str(spec.get("node") or "")
        for assignment in spec.get("assignments") or ():
            try:
                local_rank = int(either(assignment, "localRank", "local_rank"))
                gpus.add((node, f"{assignment['pod']}#{local_rank}"))
            except (KeyError, TypeError, ValueError):
                continue
    return frozenset(gpus)
