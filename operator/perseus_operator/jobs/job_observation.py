"""What a reconcile step reads: the cluster as it sees it (:class:`JobIO`), and the reads
themselves, each of what one decision needs (:mod:`perseus_operator.jobs.job_decisions`,
:mod:`perseus_operator.jobs.phase_decisions`).

Reads only: a read that only one outcome needs (the pods of a workload that has not ended, the
jobs of the namespace when some other job's plan is on our GPUs) is made only then, and of the
other jobs' node plans only those on the job's nodes are read.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from enum import Enum
from typing import Any, Protocol

from perseus_api.job import PerseusJobSpec, WorkloadKind
from perseus_operator.jobs.job_decisions import ConflictView, JobRef, WorkloadView, overlaps
from perseus_operator.jobs.node_status import PlanReport, plan_report
from perseus_operator.jobs.phase_decisions import profile_config_map_name
from perseus_operator.jobs.planning import PlanningInput
from perseus_operator.jobs.profile_store import GpuProducts, Lookup, find_profile
from perseus_operator.workloads.completion import workload_end
from perseus_operator.workloads.ranks import RankPlacement
from perseus_operator.workloads.selectors import pod_selector
from perseus_planner import Frontier

__all__ = [
    "JobIO",
    "Planner",
    "ReadChanges",
    "ReadSnapshots",
    "observe_conflict",
    "observe_gpu_product",
    "observe_profile",
    "observe_workload",
    "plan_reports",
]


class JobIO(Protocol):
    """The cluster as the reconcile step sees it
    (:class:`~perseus_operator.cluster.kube.client.KubeClient`)."""

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    async def get_workload(
        self, namespace: str, kind: WorkloadKind, name: str
    ) -> dict[str, Any] | None: ...

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def list_config_maps(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    async def put_config_map(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        owner: Mapping[str, Any],
        annotations: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None: ...

    async def get_node(self, name: str) -> dict[str, Any] | None: ...

    async def list_node_plans(self, namespace: str, job: str) -> list[dict[str, Any]]: ...

    async def list_node_plans_on(
        self, namespace: str, nodes: Collection[str]
    ) -> list[dict[str, Any]]:
        """Every job's node plans in ``namespace`` on one of ``nodes``, at least what they
        claim: their metadata and their spec but ``plans`` (an index leaves the rest out)."""
        ...

    async def list_jobs(
        self, namespace: str | None, selector: str = ""
    ) -> list[dict[str, Any]]: ...

    async def put_node_plan(self, body: Mapping[str, Any], owner: Mapping[str, Any]) -> None: ...

    async def delete_node_plan(self, namespace: str, name: str) -> None: ...


class ReadChanges(Enum):
    """What changed in a step's reads since an earlier step of the job."""

    NONE = "none"
    OWN_PLANS = "its own node plans only"
    OTHER = "other reads"


class ReadSnapshots:
    """A JobIO that can tell what changed in a job's reads since an earlier step
    (:class:`~perseus_operator.cluster.cluster_index.IndexedJobIO`): what lets a step reuse
    what an earlier one decided (:mod:`perseus_operator.jobs.quiet_steps`). A base class, not
    a protocol: asked at every step, and ``isinstance`` of a runtime protocol costs tens of
    microseconds."""

    def snapshot(self) -> object | None:
        """What this step read, if a later step can compare it (None: it cannot)."""
        return None

    def changes_since(self, snapshot: object) -> ReadChanges:
        """What the reads of ``snapshot`` would return differently now: nothing, the job's own
        node plans only (or those would come from the API), or more."""
        return ReadChanges.OTHER

    def adopt(self, snapshot: object) -> None:
        """Count the reads of ``snapshot`` that :meth:`changes_since` found unchanged, but the
        job's own node plans, as this step's (a step that reuses what they decided)."""

    async def node_plan_reports(self, namespace: str, job: str) -> list[PlanReport]:
        """:func:`plan_reports` of the job's node plans (one kept per object version)."""
        raise NotImplementedError


async def plan_reports(io: JobIO, namespace: str, job: str) -> list[PlanReport]:
    """The job's node plans as the Running stage reads them, by name."""
    if isinstance(io, ReadSnapshots):
        return await io.node_plan_reports(namespace, job)
    return [plan_report(p) for p in await io.list_node_plans(namespace, job)]


class Planner(Protocol):
    """Solves frontiers off the event loop (a process pool with a time limit)."""

    async def solve(self, request: PlanningInput) -> Frontier: ...


async def observe_workload(io: JobIO, ref: JobRef, spec: PerseusJobSpec) -> WorkloadView:
    """The workload object (unless ``Pods``) and, unless it is missing or has ended, its pods."""
    workload = spec.workload
    found = None
    if workload.kind != WorkloadKind.PODS:
        assert workload.name is not None
        found = await io.get_workload(ref.namespace, workload.kind, workload.name)
        if found is None or workload_end(workload.kind, found) is not None:
            return WorkloadView(found)
    return WorkloadView(found, await io.list_pods(ref.namespace, pod_selector(workload)))


async def observe_conflict(io: JobIO, ref: JobRef, ranks: Sequence[RankPlacement]) -> ConflictView:
    """The other jobs' node plans on this job's nodes (only those can claim its GPUs); the
    namespace's jobs (for their ages) only when some of those plans is on one of its GPUs."""
    nodes = sorted({r.node for r in ranks})
    others = [
        p
        for p in await io.list_node_plans_on(ref.namespace, nodes)
        if (p.get("spec") or {}).get("job") != ref.name
    ]
    if not overlaps(others, ranks):
        return ConflictView(others)
    return ConflictView(others, await io.list_jobs(ref.namespace))


async def observe_profile(
    io: JobIO,
    ref: JobRef,
    spec: PerseusJobSpec,
    ranks: Sequence[RankPlacement],
    products: GpuProducts,
) -> Lookup:
    """A stored profile to plan from, if one fits (:func:`~perseus_operator.jobs.profile_store.
    find_profile`)."""
    own = profile_config_map_name(ref.name)
    return await find_profile(io, ref.namespace, own, spec, [r.node for r in ranks], products)


async def observe_gpu_product(
    io: JobIO, spec: PerseusJobSpec, ranks: Sequence[RankPlacement], products: GpuProducts
) -> str | None:
    """The GPU product of the job's nodes, for jobs that name a ``profiling.model`` (the
    others never share profiles, so their nodes are not read)."""
    if not spec.profiling.model:
        return None
    return await products.of(io, [r.node for r in ranks])
