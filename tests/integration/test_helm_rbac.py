"""The chart's RBAC grants each component exactly the API calls it makes: nothing missing,
nothing extra.

The calls are listed below as data, each with the code that makes it. Two checks keep the list
honest: every Kubernetes client method the components' API modules call (found by parsing
the modules of the packages ``perseus_operator/cluster/kube/`` and ``perseus_agent/kube/``) must be
in the list, and the workload kinds and resource names come from the code's own constants. The
permissions are computed from the rendered ClusterRoles, Roles and their bindings, and must
equal the list.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from perseus_api import resources
from perseus_api.job import JOB_PLURAL
from perseus_api.policy import POLICY_PLURAL
from perseus_api.power_budget import BUDGET_PLURAL
from perseus_operator.cluster.kube.client import WORKLOAD_RESOURCES
from support.helm_render import NAMESPACE, REPO_ROOT, Rendered, render

ALL = "*"  # a ClusterRoleBinding: every namespace, and cluster-scoped resources
GROUP = resources.GROUP
CRD_GROUP = "apiextensions.k8s.io"
AGENT_KUBE = REPO_ROOT / "node_agent" / "perseus_agent" / "kube"
"""The agent's Kubernetes I/O, a package."""
OPERATOR_KUBE = REPO_ROOT / "operator" / "perseus_operator" / "cluster" / "kube"
"""The operator's Kubernetes I/O, a package too."""


@dataclass(frozen=True)
class Call:
    """One kind of API call: ``verb`` on ``group``/``resource`` (``resource/subresource``).

    ``cluster``: cluster-scoped, or across all namespaces; otherwise in the namespaces whose
    PerseusJobs the component manages.
    """

    verb: str
    group: str
    resource: str
    cluster: bool
    where: str


def _workload_calls(verb: str, method: str) -> list[Call]:
    return [
        Call(
            verb,
            group,
            plural,
            False,
            f"perseus_operator/cluster/kube/client.py {method} ({kind.value})",
        )
        for kind, (group, _version, plural) in WORKLOAD_RESOURCES.items()
    ]


# Client methods of operator/perseus_operator/cluster/kube/ -> the calls they make.
OPERATOR_CLIENT_CALLS: dict[str, list[Call]] = {
    "list_namespaced_pod": [Call("list", "", "pods", False, "KubeClient.list_pods")],
    "get_namespaced_custom_object": _workload_calls("get", "get_workload"),
    "read_namespaced_config_map": [
        Call("get", "", "configmaps", False, "KubeClient.get_config_map (profiles)")
    ],
    "list_namespaced_config_map": [
        Call("list", "", "configmaps", False, "KubeClient.list_config_maps (shared profiles)")
    ],
    "read_node": [Call("get", "", "nodes", True, "KubeClient.get_node (GPU product label)")],
    "create_namespaced_config_map": [
        Call("create", "", "configmaps", False, "KubeClient.put_config_map")
    ],
    "patch_namespaced_config_map": [
        Call("patch", "", "configmaps", False, "KubeClient.put_config_map")
    ],
    "list_namespaced_custom_object": [
        Call("list", GROUP, resources.NODE_PLAN_PLURAL, False, "KubeClient.list_node_plans"),
        Call("list", GROUP, JOB_PLURAL, False, "KubeClient.list_jobs (policies)"),
        Call("list", GROUP, JOB_PLURAL, False, "PerseusJobLister (the pod injection webhook)"),
        *_workload_calls("list", "list_workloads (policies)"),
    ],
    "list_cluster_custom_object": [
        Call("list", GROUP, POLICY_PLURAL, True, "KubeClient.list_policies"),
        # All namespaces in cluster-wide mode (a ClusterRoleBinding): not a cluster-scoped call.
        Call("list", GROUP, JOB_PLURAL, False, "KubeClient.list_jobs (policy-made, anywhere)"),
        Call("list", GROUP, BUDGET_PLURAL, True, "KubeClient.list_power_budgets"),
        Call(
            "list",
            GROUP,
            resources.NODE_PLAN_PLURAL,
            False,
            "KubeClient.list_all_node_plans (power domains' jobs and draw)",
        ),
    ],
    "patch_cluster_custom_object_status": [
        Call("patch", GROUP, f"{POLICY_PLURAL}/status", True, "KubeClient.patch_policy_status"),
        Call(
            "patch", GROUP, f"{BUDGET_PLURAL}/status", True, "KubeClient.patch_power_budget_status"
        ),
    ],
    "list_node": [Call("list", "", "nodes", True, "KubeClient.list_nodes (power domains)")],
    "list_namespace": [
        Call("list", "", "namespaces", True, "KubeClient.list_namespaces (policy selectors)")
    ],
    "create_namespaced_custom_object": [
        Call("create", GROUP, resources.NODE_PLAN_PLURAL, False, "KubeClient.put_node_plan"),
        Call("create", GROUP, JOB_PLURAL, False, "KubeClient.create_job (policies)"),
    ],
    "patch_namespaced_custom_object": [
        Call("patch", GROUP, resources.NODE_PLAN_PLURAL, False, "KubeClient.put_node_plan (409)"),
        Call("patch", GROUP, JOB_PLURAL, False, "KubeClient.patch_job (policies)"),
    ],
    "delete_namespaced_custom_object": [
        Call("delete", GROUP, resources.NODE_PLAN_PLURAL, False, "KubeClient.delete_node_plan"),
        Call("delete", GROUP, JOB_PLURAL, False, "KubeClient.delete_job (policies)"),
    ],
    # helm test (chart_hooks.release_test), as the operator's account.
    "list_custom_resource_definition": [
        Call("list", CRD_GROUP, "customresourcedefinitions", True, "HookApi.crds (helm test)")
    ],
    "create_namespaced_event": [
        Call(
            "create",
            "",
            "events",
            False,
            "KubeClient.create_event (policies, on workloads; power budgets: BUDGET_EVENT_GRANTS)",
        )
    ],
}

