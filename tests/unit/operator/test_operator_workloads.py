"""Workload pods resolved to ranks: each kind's node-rank convention, waits, and errors."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from perseus_api.job import LabelSelector, Parallelism, RankMapping, Workload, WorkloadKind
from perseus_operator.workloads.completion import (
    WorkloadEnd,
    workload_end,
    workload_failed,
    workload_finished,
)
from perseus_operator.workloads.node_ranks import node_rank
from perseus_operator.workloads.pods import WorkloadError, gpus_of
from perseus_operator.workloads.ranks import Resolution, nodes_of, resolve_ranks
from perseus_operator.workloads.selectors import matches, pod_selector

Pod = dict[str, Any]
PYTORCH = Workload(kind="PyTorchJob", name="gpt3")
JOBSET = Workload(kind="JobSet", name="gpt3")
TRAINJOB = Workload(kind="TrainJob", name="gpt3")
PODS = Workload.model_validate({"kind": "Pods", "podSelector": {"matchLabels": {"app": "gpt3"}}})
DP4_PP8 = Parallelism(data_parallel=4, pipeline_stages=8, microbatches=8)
DEFAULT = RankMapping()


def _pod(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    gpus: int | str | None = 8,
    node: str | None = "",
    phase: str = "Running",
    container: str = "trainer",
) -> Pod:
    """A pod as the API server returns it; ``node=""`` schedules it on ``node-<name>``."""
    resources = {} if gpus is None else {"limits": {"nvidia.com/gpu": gpus}}
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": container,
                "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                "resources": resources,
            }
        ]
    }
    if node is not None:
        spec["nodeName"] = node or f"node-{name}"
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def _pytorch_pod(
    name: str, replica: str, index: int, rank: int | None = None, nnodes: int = 4
) -> Pod:
    """A pod of the training operator: its labels and the env it injects."""
    env = {"MASTER_ADDR": "gpt3-master-0", "PET_NNODES": str(nnodes)}
    if rank is not None:
        env |= {"RANK": str(rank), "PET_NODE_RANK": str(rank)}
    labels = {
        "training.kubeflow.org/job-name": "gpt3",
        "training.kubeflow.org/replica-type": replica,
        "training.kubeflow.org/replica-index": str(index),
    }
    return _pod(name, labels=labels, env=env, container="pytorch")


def _pytorch_job(workers: int = 3) -> list[Pod]:
    return [_pytorch_pod("gpt3-master-0", "master", 0, rank=0)] + [
        _pytorch_pod(f"gpt3-worker-{i}", "worker", i, rank=i + 1) for i in range(workers)
    ]


def _jobset_pod(name: str, replicated: str, job: int, index: int, gpus: int | str | None) -> Pod:
    labels = {
        "jobset.sigs.k8s.io/jobset-name": "gpt3",
        "jobset.sigs.k8s.io/replicatedjob-name": replicated,
        "jobset.sigs.k8s.io/job-index": str(job),
    }
    # Completion indexes only as annotations, as before Kubernetes 1.28.
    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
    return _pod(name, labels=labels, annotations=annotations, gpus=gpus)


def _ranked_pods(ranks: list[int], **kwargs: Any) -> list[Pod]:
    return [
        _pod(f"p{i}", labels={"app": "gpt3", "rank": str(r)}, **kwargs) for i, r in enumerate(ranks)
    ]


BY_LABEL = RankMapping(node_rank_label="rank")


# -- selectors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workload", "expected"),
    [
        (PYTORCH, "training.kubeflow.org/job-name=gpt3"),
        (JOBSET, "jobset.sigs.k8s.io/jobset-name=gpt3"),
        (TRAINJOB, "jobset.sigs.k8s.io/jobset-name=gpt3"),
    ],
)
def test_selector_of_named_workloads(workload: Workload, expected: str) -> None:
    assert pod_selector(workload) == expected


def test_pods_selector_is_rendered_sorted_in_kubernetes_syntax() -> None:
    workload = Workload.model_validate(
        {
            "kind": "Pods",
            "podSelector": {
                "matchLabels": {"team": "ml", "app": "gpt3"},
                "matchExpressions": [
                    {"key": "tier", "operator": "NotIn", "values": ["debug"]},
                    {"key": "zone", "operator": "In", "values": ["b", "a"]},
                    {"key": "paused", "operator": "DoesNotExist"},
                    {"key": "gpu", "operator": "Exists"},
                ],
            },
        }
    )
    assert pod_selector(workload) == (
        "app=gpt3,gpu,!paused,team=ml,tier notin (debug),zone in (a,b)"
    )


@pytest.mark.parametrize(
    ("labels", "selected"),
    [
        ({"app": "gpt3", "zone": "a", "gpu": "1"}, True),
        ({"app": "gpt3", "zone": "a", "gpu": "1", "tier": "prod"}, True),
        ({"app": "gpt3", "zone": "a", "gpu": "1", "tier": "debug"}, False),
        ({"app": "gpt3", "zone": "c", "gpu": "1"}, False),
        ({"app": "gpt3", "gpu": "1"}, False),
        ({"app": "gpt3", "zone": "a"}, False),
        ({"app": "gpt3", "zone": "a", "gpu": "1", "paused": ""}, False),
        ({"app": "bert", "zone": "a", "gpu": "1"}, False),
    ],
)
def test_matches_like_the_api_server(labels: dict[str, str], selected: bool) -> None:
    selector = LabelSelector.model_validate(
        {
            "matchLabels": {"app": "gpt3"},
            "matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a", "b"]},
                {"key": "tier", "operator": "NotIn", "values": ["debug"]},
                {"key": "gpu", "operator": "Exists"},
                {"key": "paused", "operator": "DoesNotExist"},
            ],
        }
    )
    assert matches(selector, labels) is selected


# -- resolution per kind ---------------------------------------------------------------------------


def test_pytorch_job_master_and_workers() -> None:
    resolution = resolve_ranks(_pytorch_job(), PYTORCH, DP4_PP8, DEFAULT)
    assert resolution.waiting is None
    assert [p.rank for p in resolution.ranks] == list(range(32))
    # tp-dp-pp: data parallel varies fastest (tp is 1), so a node holds two stages.
    rank_9 = resolution.ranks[9]
    # Its GPU is named by the process (pod, container, local rank): which GPU of the node
    # that is, only the kubelet knows.
    assert (rank_9.pod, rank_9.node, rank_9.container, rank_9.local_rank) == (
        "gpt3-worker-0",
        "node-gpt3-worker-0",
        "pytorch",
        1,
    )
    assert not hasattr(rank_9, "gpu_index")
    assert (rank_9.dp_rank, rank_9.pp_rank, rank_9.tp_rank) == (1, 2, 0)
    nodes = nodes_of(resolution)
    assert list(nodes) == [
        "node-gpt3-master-0",
        "node-gpt3-worker-0",
        "node-gpt3-worker-1",
        "node-gpt3-worker-2",
    ]
    assert {p.pp_rank for p in nodes["node-gpt3-worker-2"]} == {6, 7}
    assert [p.local_rank for p in nodes["node-gpt3-master-0"]] == list(range(8))


def test_pods_of_one_workload_may_share_a_node() -> None:
    # Two 4-GPU pods on one 8-GPU node: each process is named by its pod and local rank (the
    # node's agent maps them to the GPUs the kubelet gave each pod), so nothing clashes.
    pods = [_pod(f"p{i}", labels={"rank": str(i)}, gpus=4, node="n1") for i in range(2)]
    sidecar = {"name": "logger", "resources": {}}
    pods[1]["spec"]["containers"].insert(0, sidecar)  # the GPU container is not the first
    resolution = resolve_ranks(pods, PODS, Parallelism(pipeline_stages=8, microbatches=8), BY_LABEL)
    assert resolution.waiting is None
    assert [(p.pod, p.pod_uid, p.container, p.local_rank) for p in resolution.ranks] == [
        *(("p0", "uid-p0", "trainer", local) for local in range(4)),
        *(("p1", "uid-p1", "trainer", local) for local in range(4)),
    ]
    assert len({p.gpu_key for p in resolution.ranks}) == 8
    assert list(nodes_of(resolution)) == ["n1"]


def test_pytorch_job_ranks_from_labels_or_env_alone() -> None:
    # Workers only (elastic style): Worker i is node rank i; capitalised types are old operators.
    workers = [_pytorch_pod(f"w{i}", "Worker", i) for i in range(4)]
    assert [node_rank(p, PYTORCH, DEFAULT, workers) for p in workers] == [0, 1, 2, 3]
    # A lone worker with the operator's env needs no peers to know the Master is rank 0.
    unlabelled = _pod("w", env={"PET_NODE_RANK": "3", "RANK": "3"}, container="pytorch")
    assert node_rank(unlabelled, PYTORCH, DEFAULT) == 3
    assert resolve_ranks(workers, PYTORCH, DP4_PP8, DEFAULT).waiting is None


def test_jobset_ranks_only_the_replicated_job_with_gpus() -> None:
    pods = [_jobset_pod("gpt3-launcher-0-0", "launcher", 0, 0, gpus=None)]
    pods += [
        _jobset_pod(f"gpt3-workers-{job}-{index}", "workers", job, index, gpus=8)
        for job in (1, 0)
        for index in (1, 0)
    ]
    resolution = resolve_ranks(pods, JOBSET, DP4_PP8, DEFAULT)
    assert [p.pod for p in resolution.ranks[::8]] == [
        "gpt3-workers-0-0",
        "gpt3-workers-0-1",
        "gpt3-workers-1-0",
        "gpt3-workers-1-1",
    ]


def test_train_job_waits_for_its_initializer_then_resolves() -> None:
    initializer = _jobset_pod("gpt3-model-initializer-0-0", "model-initializer", 0, 0, None)
    resolution = resolve_ranks([initializer], TRAINJOB, DP4_PP8, DEFAULT)
    assert resolution.waiting is not None
    assert resolution.waiting.startswith("no pod requests nvidia.com/gpu yet (found 1:")
    nodes = [_jobset_pod(f"gpt3-node-0-{i}", "node", 0, i, gpus="8") for i in range(4)]
    resolution = resolve_ranks([initializer, *nodes], TRAINJOB, DP4_PP8, DEFAULT)
    assert [p.pod for p in resolution.ranks[::8]] == [f"gpt3-node-0-{i}" for i in range(4)]


def test_pods_kind_node_rank_from_label_env_or_completion_index() -> None:
    from_label = _ranked_pods([2, 0, 1, 3])
    resolution = resolve_ranks(from_label, PODS, DP4_PP8, BY_LABEL)
    assert [p.pod for p in resolution.ranks[::8]] == ["p1", "p2", "p0", "p3"]

    mapping = RankMapping(node_rank_env="NODE_RANK")
    from_env = [_pod(f"e{i}", env={"NODE_RANK": str(3 - i)}) for i in range(4)]
    resolution = resolve_ranks(from_env, PODS, DP4_PP8, mapping)
    assert [p.pod for p in resolution.ranks[::8]] == ["e3", "e2", "e1", "e0"]

    # An indexed Job passes JOB_COMPLETION_INDEX by the downward API, not as a literal.
    indexed = _pod("j", annotations={"batch.kubernetes.io/job-completion-index": "2"})
    indexed["spec"]["containers"][0]["env"] = [
        {
            "name": "JOB_COMPLETION_INDEX",
            "valueFrom": {
                "fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                }
            },
        }
    ]
    assert node_rank(indexed, PODS, DEFAULT) == 2


def test_tp_pp_dp_order() -> None:
    parallelism = Parallelism(data_parallel=2, pipeline_stages=4, tensor_parallel=2, microbatches=4)
    mapping = RankMapping(node_rank_label="rank", order="tp-pp-dp")
    resolution = resolve_ranks(_ranked_pods([0, 1]), PODS, parallelism, mapping)
    coordinates = [(p.dp_rank, p.pp_rank, p.tp_rank) for p in resolution.ranks]
    assert coordinates[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert coordinates[8:10] == [(1, 0, 0), (1, 0, 1)]
    assert {p.dp_rank for p in nodes_of(resolution)["node-p1"]} == {1}


# -- waiting ---------------------------------------------------------------------------------------


def test_unscheduled_pods_are_waited_for() -> None:
    pods = _pytorch_job()
    for pod in pods[1:]:
        del pod["spec"]["nodeName"]
        pod["status"]["phase"] = "Pending"
    resolution = resolve_ranks(pods, PYTORCH, DP4_PP8, DEFAULT)
    assert resolution == Resolution(
        waiting="3 of 4 pods are not scheduled yet: gpt3-worker-0, gpt3-worker-1, gpt3-worker-2"
    )


def test_missing_pods_are_waited_for() -> None:
    resolution = resolve_ranks(_ranked_pods([0, 1]), PODS, DP4_PP8, BY_LABEL)
    assert resolution.waiting == "found 2 of 4 pods (app=gpt3)"
    assert resolve_ranks([], PYTORCH, DP4_PP8, DEFAULT).waiting == (
        "no pod matches training.kubeflow.org/job-name=gpt3 yet"
    )


def test_terminating_pods_are_ignored() -> None:
    pods = _ranked_pods([0, 1, 2, 3])
    old = _ranked_pods([1])[0]
    old["metadata"] |= {"name": "old", "deletionTimestamp": "2024-01-01T00:00:00Z"}
    assert resolve_ranks([*pods, old], PODS, DP4_PP8, BY_LABEL).waiting is None


# -- errors ----------------------------------------------------------------------------------------


def _with(pods: list[Pod], index: int, change: Callable[[Pod], None]) -> list[Pod]:
    change(pods[index])
    return pods


def _set_label(key: str, value: str) -> Callable[[Pod], None]:
    return lambda pod: pod["metadata"]["labels"].__setitem__(key, value)


def _set_gpus(value: Any) -> Callable[[Pod], None]:
    return lambda pod: pod["spec"]["containers"][0]["resources"]["limits"].__setitem__(
        "nvidia.com/gpu", value
    )


def _set_env(name: str, value: str) -> Callable[[Pod], None]:
    def change(pod: Pod) -> None:
        env = pod["spec"]["containers"][0]["env"]
        env[:] = [e for e in env if e["name"] != name] + [{"name": name, "value": value}]

    return change


REPLICA_INDEX = "training.kubeflow.org/replica-index"
REPLICA_TYPE = "training.kubeflow.org/replica-type"

ERRORS: list[tuple[str, list[Pod], Workload, RankMapping, str]] = [
    (
        "world size from PET_NNODES",
        [_pytorch_pod("m", "master", 0, 0, nnodes=2), _pytorch_pod("w", "worker", 0, 1, nnodes=2)],
        PYTORCH,
        DEFAULT,
        "the workload runs 16 processes (2 pods x 8 GPUs) but parallelism asks for "
        "dp 4 x pp 8 x tp 1 = 32; the pods set PET_NNODES=2",
    ),
    (
        "too many pods",
        _ranked_pods([0, 1, 2, 3, 4]),
        PODS,
        BY_LABEL,
        "the workload runs 40 processes (5 pods x 8 GPUs) but parallelism asks for "
        "dp 4 x pp 8 x tp 1 = 32",
    ),
    (
        "world size not a multiple of GPUs per pod",
        _ranked_pods([0, 1, 2, 3], gpus=6),
        PODS,
        BY_LABEL,
        "not a multiple of the 6 GPUs per pod",
    ),
    (
        "duplicate node ranks",
        _ranked_pods([0, 1, 1, 3]),
        PODS,
        BY_LABEL,
        "p1, p2 all have node rank 1",
    ),
    (
        "non-contiguous node ranks",
        _ranked_pods([0, 1, 2, 5]),
        PODS,
        BY_LABEL,
        "pod p3 has node rank 5 but the workload's 4 pods must have node ranks 0..3 (missing 3)",
    ),
    (
        "different GPU counts",
        _with(_ranked_pods([0, 1, 2, 3]), 2, _set_gpus(4)),
        PODS,
        BY_LABEL,
        "different numbers of nvidia.com/gpu: 4 (p2), 8 (p0)",
    ),
    (
        "pod without GPUs",
        _with(_pytorch_job(), 3, lambda pod: pod["spec"]["containers"][0].pop("resources")),
        PYTORCH,
        DEFAULT,
        "pod gpt3-worker-2 requests no nvidia.com/gpu; set rankMapping.gpusPerPod",
    ),
    (
        "fewer GPUs than gpusPerPod",
        _ranked_pods([0, 1, 2, 3]),
        PODS,
        RankMapping(node_rank_label="rank", gpus_per_pod=16),
        "pod p0 requests 8 nvidia.com/gpu but rankMapping.gpusPerPod is 16",
    ),
    (
        "non-integer node rank",
        _with(_ranked_pods([0, 1, 2, 3]), 1, _set_label("rank", "one")),
        PODS,
        BY_LABEL,
        "pod p1: label rank is 'one', not a non-negative integer",
    ),
    (
        "negative node rank",
        _with(_ranked_pods([0, 1, 2, 3]), 1, _set_label("rank", "-1")),
        PODS,
        BY_LABEL,
        "pod p1: label rank is '-1', not a non-negative integer",
    ),
    (
        "missing node rank label",
        _with(_ranked_pods([0, 1, 2, 3]), 0, lambda pod: pod["metadata"]["labels"].pop("rank")),
        PODS,
        BY_LABEL,
        "pod p0 has no label rank; label every training pod with its node rank",
    ),
    (
        "no node rank at all",
        [_pod(f"p{i}") for i in range(4)],
        PODS,
        DEFAULT,
        "pod p0 has no JOB_COMPLETION_INDEX variable with a literal value nor a "
        "batch.kubernetes.io/job-completion-index label or annotation",
    ),
    (
        "non-integer GPU count",
        _with(_ranked_pods([0, 1, 2, 3]), 0, _set_gpus("1.5")),
        PODS,
        BY_LABEL,
        "pod p0: limits nvidia.com/gpu of container trainer is '1.5'",
    ),
    (
        "label and env ranks conflict",
        _with(_pytorch_job(), 1, _set_label(REPLICA_INDEX, "2")),
        PYTORCH,
        DEFAULT,
        "pod gpt3-worker-0: its replica labels give node rank 3 but PET_NODE_RANK is 1",
    ),
    (
        "env ranks conflict",
        _with(_pytorch_job(), 1, _set_env("RANK", "2")),
        PYTORCH,
        DEFAULT,
        "pod gpt3-worker-0 has conflicting node ranks: PET_NODE_RANK 1, RANK 2",
    ),
    (
        "second master",
        _with(_pytorch_job(), 2, _set_label(REPLICA_TYPE, "Master")),
        PYTORCH,
        DEFAULT,
        "pod gpt3-worker-1 is Master replica 1; a PyTorchJob has one Master replica",
    ),
    (
        "unknown replica type",
        _with(_pytorch_job(), 2, _set_label(REPLICA_TYPE, "launcher")),
        PYTORCH,
        DEFAULT,
        "pod gpt3-worker-1 has replica type 'launcher'",
    ),
    (
        "not a training operator pod",
        [_pod(f"p{i}") for i in range(4)],
        PYTORCH,
        DEFAULT,
        "pod p0 has neither training.kubeflow.org/replica-type",
    ),
    (
        "jobset pod without completion index",
        _with(
            [_jobset_pod(f"w-0-{i}", "workers", 0, i, 8) for i in range(4)],
            3,
            lambda pod: pod["metadata"].pop("annotations"),
        ),
        JOBSET,
        DEFAULT,
        "pod w-0-3 has no batch.kubernetes.io/job-completion-index label or annotation",
    ),
    (
        "two replicated jobs with GPUs",
        [_jobset_pod("a-0-0", "a", 0, 0, 8), _jobset_pod("b-0-0", "b", 0, 0, 8)],
        JOBSET,
        DEFAULT,
        "replicated jobs a, b all request nvidia.com/gpu",
    ),
]


@pytest.mark.parametrize(
    ("pods", "workload", "mapping", "message"),
    [case[1:] for case in ERRORS],
    ids=[case[0] for case in ERRORS],
)
def test_impossible_layouts_are_errors(
    pods: list[Pod], workload: Workload, mapping: RankMapping, message: str
) -> None:
    with pytest.raises(WorkloadError, match=re.escape(message)):
        resolve_ranks(pods, workload, DP4_PP8, mapping)


# -- pod helpers -----------------------------------------------------------------------------------


def test_gpus_of_sums_containers_and_ignores_init_containers() -> None:
    pod = _pod("p", gpus="4")
    pod["spec"]["containers"].append(
        {"name": "sidecar", "resources": {"requests": {"nvidia.com/gpu": 2}}}
    )
    pod["spec"]["containers"].append({"name": "logger"})
    pod["spec"]["initContainers"] = [
        {"name": "init", "resources": {"limits": {"nvidia.com/gpu": "8"}}}
    ]
    assert gpus_of(pod) == 6
    assert gpus_of(_pod("cpu", gpus=None)) == 0


def test_finished_and_failed() -> None:
    done = [_pod(f"p{i}", phase="Succeeded") for i in range(2)]
    assert workload_finished(done)
    assert not workload_finished([])
    assert not workload_finished([*done, _pod("p2")])
    assert workload_failed(done) is None

    oom = _pod("w1", phase="Failed")
    oom["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    ]
    evicted = _pod("w2", phase="Failed")
    evicted["status"] |= {"reason": "Evicted", "message": "The node was low on memory."}
    assert workload_failed([*done, oom]) == "pod w1 (OOMKilled, exit code 137) failed"
    assert workload_failed([evicted, oom]) == (
        "2 pods failed: w1 (OOMKilled, exit code 137), w2 (Evicted: The node was low on memory.)"
    )


def test_resolution_has_ranks_or_a_wait() -> None:
    with pytest.raises(ValueError, match="either ranks or a waiting message"):
        Resolution()


@pytest.mark.parametrize(
    ("kind", "conditions", "end"),
    [
        (WorkloadKind.PYTORCH_JOB, [("Running", "True")], None),
        (
            WorkloadKind.PYTORCH_JOB,
            [("Running", "False"), ("Succeeded", "True")],
            WorkloadEnd(None),
        ),
        (WorkloadKind.PYTORCH_JOB, [("Succeeded", "False")], None),
        (WorkloadKind.JOB_SET, [("Completed", "True")], WorkloadEnd(None)),
        (WorkloadKind.JOB_SET, [("Failed", "True")], WorkloadEnd("JobSet gpt3 failed (Why: how)")),
        (WorkloadKind.TRAIN_JOB, [("Complete", "True")], WorkloadEnd(None)),
        (WorkloadKind.TRAIN_JOB, [("Completed", "True")], None),  # JobSet's word, not Trainer's
        (WorkloadKind.PODS, [("Succeeded", "True")], None),  # no object: its pods say
    ],
)
def test_a_workload_object_says_how_it_ended(
    kind: WorkloadKind, conditions: list[tuple[str, str]], end: WorkloadEnd | None
) -> None:
    obj = {
        "metadata": {"name": "gpt3"},
        "status": {
            "conditions": [
                {"type": t, "status": v, "reason": "Why", "message": "how"} for t, v in conditions
            ]
        },
    }
    assert workload_end(kind, obj) == end
    assert workload_end(kind, {"metadata": {"name": "gpt3"}}) is None  # no status yet
