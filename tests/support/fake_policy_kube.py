"""The API as the policy controller (:mod:`perseus_operator.policies.policy_controller`) calls it,
in memory, and a policy for it to apply."""

from __future__ import annotations

from perseus_api.job import WorkloadKind
from perseus_operator.cluster.kube.client import KubeError
from support.workload_objects import NAMESPACES, Obj


def policy() -> Obj:
    return {
        "metadata": {"name": "research", "generation": 1},
        "spec": {
            "namespaceSelector": {"matchLabels": {"perseus.energy/enabled": "true"}},
            "workloads": [{"kind": "PyTorchJob"}],
        },
    }


class FakeKube:
    """What the controller calls, with a log of the writes; ``fail`` maps a method name to the
    error it raises."""

    def __init__(self, policies: list[Obj] | None) -> None:
        self.policies = policies
        self.workloads: dict[str, list[Obj]] = {}
        self.jobs: list[Obj] = []
        self.writes: list[tuple[str, str]] = []
        self.fail: dict[str, KubeError] = {}
        self.namespaces_listed = 0

    def _maybe_fail(self, method: str) -> None:
        if method in self.fail:
            raise self.fail[method]

    async def list_policies(self) -> list[Obj] | None:
        return self.policies

    async def list_namespaces(self) -> list[Obj]:
        self.namespaces_listed += 1
        return [{"metadata": {"name": n, "labels": labels}} for n, labels in NAMESPACES.items()]

    async def list_workloads(self, namespace: str, kind: WorkloadKind) -> list[Obj]:
        self._maybe_fail("list_workloads")
        return [w for w in self.workloads.get(namespace, []) if w["kind"] == kind.value]

    async def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        return []

    async def list_jobs(self, namespace: str | None, selector: str = "") -> list[Obj]:
        return [j for j in self.jobs if namespace in (None, j["metadata"]["namespace"])]

    async def create_job(self, body: Obj) -> None:
        self._maybe_fail("create_job")
        self.writes.append(("create", body["metadata"]["name"]))

    async def patch_job(self, namespace: str, name: str, patch: Obj) -> None:
        self.writes.append(("patch", name))

    async def delete_job(self, namespace: str, name: str) -> None:
        self.writes.append(("delete", name))

    async def create_event(self, namespace: str, body: Obj) -> None:
        self._maybe_fail("create_event")
        self.writes.append(("event", body["reason"]))

    async def patch_policy_status(self, name: str, status: Obj) -> None:
        self.writes.append(("status", name))
