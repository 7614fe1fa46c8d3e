"""Which GPU runs which training rank: a workload's pods resolved to (dp, pp, tp) ranks.

Pure functions over pods as the Kubernetes API returns them (plain dicts), so that every
convention below is tested without a cluster. The rank convention is the one of
:class:`perseus_api.job.RankMapping`: a pod with node rank ``n`` runs ``gpusPerPod``
processes, process ``local`` has global rank ``n * gpusPerPod + local`` and runs on the
``local``-th GPU the kubelet allocated to the pod's GPU container: which GPU of the node that
is, only the node's agent knows (from the kubelet's PodResources API), so a placement names
the pod, its UID, the container and the local rank, never a node GPU index. Several pods may
share a node. Only the node rank differs between workload kinds
(:mod:`perseus_operator.workloads.node_ranks`).

A workload that is still starting up is not an error: :func:`resolve_ranks` then says what
it waits for. Layouts that can never work raise :class:`WorkloadError`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from perseus_api.job import Parallelism, RankMapping, RankOrder, Workload, WorkloadKind
from perseus_operator.workloads.node_ranks import node_rank
from perseus_operator.workloads.objects import INTEGER, get_path, listed, training_container
from perseus_operator.workloads.pods import (
    GPU_RESOURCE,
    NNODES_ENV,
    Pod,
    WorkloadError,
    env_value,
    gpu_container,
    gpus_of,
    node_of,
    pod_name,
    replicated_job,
    uid_of,
)
from perseus_operator.workloads.selectors import pod_selector

_LISTED_NAMES = 5


@dataclass(frozen=True)
class RankPlacement:
    """Where one training process runs, and its coordinates in the parallel layout."""

    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    pod: str
    node: str
    local_rank: int
    container: str | None = None
    """The pod's container holding the GPUs (``None``: any of them)."""
    pod_uid: str | None = None

    @property
    def gpu_key(self) -> str:
        """Names this process's GPU among the node's, for telling jobs' claims apart."""
        return f"{self.pod}#{self.local_rank}"


@dataclass(frozen=True)
class Resolution:
    """Either every rank's placement (sorted by rank), or why they are not known yet."""

    ranks: tuple[RankPlacement, ...] = ()
    waiting: str | None = None

    def __post_init__(self) -> None:
        if bool(self.ranks) == (self.waiting is not None):
            raise ValueError("a Resolution has either ranks or a waiting message")


# -- selectors -------------------------------------------------------------------------------------


# -- pod fields ------------------------------------------------------------------------------------


# -- node ranks ------------------------------------------------------------------------------------


# -- resolution ------------------------------------------------------------------------------------


def resolve_ranks(
    pods: Sequence[Pod],
    workload: Workload,
    parallelism: Parallelism,
    mapping: RankMapping,
) -> Resolution:
    """Every training rank's pod, node and GPU, or what the workload still waits for."""
    # Pods being deleted are replaced (e.g. a JobSet restart); their node ranks repeat.
    live = [p for p in pods if get_path(p, "metadata", "deletionTimestamp") is None]
    training, waiting = _training_pods(live, workload, mapping)
    if waiting is not None:
        return Resolution(waiting=waiting)
    if not training:
        return Resolution(waiting=f"no pod matches {pod_selector(workload)} yet")

    per_pod = _gpus_per_pod(training, mapping)
    asked = (
        f"dp {parallelism.data_parallel} x pp {parallelism.pipeline_stages} x "
        f"tp {parallelism.tensor_parallel} = {parallelism.world_size}"
    )
    if parallelism.world_size % per_pod:
        raise WorkloadError(
            f"parallelism asks for {asked} processes, not a multiple of the {per_pod} GPUs "
            "per pod; fix spec.parallelism or rankMapping.gpusPerPod"
        )
    expected = parallelism.world_size // per_pod
    declared = _fixed_node_count(training)
    if declared is not None and declared != expected:
        raise WorkloadError(
            f"{_size_mismatch(declared, per_pod, asked)}; the pods set {NNODES_ENV}={declared}"
        )
    if len(training) > expected:
        raise WorkloadError(_size_mismatch(len(training), per_pod, asked))
    if len(training) < expected:
        return Resolution(
            waiting=f"found {len(training)} of {expected} pods ({pod_selector(workload)})"
        )

    ranked = _node_ranks(training, workload, mapping, expected)
    unscheduled = [pod_name(p) for p in ranked.values() if node_of(p) is None]
    if unscheduled:
        return Resolution(
            waiting=f"{len(unscheduled)} of {expected} pods are not scheduled yet: "
            f"{listed(unscheduled, _LISTED_NAMES)}"
        )
    return Resolution(ranks=_placements(ranked, per_pod, parallelism, mapping.order))


def _size_mismatch(pods: int, per_pod: int, asked: str) -> str:
    return (
        f"the workload runs {pods * per_pod} processes ({pods} pods x {per_pod} GPUs) but "
        f"parallelism asks for {asked}"
    )


