"""What the real API server enforces: the CRDs' validation, RBAC and the agents' admission policy.

- Every malformed PerseusJob that a schema or CEL rule can catch is refused at ``kubectl
  create`` with a message naming the field (the operator's own checks, for the rest, are
  tested in ``test_cluster_training``).
- The operator's and the node agents' service accounts can do what they need and nothing
  else (``kubectl auth can-i``, asked as each identity).
- An agent may write the status of its own node's plans only.
- Every sample in ``crds/samples`` is accepted as it is, and every field of the PerseusJob,
  PerseusPolicy, PerseusPowerBudget and PerseusNodePlan CRDs has a description in the API
  server's own OpenAPI document (what ``kubectl explain`` shows).
- A node plan stored in snake_case under the CRD of an older version survives the CRD's
  upgrade, is read by the new agent and rewritten in camelCase by the new operator's patch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from perseus_api import resources
from perseus_api.node_plan import NodePlan
from support.cluster_harness import Cluster, api_client
from support.factories import pipeline_plan_fields
from support.helm_render import NAMESPACE
from support.malformed_jobs import MALFORMED, malformed
from support.operator_harness import perseus_job

JOB_NAMESPACE = "api-checks"

# What the API server itself cannot know: these reach the operator, which fails or waits.
OPERATOR_ONLY = {
    "missing-workload-object",
    "parallelism-does-not-fit-the-pods",
    "missing-stored-profile",
}
# The API server's words for each case: the field path and the rule's message or its type.
SERVER_MESSAGE = {
    "no-workload": ("spec.workload", "Required value"),
    "unknown-workload-kind": ("spec.workload.kind", "Unsupported value"),
    "pods-with-a-name": ("spec.workload", "kind Pods needs podSelector (and no name)"),
    "empty-pod-selector": ("spec.workload.podSelector", "matchLabels or matchExpressions"),
    "in-without-values": ("spec.workload.podSelector.matchExpressions[0]", "need values"),
    "no-parallelism": ("spec.parallelism", "Required value"),
    "stages-not-a-number": ("spec.parallelism.pipelineStages", "must be of type integer"),
    "one-stage": ("spec.parallelism.pipelineStages", "should be greater than or equal to 2"),
    "zero-replicas": ("spec.parallelism.dataParallel", "should be greater than or equal to 1"),
    "too-few-microbatches": ("spec.parallelism", "1F1B needs at least as many microbatches"),
    "unknown-schedule": ("spec.parallelism.schedule", "Unsupported value"),
    "unknown-rank-order": ("spec.rankMapping.order", "Unsupported value"),
    "unknown-mode": ("spec.policy.mode", "Unsupported value"),
    "unknown-granularity": ("spec.policy.granularity", "Unsupported value"),
    "negative-slowdown": ("spec.policy.maxSlowdown", "should be greater than or equal to 0"),
    "slowdown-too-large": ("spec.policy.maxSlowdown", "should be less than or equal to 0.5"),
    "clock-range-inverted": ("spec.policy.frequencyMHz", "minMHz must not exceed maxMHz"),
    "zero-blocking-power": ("spec.policy.blockingPowerWatts", "should be greater than 0"),
    "zero-iterations-per-clock": (
        "spec.profiling.iterationsPerFrequency",
        "should be greater than or equal to 1",
    ),
    "no-hysteresis": ("spec.stragglers", "recoveryThreshold must be below slowdownThreshold"),
    "unknown-field": ("spec.policy.turbo", "unknown field"),
}


@pytest.fixture(scope="module")
def namespace(cluster: Cluster) -> str:
    cluster.plane.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": JOB_NAMESPACE}}]
    )
    return JOB_NAMESPACE


def test_every_malformed_case_is_classified() -> None:
    assert {case for case, *_ in MALFORMED} == OPERATOR_ONLY | set(SERVER_MESSAGE)


@pytest.mark.parametrize(
    ("case", "mutation"),
    [pytest.param(c, m, id=c) for c, m, *_ in MALFORMED if c not in OPERATOR_ONLY],
)
def test_malformed_job_is_refused_by_the_api_server(
    cluster: Cluster, namespace: str, case: str, mutation: Any
) -> None:
    job = perseus_job(case, namespace, "trainer", stages=4, dp=2, microbatches=8)
    job["spec"] = malformed(job["spec"], mutation)
    done = cluster.plane.kubectl("create", "-f", "-", stdin=json.dumps(job), check=False)
    assert done.returncode != 0, f"{case} was accepted: {done.stdout}"
    field, words = SERVER_MESSAGE[case]
    message = done.stderr
    assert f'PerseusJob "{case}" is invalid' in message or "unknown field" in message, message
    assert field in message and words in message, message
    got = cluster.plane.kubectl("get", "perseusjob", case, "-n", namespace, check=False)
    assert got.returncode != 0  # nothing stored


def test_a_valid_job_is_stored_with_the_crd_defaults(cluster: Cluster, namespace: str) -> None:
    job = perseus_job("valid", namespace, "trainer", stages=4, dp=2, microbatches=8)
    cluster.plane.kubectl("create", "-f", "-", stdin=json.dumps(job))
    stored = json.loads(
        cluster.plane.kubectl("get", "perseusjob", "valid", "-n", namespace, "-o", "json").stdout
    )
    assert stored["spec"]["parallelism"]["schedule"] == "1F1B"
    assert stored["spec"]["rankMapping"] == {
        "nodeRankEnv": "JOB_COMPLETION_INDEX",
        "order": "tp-dp-pp",
    }
    cluster.plane.kubectl("delete", "perseusjob", "valid", "-n", namespace)


# -- samples and descriptions --------------------------------------------------------------------

SAMPLES = sorted((Path(__file__).resolve().parents[2] / "crds" / "samples").glob("*.yaml"))


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_each_sample_is_accepted_as_it_is(cluster: Cluster, sample: Path) -> None:
    body = yaml.safe_load(sample.read_text())
    namespace = body["metadata"].get("namespace")
    if namespace is not None:
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        cluster.plane.apply([ns])
    # Server-side dry run: the CRD's schema and CEL rules judge it, nothing is stored for the
    # operator of another test to act on.
    done = cluster.plane.kubectl("create", "--dry-run=server", "-f", str(sample), check=False)
    assert done.returncode == 0, done.stderr


def _undescribed(schema: Mapping[str, Any], path: str) -> Iterator[str]:
    for name, field in (schema.get("properties") or {}).items():
        where = f"{path}.{name}"
        if not str(field.get("description", "")).strip():
            yield where
        yield from _undescribed(field, where)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from _undescribed(schema[key], path)


@pytest.mark.parametrize(
    ("kind", "resource", "field", "word"),
    [
        ("PerseusJob", "perseusjobs", "spec.policy.mode", "StragglerAware"),
        ("PerseusPolicy", "perseuspolicies", "spec.policy.mode", "StragglerAware"),
        ("PerseusPowerBudget", "perseuspowerbudgets", "spec.enforcement", "PlansAndPowerLimits"),
        ("PerseusNodePlan", "perseusnodeplans", "spec.assignments.dpRank", "Data-parallel"),
    ],
)
def test_kubectl_explain_describes_every_field(
    cluster: Cluster, kind: str, resource: str, field: str, word: str
) -> None:
    tree = cluster.plane.kubectl("explain", resource, "--recursive").stdout
    assert "spec" in tree and "status" in tree  # the CRD is published and explained
    document = json.loads(
        cluster.plane.kubectl(
            "get", "--raw", f"/openapi/v3/apis/{resources.GROUP}/{resources.VERSION}"
        ).stdout
    )
    (schema,) = [
        s
        for s in document["components"]["schemas"].values()
        if any(g.get("kind") == kind for g in s.get("x-kubernetes-group-version-kind", []))
    ]
    # metadata is the API server's ObjectMeta, described by its own reference.
    spec_and_status = {k: v for k, v in schema["properties"].items() if k != "metadata"}
    assert list(_undescribed({"properties": spec_and_status}, kind)) == []
    one = cluster.plane.kubectl("explain", f"{resource}.{field}").stdout
    assert word in one and "``" not in one


# -- RBAC ----------------------------------------------------------------------------------------

# (verb, resource, namespace or None for cluster scope)
OPERATOR_MAY = [
    ("list", "perseusjobs.perseus.energy", "ml"),
    ("watch", "perseusjobs.perseus.energy", "ml"),
    ("patch", "perseusjobs.perseus.energy", "ml"),  # finalizers, annotations
    ("patch", "perseusjobs.perseus.energy/status", "ml"),
    ("list", "perseusnodeplans.perseus.energy", "ml"),
    ("create", "perseusnodeplans.perseus.energy", "ml"),
    ("patch", "perseusnodeplans.perseus.energy", "ml"),
    ("delete", "perseusnodeplans.perseus.energy", "ml"),
    ("list", "pods", "ml"),
    ("get", "configmaps", "ml"),
    ("list", "configmaps", "ml"),  # stored profiles of a model, by label
    ("create", "configmaps", "ml"),
    ("patch", "configmaps", "ml"),
    ("create", "events", "ml"),
    ("get", "nodes", None),  # their GPU product label
    ("list", "nodes", None),  # the power budgets' domains, by node label
    ("get", "pytorchjobs.kubeflow.org", "ml"),
    ("get", "jobsets.jobset.x-k8s.io", "ml"),
    ("get", "trainjobs.trainer.kubeflow.org", "ml"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", None),
    # PerseusPolicies: the jobs they make, the workloads and namespaces they select.
    ("create", "perseusjobs.perseus.energy", "ml"),
    ("delete", "perseusjobs.perseus.energy", "ml"),
    ("list", "perseusjobs.perseus.energy", None),
    ("list", "pytorchjobs.kubeflow.org", "ml"),
    ("list", "jobsets.jobset.x-k8s.io", "ml"),
    ("list", "trainjobs.trainer.kubeflow.org", "ml"),
    ("list", "perseuspolicies.perseus.energy", None),
    ("watch", "perseuspolicies.perseus.energy", None),
    ("patch", "perseuspolicies.perseus.energy/status", None),
    ("list", "namespaces", None),
    # PerseusPowerBudgets: read, and their status written (issue 35).
    ("list", "perseuspowerbudgets.perseus.energy", None),
    ("watch", "perseuspowerbudgets.perseus.energy", None),
    ("patch", "perseuspowerbudgets.perseus.energy/status", None),
]
OPERATOR_MAY_NOT = [
    ("update", "perseusjobs.perseus.energy", "ml"),
    ("create", "perseuspolicies.perseus.energy", None),
    ("patch", "perseuspolicies.perseus.energy", None),  # a policy's spec is its author's
    ("delete", "perseuspolicies.perseus.energy", None),
    ("patch", "perseuspowerbudgets.perseus.energy", None),  # a budget's spec is its author's
    ("patch", "namespaces", None),
    ("patch", "perseusnodeplans.perseus.energy/status", "ml"),  # the agents' reports
    ("create", "pods", "ml"),
    ("delete", "pods", "ml"),
    ("get", "secrets", "ml"),
    ("list", "secrets", "ml"),
    ("delete", "configmaps", "ml"),
    ("patch", "nodes", None),
    ("watch", "nodes", None),
    ("patch", "pytorchjobs.kubeflow.org", "ml"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
    ("create", "serviceaccounts/token", NAMESPACE),
]
AGENT_MAY = [
    ("list", "perseusnodeplans.perseus.energy", "ml"),
    ("watch", "perseusnodeplans.perseus.energy", "ml"),
    ("list", "perseusnodeplans.perseus.energy", None),  # across namespaces, by node label
    ("watch", "perseusnodeplans.perseus.energy", None),
    ("patch", "perseusnodeplans.perseus.energy/status", "ml"),
    ("get", "nodes", None),  # its node's GPU driver upgrade label
    ("list", "pods", None),  # its node's pods: who a TCP peer's address, a cgroup's UID is
    ("watch", "pods", None),
]
AGENT_MAY_NOT = [
    ("list", "nodes", None),
    ("create", "perseusnodeplans.perseus.energy", "ml"),
    ("patch", "perseusnodeplans.perseus.energy", "ml"),  # the plan itself is the operator's
    ("delete", "perseusnodeplans.perseus.energy", "ml"),
    ("get", "perseusjobs.perseus.energy", "ml"),
    ("patch", "perseusjobs.perseus.energy/status", "ml"),
    ("get", "pods", "ml"),
    ("get", "secrets", "ml"),
    ("get", "configmaps", "ml"),
    ("patch", "nodes", None),
    ("create", "events", "ml"),
]


def can_i(cluster: Cluster, kubeconfig: Path, verb: str, resource: str, ns: str | None) -> bool:
    """``kubectl auth can-i`` as ``kubeconfig``'s user; ``resource`` may end in
    ``/<subresource>``."""
    resource, _, subresource = resource.partition("/")
    argv = ["auth", "can-i", verb, resource, *(["--all-namespaces"] if ns is None else ["-n", ns])]
    if subresource:
        argv.append(f"--subresource={subresource}")
    done = cluster.plane.kubectl(*argv, kubeconfig=kubeconfig, check=False)
    answer = done.stdout.strip()
    assert answer in {"yes", "no"}, f"can-i {verb} {resource}: {done.stdout}{done.stderr}"
    return answer == "yes"


@pytest.mark.parametrize(
    ("who", "allowed", "denied"),
    [("operator", OPERATOR_MAY, OPERATOR_MAY_NOT), ("agent", AGENT_MAY, AGENT_MAY_NOT)],
)
def test_each_identity_may_do_what_it_needs_and_nothing_else(
    cluster: Cluster,
    who: str,
    allowed: list[tuple[str, str, str | None]],
    denied: list[tuple[str, str, str | None]],
) -> None:
    cluster.node("api-node-0", 4)
    kubeconfig = (
        cluster.operator_kubeconfig if who == "operator" else cluster.agent_kubeconfig("api-node-0")
    )
    wrong = [
        f"may not {v} {r} in {n}" for v, r, n in allowed if not can_i(cluster, kubeconfig, v, r, n)
    ]
    wrong += [f"may {v} {r} in {n}" for v, r, n in denied if can_i(cluster, kubeconfig, v, r, n)]
    assert not wrong, f"{who}: " + "; ".join(wrong)


def one_gpu_plan(
    node: str,
    namespace: str,
    job: str,
    *,
    revision: int = 1,
    granularity: str = "Instruction",
    assignment: Mapping[str, Any] | None = None,
) -> NodePlan:
    """A node plan whose GPU 0 runs stage 0 (rank 0) of a two-stage plan ``p``."""
    return NodePlan(
        node=node,
        namespace=namespace,
        job=job,
        revision=revision,
        granularity=granularity,
        plans={"p": pipeline_plan_fields()},
        assignments=[assignment or {"gpu_index": 0, "plan": "p", "stage": 0, "rank": 0}],
    )


def node_plan_where(namespace: str, job: str, node: str) -> tuple[str, str, str, str, str]:
    """The custom-objects API's arguments naming ``job``'s plan for ``node``."""
    name = resources.node_plan_name(job, node)
    return (resources.GROUP, resources.VERSION, namespace, resources.NODE_PLAN_PLURAL, name)


def test_an_agent_writes_the_status_of_its_own_nodes_plans_only(
    cluster: Cluster, namespace: str
) -> None:
    for node in ("api-node-0", "api-node-1"):
        cluster.node(node, 4)
        cluster.plane.apply([resources.node_plan_object(one_gpu_plan(node, namespace, "job"))])
    # As the agent does it: a merge patch of the status subresource, no read first.
    with api_client(cluster.agent_kubeconfig("api-node-0")) as agent:
        custom = kubernetes.client.CustomObjectsApi(agent)

        def patch(node: str) -> None:
            custom.patch_namespaced_custom_object_status(
                *node_plan_where(namespace, "job", node), {"status": {"observedRevision": 1}}
            )

        patch("api-node-0")
        with pytest.raises(kubernetes.client.ApiException) as refused:
            patch("api-node-1")
    assert refused.value.status == 403
    assert "may write the status of its own node's PerseusNodePlans only" in str(refused.value.body)
    stored = cluster.custom.get_namespaced_custom_object_status(
        *node_plan_where(namespace, "job", "api-node-1")
    )
    assert "status" not in stored or "observedRevision" not in stored["status"]


def test_an_oversized_node_plan_is_refused_by_the_api_server(
    cluster: Cluster, namespace: str
) -> None:
    """Issue 30, case 8: a plan of 257 assignments (one over the bound) never reaches an agent."""
    from perseus_api.node_plan import MAX_ASSIGNMENTS

    body = resources.node_plan_object(one_gpu_plan("api-node-0", namespace, "big"))
    one = body["spec"]["assignments"][0]
    body["spec"]["assignments"] = [{**one, "gpuIndex": i} for i in range(MAX_ASSIGNMENTS + 1)]
    done = cluster.plane.kubectl(
        "create", "--dry-run=server", "-f", "-", stdin=json.dumps(body), check=False
    )
    assert done.returncode != 0, done.stdout
    assert "spec.assignments" in done.stderr and "Too many" in done.stderr, done.stderr


def test_the_api_server_stores_an_old_and_a_new_agents_status_as_written(
    cluster: Cluster, namespace: str
) -> None:
    """During a rolling upgrade agents of both spellings write statuses: the CRD's schema
    (generated from NodePlanStatus) prunes neither's keys, adds no defaults beside them, and
    still refuses a wrongly typed field."""
    from perseus_agent.plans.plan_status import report_status
    from perseus_api.node_report import NodePlanStatus
    from support.factories import OLD_AGENT_STATUS, merge_patch, node_report

    node = "api-node-status"
    cluster.node(node, 1)
    plan = one_gpu_plan(node, namespace, "job", revision=4)
    cluster.plane.apply([resources.node_plan_object(plan)])
    where = node_plan_where(namespace, "job", node)

    def write(status: dict[str, Any]) -> dict[str, Any]:
        cluster.custom.patch_namespaced_custom_object_status(*where, {"status": status})
        stored: dict[str, Any] = cluster.custom.get_namespaced_custom_object_status(*where)
        return stored["status"]

    old = write(OLD_AGENT_STATUS)
    assert old == merge_patch({}, OLD_AGENT_STATUS)  # only the null fields of list items gone
    new = report_status(node_report())
    stored = write(new)
    assert stored == merge_patch(old, new)
    assert NodePlanStatus.model_validate(stored) == NodePlanStatus.model_validate(new)
    bad = {"ranks": [{**new["ranks"][0], "meanIterationSeconds": "slow"}]}
    with pytest.raises(kubernetes.client.ApiException) as refused:
        write(bad)
    assert refused.value.status == 422
    assert "meanIterationSeconds" in str(refused.value.body)


OLD_NODE_PLAN_CRD = (
    Path(__file__).resolve().parents[1] / "data/crds/perseusnodeplans-snake-case-spec.yaml"
)


def _install_node_plan_crd(cluster: Cluster, crd: dict[str, Any], camel_case_valid: bool) -> None:
    """Apply ``crd`` and wait until the API server validates with it: until a camelCase-only
    plan (which the older CRD refuses) is accepted or refused."""
    import time

    cluster.plane.apply([crd])
    plan = one_gpu_plan(
        "api-node-crd",
        JOB_NAMESPACE,
        "probe",
        granularity="Stage",
        assignment={"gpu_index": 0, "plan": "p", "stage": 0},
    )
    probe = json.dumps(resources.node_plan_object(plan))
    deadline = time.monotonic() + 60
    while True:
        done = cluster.plane.kubectl(
            "create", "-n", JOB_NAMESPACE, "--dry-run=server", "-f", "-", stdin=probe, check=False
        )
        # The older CRD: kubectl's strict field validation names the camelCase keys unknown.
        refused_as_old = done.returncode != 0 and "numStages" in done.stderr
        if (done.returncode == 0) if camel_case_valid else refused_as_old:
            return
        assert time.monotonic() < deadline, done.stderr
        time.sleep(0.2)


def test_an_old_operators_node_plan_survives_the_upgrade(cluster: Cluster, namespace: str) -> None:
    """Upgrade from the snake_case spec on the real API server: an object stored under the
    older CRD keeps every key under the new one (nothing pruned, no camelCase default added
    beside a snake_case value), the new agent reads it as written, and the new operator's
    merge patch leaves it in camelCase only."""
    from perseus_api.crd import get_node_plan_crd
    from support.factories import merge_patch

    new_crd = get_node_plan_crd()
    old_crd = yaml.safe_load(OLD_NODE_PLAN_CRD.read_text(encoding="utf-8"))
    plan = one_gpu_plan(
        "api-node-upgrade",
        namespace,
        "upgraded",
        assignment={"gpu_index": 0, "plan": "p", "stage": 1, "dp_rank": 1, "rank": 3},
    )
    # What an old operator wrote: the snake_case spec of its day, without the fields added
    # since (an assignment's power limit), which the old CRD would prune.
    old_spec = plan.model_dump(mode="json", exclude={"assignments": {"__all__": {"power_limit_w"}}})
    old = {**resources.node_plan_object(plan), "spec": old_spec}
    where = node_plan_where(namespace, plan.job, plan.node)
    _install_node_plan_crd(cluster, old_crd, camel_case_valid=False)
    try:
        cluster.custom.create_namespaced_custom_object(*where[:4], old)
    finally:
        _install_node_plan_crd(cluster, new_crd, camel_case_valid=True)

    stored = cluster.custom.get_namespaced_custom_object(*where)
    assert stored["spec"] == old["spec"]  # as written: nothing pruned, no default added
    assert resources.parse_node_plan_object(stored) == plan

    wanted = plan.model_copy(update={"revision": 2})
    spec = resources.node_plan_object(wanted)["spec"]
    cluster.custom.patch_namespaced_custom_object(
        *where, {"spec": resources.without_snake_case_keys(spec)}
    )
    rewritten = cluster.custom.get_namespaced_custom_object(*where)
    assert rewritten["spec"] == merge_patch({}, spec)
    assert resources.parse_node_plan_object(rewritten) == wanted
    cluster.custom.delete_namespaced_custom_object(*where)