# The pre-delete hook (chart_hooks.before_uninstall), as an account of its own (a hook too).
UNINSTALL_HOOK_CLIENT_CALLS: dict[str, list[Call]] = {
    "list_cluster_custom_object": [
        Call("list", GROUP, POLICY_PLURAL, True, "HookApi.policies"),
        Call("list", GROUP, JOB_PLURAL, True, "HookApi.jobs (all namespaces)"),
    ],
    "list_namespaced_custom_object": [
        Call("list", GROUP, JOB_PLURAL, True, "HookApi.jobs (watched namespaces)")
    ],
    "delete_cluster_custom_object": [
        Call("delete", GROUP, POLICY_PLURAL, True, "HookApi.delete_policy")
    ],
    "delete_namespaced_custom_object": [
        Call("delete", GROUP, JOB_PLURAL, True, "HookApi.delete_job")
    ],
}
UNINSTALL_HOOK_SA = f"system:serviceaccount:{NAMESPACE}:perseus-operator-uninstall"

# LeaseApi (leader election, and the helm test's read): one Lease in the release namespace.
LEASE_CLIENT_CALLS: dict[str, list[str]] = {
    "read_namespaced_lease": ["get"],
    "create_namespaced_lease": ["create"],
    "replace_namespaced_lease": ["update"],
}
LEASE_GRANTS = {
    (NAMESPACE, "coordination.k8s.io", "leases", verb)
    for verbs in LEASE_CLIENT_CALLS.values()
    for verb in verbs
}

# The power budgets' Events (cluster-scoped objects): in the release namespace, whatever the
# watched namespaces (power/budget_controller, PERSEUS_OPERATOR_LEADER_ELECTION_NAMESPACE).
BUDGET_EVENT_GRANTS = {(NAMESPACE, "", "events", "create")}

