"""The end-to-end tests' real Kubernetes control plane, with the Helm chart installed.

A pytest plugin (``pytest_plugins`` in ``tests/conftest.py``): the session fixture ``cluster``.

One control plane per test session (etcd + kube-apiserver, RBAC on): the chart's CRDs and
everything it renders by default (service accounts, RBAC, the agents' admission policy, the
Deployment and DaemonSet, which no kubelet runs here) are applied, and the operator and each
node agent get a kubeconfig of their own service account. A node agent's token is bound to a
pod scheduled on its node, as the DaemonSet's would be, so the admission policy that keeps an
agent to its own node's plans applies.

Without the binaries the tests are skipped with the reason, or fail under
``PERSEUS_REQUIRE_E2E=1`` (CI).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from support.agent_process import Agent
from support.control_plane import ControlPlane, binaries

OPERATOR_SA = "perseus-operator"
AGENT_SA = "perseus-node-agent"


def require(reason: str) -> None:
    """Skip (loudly: ``-ra`` lists it) or, in CI, fail: a missing end-to-end prerequisite."""
    if os.environ.get("PERSEUS_REQUIRE_E2E") == "1":
        pytest.fail(f"end-to-end prerequisite missing (PERSEUS_REQUIRE_E2E=1): {reason}")
    pytest.skip(f"end-to-end prerequisite missing: {reason}")


@dataclass
class Cluster:
    """The control plane, an admin API client and the components' identities."""

    plane: ControlPlane
    api: Any  # kubernetes.client.ApiClient as admin
    operator_kubeconfig: Path
    namespace: str  # the chart's release namespace
    _agent_kubeconfigs: dict[str, Path] = field(default_factory=dict)

    @property
    def core(self) -> Any:
        return kubernetes.client.CoreV1Api(self.api)

    @property
    def custom(self) -> Any:
        return kubernetes.client.CustomObjectsApi(self.api)

    def node(self, name: str, gpus: int) -> None:
        """A Node with ``gpus`` allocatable GPUs, created once."""
        if any(n.metadata.name == name for n in self.core.list_node().items):
            return
        capacity = {"nvidia.com/gpu": str(gpus), "cpu": "16", "memory": "64Gi", "pods": "110"}
        self.core.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                "status": {"capacity": capacity, "allocatable": capacity},
            }
        )

    def agent_kubeconfig(self, node: str) -> Path:
        """The node agent's identity on ``node``: a token bound to an agent pod on that node."""
        if node not in self._agent_kubeconfigs:
            pod = f"perseus-node-agent-{node}"
            self.core.create_namespaced_pod(
                self.namespace,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod, "labels": {"app": "perseus-node-agent-test"}},
                    "spec": {
                        "nodeName": node,
                        "serviceAccountName": AGENT_SA,
                        "containers": [{"name": "agent", "image": "perseus-node-agent"}],
                    },
                },
            )
            self._agent_kubeconfigs[node] = self.plane.service_account_kubeconfig(
                self.namespace, AGENT_SA, bound_pod=pod
            )
        return self._agent_kubeconfigs[node]

    def node_agents(
        self, stack: ExitStack, workdir: Path, nodes: Sequence[str], gpus: int, socket_prefix: str
    ) -> list[Agent]:
        """Each of ``nodes`` (``gpus`` GPUs) and its node agent in Kubernetes mode, not started:
        its work directory under ``workdir``, its socket in a short directory that ``stack``
        removes (Unix socket paths are limited to 108 bytes, which pytest's tmp paths exceed)."""
        agents = []
        for node in nodes:
            self.node(node, gpus)
            (workdir / node).mkdir()
            socket_dir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix=socket_prefix))
            )
            agents.append(
                Agent(
                    workdir / node,
                    socket_dir,
                    num_gpus=gpus,
                    kubeconfig=self.agent_kubeconfig(node),
                    node=node,
                    log_level="info",
                )
            )
        return agents


# The workload kinds a PerseusJob may point at, as schema-less stand-ins of their CRDs (no
# training operator runs here): the operator reads them, and RBAC is checked on them.
WORKLOAD_KINDS = [
    ("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs"),
    ("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets"),
    ("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs"),
]


def workload_crd(group: str, version: str, kind: str, plural: str) -> dict[str, Any]:
    schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def api_client(kubeconfig: Path) -> Any:
    """A ``kubernetes.client.ApiClient`` acting as ``kubeconfig``'s user (close it after use)."""
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(kubeconfig), client_configuration=configuration
    )
    return kubernetes.client.ApiClient(configuration)


def install_chart(
    plane: ControlPlane, workload_crds: Sequence[dict[str, Any]] | None = None
) -> str:
    """CRDs first (Established before anything uses them), then the rendered templates; the
    release namespace. The workload kinds' CRDs are stand-ins unless ``workload_crds`` are
    given (e.g. the training operator's own)."""
    from support.helm_render import NAMESPACE, crds, render  # skips without helm-python-sdk

    if workload_crds is None:
        workload_crds = [workload_crd(*kind) for kind in WORKLOAD_KINDS]
    definitions = [*crds(), *workload_crds]
    plane.apply(definitions)
    for crd in definitions:
        wait_established(plane, crd["metadata"]["name"])
    plane.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])
    # Hooks are not part of a release: helm runs them at their events (tests/e2e/test_helm_cli.py).
    # No operator pod serves the pod injection webhook's Service here: every labelled pod would
    # wait out its timeout. tests/e2e/test_cluster_injection.py points it at an operator process.
    plane.apply(
        [
            o
            for o in render().objects
            if not is_hook(o) and o["kind"] != "MutatingWebhookConfiguration"
        ]
    )
    return NAMESPACE


def wait_established(plane: ControlPlane, crd: str) -> None:
    """``kubectl wait`` for the CRD's Established condition. Right after the create kubectl
    may find no conditions list yet and fail at once ("accessor error"): asked again then."""
    for _ in range(20):
        done = plane.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd}", check=False
        )
        if done.returncode == 0:
            return
        if "accessor error" not in done.stderr:
            break
        time.sleep(0.25)
    raise AssertionError(f"CRD {crd} not Established:\n{done.stdout}{done.stderr}")


def is_hook(obj: dict[str, Any]) -> bool:
    return "helm.sh/hook" in ((obj.get("metadata") or {}).get("annotations") or {})


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
    found = binaries()
    if isinstance(found, str):
        require(found)
        raise AssertionError("unreachable")
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"), *found)
    try:
        plane.start()
        namespace = install_chart(plane)
        with api_client(plane.admin_kubeconfig) as api:
            operator = plane.service_account_kubeconfig(namespace, OPERATOR_SA)
            yield Cluster(plane, api, operator, namespace)
    finally:
        plane.stop()