def _training_pods(
    pods: Sequence[Pod], workload: Workload, mapping: RankMapping
) -> tuple[list[Pod], str | None]:
    """The pods running training processes, or why they cannot be told yet.

    A JobSet (and a TrainJob's) may also run initializers or a launcher: the replicated job
    that requests GPUs is the training one.
    """
    if workload.kind not in (WorkloadKind.JOB_SET, WorkloadKind.TRAIN_JOB):
        return list(pods), None
    jobs: dict[str, list[Pod]] = defaultdict(list)
    for pod in pods:
        jobs[replicated_job(pod)].append(pod)
    gpu_jobs = sorted(job for job, members in jobs.items() if any(map(gpus_of, members)))
    if len(gpu_jobs) > 1:
        raise WorkloadError(
            f"replicated jobs {', '.join(gpu_jobs)} all request {GPU_RESOURCE}; Perseus "
            "ranks the pods of one replicated job"
        )
    if gpu_jobs:
        return jobs[gpu_jobs[0]], None
    if pods and mapping.gpus_per_pod is None:
        # Initializers run (and finish) before the training pods are even created.
        names = sorted(map(pod_name, pods))
        return [], (
            f"no pod requests {GPU_RESOURCE} yet (found {len(names)}: "
            f"{listed(names, _LISTED_NAMES)}); "
            "set rankMapping.gpusPerPod if the training pods get GPUs another way"
        )
    if len(jobs) > 1:
        raise WorkloadError(
            f"no pod of replicated jobs {', '.join(sorted(jobs))} requests {GPU_RESOURCE}, "
            "so the training pods cannot be told apart; request GPUs as nvidia.com/gpu"
        )
    return list(pods), None


def _gpus_per_pod(pods: Sequence[Pod], mapping: RankMapping) -> int:
    gpus = {pod_name(p): gpus_of(p) for p in pods}
    if mapping.gpus_per_pod is not None:
        # Fewer GPUs than processes would put two processes on one GPU; pods without a
        # GPU request get their GPUs another way, which is what gpusPerPod is for.
        short = sorted(name for name, count in gpus.items() if 0 < count < mapping.gpus_per_pod)
        if short:
            raise WorkloadError(
                f"pod {short[0]} requests {gpus[short[0]]} {GPU_RESOURCE} but "
                f"rankMapping.gpusPerPod is {mapping.gpus_per_pod}"
            )
        return mapping.gpus_per_pod
    without = sorted(name for name, count in gpus.items() if count == 0)
    if without:
        raise WorkloadError(
            f"pod {without[0]} requests no {GPU_RESOURCE}; set rankMapping.gpusPerPod if the "
            "training pods get their GPUs another way"
        )
    first_with: dict[int, str] = {}
    for name, count in sorted(gpus.items()):
        first_with.setdefault(count, name)
    if len(first_with) > 1:
        listed = ", ".join(f"{count} ({name})" for count, name in sorted(first_with.items()))
        raise WorkloadError(
            f"the pods request different numbers of {GPU_RESOURCE}: {listed}; every training "
            "pod must run as many processes"
        )
    return next(iter(first_with))


def _fixed_node_count(pods: Sequence[Pod]) -> int | None:
    """The node count the pods give torchrun, when they all agree on a fixed one (an
    elastic ``min:max`` range fixes none). Never an error: resolving ranks only uses it to
    tell a short workload from one still starting (``_stated_node_count`` in
    :mod:`perseus_operator.policies.parallelism`, which infers the parallelism, says instead
    why the pods' statements cannot be used)."""
    counts = set()
    for pod in pods:
        value = env_value(pod, training_container(pod), NNODES_ENV)
        if value is not None and INTEGER.fullmatch(value.strip()):
            counts.add(int(value))
    return counts.pop() if len(counts) == 1 else None


def _node_ranks(
    pods: Sequence[Pod], workload: Workload, mapping: RankMapping, expected: int
) -> dict[int, Pod]:
    """The pods by node rank, which must be exactly 0..expected-1."""
    by_rank: dict[int, list[Pod]] = defaultdict(list)
    for pod in pods:
        by_rank[node_rank(pod, workload, mapping, pods)].append(pod)
    for rank, holders in sorted(by_rank.items()):
        if len(holders) > 1:
            names = sorted(map(pod_name, holders))
            raise WorkloadError(
                f"pods {listed(names, _LISTED_NAMES)} all have node rank {rank}; every training "
                "pod needs its own node rank"
            )
    stray = sorted(rank for rank in by_rank if rank >= expected)
    if stray:
        missing = sorted(set(range(expected)) - by_rank.keys())
        raise WorkloadError(
            f"pod {pod_name(by_rank[stray[0]][0])} has node rank {stray[0]} but the workload's "
            f"{expected} pods must have node ranks 0..{expected - 1} (missing "
            f"{', '.join(map(str, missing))})"
        )
    return {rank: holders[0] for rank, holders in sorted(by_rank.items())}


def _coordinates(rank: int, parallelism: Parallelism, order: RankOrder) -> tuple[int, int, int]:
    """(dp, pp, tp) of a global rank."""
    tp, rest = rank % parallelism.tensor_parallel, rank // parallelism.tensor_parallel
    if order == RankOrder.TP_DP_PP:
        return rest % parallelism.data_parallel, rest // parallelism.data_parallel, tp
    return rest // parallelism.pipeline_stages, rest % parallelism.pipeline_stages, tp


def _placements(
    ranked: Mapping[int, Pod], per_pod: int, parallelism: Parallelism, order: RankOrder
) -> tuple[RankPlacement, ...]:
    placements = []
    for node_rank_, pod in ranked.items():
        for local in range(per_pod):
            rank = node_rank_ * per_pod + local
            dp, pp, tp = _coordinates(rank, parallelism, order)
            placements.append(
                RankPlacement(
                    rank=rank,
                    dp_rank=dp,
                    pp_rank=pp,
                    tp_rank=tp,
                    pod=pod_name(pod),
                    node=str(node_of(pod)),
                    local_rank=local,
                    container=gpu_container(pod),
                    pod_uid=uid_of(pod),
                )
            )
    return tuple(placements)


def nodes_of(resolution: Resolution) -> dict[str, list[RankPlacement]]:
    """The placements of each node (one node plan each), nodes sorted by name."""
    grouped: dict[str, list[RankPlacement]] = defaultdict(list)
    for placement in resolution.ranks:
        grouped[placement.node].append(placement)
    return dict(sorted(grouped.items()))


# -- completion ------------------------------------------------------------------------------------