# What kopf does for perseus_operator/handlers.py (kopf 1.45, standalone: no peering objects;
# leader election is our own Lease, above).
KOPF_CALLS = [
    Call("list", GROUP, JOB_PLURAL, False, "kopf watcher: initial listing of the jobs"),
    Call("watch", GROUP, JOB_PLURAL, False, "kopf watcher"),
    Call("patch", GROUP, JOB_PLURAL, False, "kopf patching.patch_obj: finalizer, annotations"),
    Call("patch", GROUP, f"{JOB_PLURAL}/status", False, "kopf patch_obj: status subresource"),
    Call("create", "", "events", False, "kopf posting (handlers: kopf.event, kopf.warn)"),
    # handlers.perseus_pods, perseus_node_plans (kopf.index): what reconciles read.
    Call("list", "", "pods", False, "kopf watcher: initial listing of the pod index"),
    Call("watch", "", "pods", False, "kopf watcher: the pod index"),
    Call("list", GROUP, resources.NODE_PLAN_PLURAL, False, "kopf watcher: node plan index"),
    Call("watch", GROUP, resources.NODE_PLAN_PLURAL, False, "kopf watcher: node plan index"),
    # handlers.perseus_workloads: the kinds whose CRD is installed.
    *(
        Call(verb, group, plural, False, f"kopf watcher: the workload index ({kind.value})")
        for kind, (group, _version, plural) in WORKLOAD_RESOURCES.items()
        for verb in ("list", "watch")
    ),
    Call(
        "list", CRD_GROUP, "customresourcedefinitions", True, "kopf observation.resource_observer"
    ),
    Call("watch", CRD_GROUP, "customresourcedefinitions", True, "kopf resource_observer"),
    # handlers.policy_changed (kopf.on.event): PerseusPolicies are cluster-scoped.
    Call("list", GROUP, POLICY_PLURAL, True, "kopf watcher: initial listing of the policies"),
    Call("watch", GROUP, POLICY_PLURAL, True, "kopf watcher: policies"),
    # handlers.budget_changed (kopf.on.event): PerseusPowerBudgets are cluster-scoped.
    Call("list", GROUP, BUDGET_PLURAL, True, "kopf watcher: initial listing of the budgets"),
    Call("watch", GROUP, BUDGET_PLURAL, True, "kopf watcher: power budgets"),
]
# Only when the operator runs with --namespace (observation.namespace_observer).
KOPF_NAMESPACED_MODE_CALLS = [
    Call("list", "", "namespaces", True, "kopf observation.namespace_observer"),
    Call("watch", "", "namespaces", True, "kopf namespace_observer"),
]

# Client methods of node_agent/perseus_agent/kube/ -> the calls they make.
AGENT_CLIENT_CALLS: dict[str, list[Call]] = {
    # NodePlanSource._list and ._watch: this node's plans (label selector) in all namespaces.
    "list_cluster_custom_object": [
        Call("list", GROUP, resources.NODE_PLAN_PLURAL, True, "NodePlanSource._list"),
        Call("watch", GROUP, resources.NODE_PLAN_PLURAL, True, "NodePlanSource._watch"),
    ],
    "patch_namespaced_custom_object_status": [
        Call("patch", GROUP, f"{resources.NODE_PLAN_PLURAL}/status", False, "ReportWriter.write")
    ],
    # NodeLabelSource.run: its own node's GPU driver upgrade label.
    "read_node": [Call("get", "", "nodes", True, "NodeLabelSource.run")],
    # NodePodWatch._list and ._watch: which pod a connection comes from (address, cgroup UID).
    "list_pod_for_all_namespaces": [
        Call("list", "", "pods", True, "NodePodWatch._list"),
        Call("watch", "", "pods", True, "NodePodWatch._watch"),
    ],
}

OPERATOR_SA = f"system:serviceaccount:{NAMESPACE}:perseus-operator"
AGENT_SA = f"system:serviceaccount:{NAMESPACE}:perseus-node-agent"

Grant = tuple[str, str, str, str]  # scope (namespace or ALL), group, resource, verb


def expected_grants(calls: Iterable[Call], namespaces: Iterable[str] = (ALL,)) -> set[Grant]:
    grants: set[Grant] = set()
    for c in calls:
        for scope in [ALL] if c.cluster else namespaces:
            grants.add((scope, c.group, c.resource, c.verb))
    return grants


def operator_calls(namespaced: bool) -> list[Call]:
    calls = [c for cs in OPERATOR_CLIENT_CALLS.values() for c in cs] + KOPF_CALLS
    return calls + (KOPF_NAMESPACED_MODE_CALLS if namespaced else [])


def agent_calls() -> list[Call]:
    return [c for cs in AGENT_CLIENT_CALLS.values() for c in cs]


def _subjects(binding: Mapping[str, Any]) -> set[str]:
    names = set()
    for s in binding.get("subjects") or ():
        assert s["kind"] == "ServiceAccount", s
        names.add(f"system:serviceaccount:{s['namespace']}:{s['name']}")
    return names


def grants_of(rendered: Rendered, user: str) -> set[Grant]:
    """What ``user`` may do, from the rendered roles and bindings (RBAC is additive)."""
    roles = {("ClusterRole", r["metadata"]["name"]): r for r in rendered.of_kind("ClusterRole")}
    roles |= {
        ("Role", f"{r['metadata']['namespace']}/{r['metadata']['name']}"): r
        for r in rendered.of_kind("Role")
    }
    grants: set[Grant] = set()
    for binding in rendered.of_kind("ClusterRoleBinding") + rendered.of_kind("RoleBinding"):
        if user not in _subjects(binding):
            continue
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace")
        scope = ALL if binding["kind"] == "ClusterRoleBinding" else namespace
        key = ref["name"] if ref["kind"] == "ClusterRole" else f"{namespace}/{ref['name']}"
        role = roles[(ref["kind"], key)]
        for rule in role.get("rules") or ():
            assert not rule.get("resourceNames"), rule  # none needed; keep it simple
            assert not rule.get("nonResourceURLs"), rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert ALL not in (group, resource, verb), f"wildcard in {rule}"
                        grants.add((scope, group, resource, verb))
    return grants


def allows(grants: set[Grant], verb: str, group: str, resource: str, namespace: str | None) -> bool:
    scopes = {ALL} if namespace is None else {ALL, namespace}
    return any((s, group, resource, verb) in grants for s in scopes)


def client_methods_called(path: Path, receivers: set[str]) -> set[str]:
    """Names of the methods called on ``self.<receiver>`` anywhere in ``path``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Attribute)
            and isinstance(node.func.value.value, ast.Name)
            and node.func.value.value.id == "self"
            and node.func.value.attr in receivers
        ):
            found.add(node.func.attr)
    return found


# -- the list of calls matches the code ----------------------------------------------------------


def test_every_client_call_of_the_operator_is_listed() -> None:
    paths = sorted(OPERATOR_KUBE.glob("*.py"))
    assert len(paths) > 1  # the package, not an empty folder
    called = set().union(
        *(client_methods_called(path, {"_core", "_custom", "_extensions"}) for path in paths)
    )
    assert called == set(OPERATOR_CLIENT_CALLS) | set(UNINSTALL_HOOK_CLIENT_CALLS)
    lease_called = set().union(*(client_methods_called(path, {"_api"}) for path in paths))
    assert lease_called == set(LEASE_CLIENT_CALLS)


def test_every_client_call_of_the_agent_is_listed() -> None:
    paths = sorted(AGENT_KUBE.glob("*.py"))
    assert len(paths) > 1  # the package, not an empty folder
    called = set().union(*(client_methods_called(path, {"_api"}) for path in paths))
    assert called == set(AGENT_CLIENT_CALLS)


def test_only_the_kube_modules_create_api_clients() -> None:
    """Other modules would make calls the lists above do not see."""
    offenders = []
    for root in (REPO_ROOT / "operator", REPO_ROOT / "node_agent"):
        for path in root.rglob("*.py"):
            if path.parent in (OPERATOR_KUBE, AGENT_KUBE):
                continue
            text = path.read_text()
            if path == REPO_ROOT / "operator/perseus_api/kube_client.py":
                # The shared configuration loader: it builds an ApiClient and calls nothing.
                assert "_api(" not in text and "Api(" not in text.replace("ApiClient(", "")
                continue
            if "from kubernetes" in text or "import kubernetes" in text:
                offenders.append(str(path.relative_to(REPO_ROOT)))
    assert offenders == []


# -- the chart grants exactly those calls ------------------------------------------------------


def test_operator_rbac_is_exactly_its_calls_cluster_wide() -> None:
    rendered = render()
    assert grants_of(rendered, OPERATOR_SA) == (
        expected_grants(operator_calls(namespaced=False)) | LEASE_GRANTS | BUDGET_EVENT_GRANTS
    )


def test_operator_rbac_is_exactly_its_calls_in_the_watched_namespaces() -> None:
    watched = ["ml", "team-b"]
    rendered = render({"operator": {"watchNamespaces": watched}})
    grants = grants_of(rendered, OPERATOR_SA)
    assert grants == (
        expected_grants(operator_calls(namespaced=True), watched)
        | LEASE_GRANTS
        | BUDGET_EVENT_GRANTS
    )
    assert not allows(grants, "update", "coordination.k8s.io", "leases", "ml")
    assert allows(grants, "list", "", "pods", "ml")
    assert not allows(grants, "list", "", "pods", "kube-system")
    assert not allows(grants, "create", GROUP, resources.NODE_PLAN_PLURAL, "other")
    deployment = rendered.one("Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace=")] == [
        "--namespace=ml",
        "--namespace=team-b",
    ]


def test_agent_rbac_is_exactly_its_calls() -> None:
    rendered = render()
    assert grants_of(rendered, AGENT_SA) == expected_grants(agent_calls())
    # Without the TCP transport the agent still tells a pod by its cgroup's UID, and needs
    # the node's pods for which pod that is now (issue 30: recreated pods, claimed UIDs).
    socket_only = render({"agent": {"tcp": {"enabled": False}}})
    assert grants_of(socket_only, AGENT_SA) == expected_grants(agent_calls())


@pytest.mark.parametrize(
    ("verb", "group", "resource"),
    [
        ("get", "", "secrets"),
        ("list", "", "secrets"),
        ("get", "", "pods"),  # list and watch only, its own node's
        ("list", "", "nodes"),  # get only: its own node's upgrade label
        ("patch", "", "nodes"),
        ("get", "", "configmaps"),
        ("create", GROUP, resources.NODE_PLAN_PLURAL),
        ("patch", GROUP, resources.NODE_PLAN_PLURAL),  # the spec is the operator's
        ("update", GROUP, resources.NODE_PLAN_PLURAL),
        ("delete", GROUP, resources.NODE_PLAN_PLURAL),
        ("update", GROUP, f"{resources.NODE_PLAN_PLURAL}/status"),
        ("get", GROUP, JOB_PLURAL),
        ("patch", GROUP, f"{JOB_PLURAL}/status"),
        ("create", "", "events"),
    ],
)
def test_the_agent_cannot(verb: str, group: str, resource: str) -> None:
    assert not allows(grants_of(render(), AGENT_SA), verb, group, resource, "ml")


def test_the_agent_can_read_plans_everywhere_and_write_only_their_status() -> None:
    grants = grants_of(render(), AGENT_SA)
    assert allows(grants, "list", GROUP, resources.NODE_PLAN_PLURAL, None)
    assert allows(grants, "watch", GROUP, resources.NODE_PLAN_PLURAL, None)
    assert allows(grants, "patch", GROUP, f"{resources.NODE_PLAN_PLURAL}/status", "ml")


@pytest.mark.parametrize(
    ("verb", "group", "resource"),
    [
        ("get", "", "secrets"),
        ("list", "", "secrets"),
        ("delete", "", "pods"),
        ("create", "", "pods"),
        ("update", GROUP, JOB_PLURAL),
        ("create", GROUP, POLICY_PLURAL),
        ("patch", GROUP, POLICY_PLURAL),
        ("delete", GROUP, POLICY_PLURAL),
        ("patch", "", "namespaces"),
        ("delete", "", "configmaps"),
        ("create", CRD_GROUP, "customresourcedefinitions"),
        ("patch", "kubeflow.org", "pytorchjobs"),
        ("watch", "", "nodes"),  # list only: the power domains select nodes by label
    ],
)
def test_the_operator_cannot(verb: str, group: str, resource: str) -> None:
    assert not allows(grants_of(render(), OPERATOR_SA), verb, group, resource, "ml")


def test_bindings_name_the_service_accounts_the_pods_run_as() -> None:
    rendered = render()
    users = {
        kind: "system:serviceaccount:{}:{}".format(
            NAMESPACE, rendered.one(kind)["spec"]["template"]["spec"]["serviceAccountName"]
        )
        for kind in ("Deployment", "DaemonSet")
    }
    assert users == {"Deployment": OPERATOR_SA, "DaemonSet": AGENT_SA}
    accounts = {
        f"system:serviceaccount:{NAMESPACE}:{sa['metadata']['name']}"
        for sa in rendered.of_kind("ServiceAccount")
    }
    assert accounts == {OPERATOR_SA, AGENT_SA, UNINSTALL_HOOK_SA}  # the last: a hook


def test_existing_service_accounts_can_be_used() -> None:
    rendered = render(
        {
            "operator": {"serviceAccount": {"create": False, "name": "ops"}},
            "agent": {"serviceAccount": {"create": False, "name": "gpu-agent"}},
        }
    )
    # Only the uninstall hook's own account, which exists while the hook runs.
    (hook_account,) = rendered.of_kind("ServiceAccount")
    assert hook_account["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    agent = f"system:serviceaccount:{NAMESPACE}:gpu-agent"
    assert grants_of(rendered, agent) == expected_grants(agent_calls())
    policy = rendered.one("ValidatingAdmissionPolicy")
    assert agent in policy["spec"]["matchConditions"][0]["expression"]


def test_admission_policy_limits_each_agent_to_its_own_node() -> None:
    """RBAC cannot tell one agent from another; the policy compares the plan's node with the
    node the agent's pod-bound token names."""
    rendered = render()
    policy = rendered.one("ValidatingAdmissionPolicy")
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == [f"{resources.NODE_PLAN_PLURAL}/status"]
    assert rule["apiGroups"] == [GROUP]
    assert rule["operations"] == ["UPDATE"]  # a PATCH is admitted as an UPDATE
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConditions"][0]["expression"] == (
        f'request.userInfo.username == "{AGENT_SA}"'
    )
    (validation,) = policy["spec"]["validations"]
    assert "oldObject.spec.node ==" in validation["expression"]
    assert "authentication.kubernetes.io/node-name" in validation["expression"]
    binding = rendered.one("ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    off = render({"agent": {"restrictReportsToOwnNode": False}})
    assert off.of_kind("ValidatingAdmissionPolicy") == []
    assert off.of_kind("ValidatingAdmissionPolicyBinding") == []


def test_the_plan_spec_carries_the_node_the_policy_compares() -> None:
    from perseus_api.node_plan import NodePlan

    assert "node" in NodePlan.model_fields


# -- what the agent really calls, against an emulated API server -------------------------------


def _observed_call(request: Any) -> tuple[str | None, str, str, str]:
    """(namespace or None for all, group, resource[/subresource], verb) of a kmock request."""
    method = str(request.method.value if hasattr(request.method, "value") else request.method)
    method = method.upper()
    group = request.resource.group or ""
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    params = dict(request.params)
    if method == "GET":
        if request.name:
            verb = "get"
        else:
            verb = "watch" if params.get("watch") in ("true", "1", "True") else "list"
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return request.namespace, group, resource, verb


def test_the_agent_process_makes_exactly_the_listed_calls(tmp_path: Path) -> None:
    """The real agent (Kubernetes mode, emulated GPUs) against kmock: a plan is created,
    applied, reported, changed and deleted, then the agent stops. Every request it made is
    allowed by the chart's RBAC, and the kinds of calls are exactly the listed ones."""
    import shutil
    import socket
    import tempfile

    kubernetes = pytest.importorskip("kubernetes")
    pytest.importorskip("kmock")
    from perseus_api.node_plan import NodePlan
    from support.agent_process import NODE, Agent, wait_for
    from support.factories import pipeline_plan_fields
    from support.kmock_server import KmockServer

    plural = f"{GROUP}/{resources.VERSION}/{resources.NODE_PLAN_PLURAL}"
    info = {
        "kind": resources.NODE_PLAN_KIND,
        "singular": resources.NODE_PLAN_SINGULAR,
        "namespaced": True,
        "subresources": {"status"},
    }
    fields = pipeline_plan_fields(num_stages=2, num_microbatches=2) | {"granularity": "Stage"}

    def plan(revision: int, mhz: int) -> NodePlan:
        for stage in fields["stages"]:
            stage["frequency_mhz"] = mhz
        body = {
            "node": NODE,
            "namespace": "ml",
            "job": "gpt3",
            "revision": revision,
            "granularity": "Stage",
            "plans": {"main": fields},
            "assignments": [{"gpu_index": 0, "plan": "main", "stage": 0, "rank": 0}],
        }
        return NodePlan.model_validate(body)

    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="prbac-"))
    pods = {"kind": "Pod", "singular": "pod", "namespaced": True}
    with KmockServer({plural: info, "v1/pods": pods}) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        client.user_agent = "perseus-rbac-test"  # this test's own requests are told apart
        api = kubernetes.client.CustomObjectsApi(client)
        args = (GROUP, resources.VERSION, "ml", resources.NODE_PLAN_PLURAL)
        agent = Agent(tmp_path, socket_dir / "run", num_gpus=1, kubeconfig=kubeconfig, tcp=True)

        def status() -> dict[str, Any]:
            obj = server.objects(plural).get(("ml", f"gpt3-{NODE}")) or {}
            return dict(obj.get("status") or {})

        try:
            agent.start()
            assert agent.tcp_port is not None
            # A TCP peer (no pod of the node has its address: refused); the agent lists and
            # watches its node's pods whatever the peers.
            with socket.create_connection(("127.0.0.1", agent.tcp_port), timeout=10) as peer:
                hello = {"op": "hello", "version": 2, "rank": 0, "pid": 1, "gpu_uuids": []}
                peer.sendall(json.dumps(hello).encode() + b"\n")
                line = peer.makefile("rb").readline()
                assert b"not the address of a live pod" in line or b"not listed the pods" in line
            api.create_namespaced_custom_object(*args, resources.node_plan_object(plan(1, 1005)))
            wait_for(lambda: status().get("observedRevision") == 1, "a report", agent)
            new = plan(2, 1200).model_dump(mode="json", by_alias=True)
            api.patch_namespaced_custom_object(*args, f"gpt3-{NODE}", {"spec": new})
            wait_for(lambda: status().get("observedRevision") == 2, "a report", agent)
            assert agent.stop() == 0  # reports "stopped" on its way out
            agent.start()
            api.delete_namespaced_custom_object(*args, f"gpt3-{NODE}")
            wait_for(lambda: agent.clocks() == [None], "the reset", agent)
            assert agent.stop() == 0
        finally:
            agent.kill_if_running()
            client.close()
            shutil.rmtree(socket_dir, ignore_errors=True)
        requests = server.call(lambda emulator: list(emulator._requests))

    observed = {
        _observed_call(r)
        for r in requests
        if r.resource is not None and r.headers.get("User-Agent") != "perseus-rbac-test"
    }
    grants = grants_of(render(), AGENT_SA)
    for namespace, group, resource, verb in observed:
        assert allows(grants, verb, group, resource, namespace), (namespace, resource, verb)
    kinds = {(g, r, v, ns is None) for ns, g, r, v in observed}
    assert kinds == {(c.group, c.resource, c.verb, c.cluster) for c in agent_calls()}


@pytest.mark.parametrize("watched", [[], ["ml", "team-b"]])
def test_the_uninstall_hook_may_delete_perseus_objects_only(watched: list[str]) -> None:
    rendered = render({"operator": {"watchNamespaces": watched}})
    calls = [c for cs in UNINSTALL_HOOK_CLIENT_CALLS.values() for c in cs]
    assert grants_of(rendered, UNINSTALL_HOOK_SA) == expected_grants(calls)
    (pod,) = [p for p in rendered.of_kind("Pod") if p["metadata"]["name"].endswith("uninstall")]
    assert pod["spec"]["serviceAccountName"] == UNINSTALL_HOOK_SA.rsplit(":", 1)[-1]
    # Its account and rights exist only while the hook runs.
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
        obj = rendered.one(kind, "-uninstall")
        assert obj["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
        assert int(obj["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0  # before the pod
