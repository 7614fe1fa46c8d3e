"""The event loop's client of the Kubernetes API: what a job's reconcile and the policies
read and write, and the error every API call of the operator raises.

Objects travel as plain dicts in the API's own (camelCase) form, so the pure modules read
them exactly as ``kubectl get -o json`` shows them. Calls are blocking; :class:`KubeClient`
runs each in a worker thread so the event loop never waits on the network.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection, Mapping
from http import HTTPStatus
from typing import Any, Final, TypeVar

from perseus_api import kube_client, resources
from perseus_api.job import JOB_PLURAL, WorkloadKind
from perseus_api.kube_client import describe_api_error
from perseus_api.policy import POLICY_PLURAL
from perseus_api.power_budget import BUDGET_PLURAL

T = TypeVar("T")

WORKLOAD_RESOURCES: Final = {
    WorkloadKind.PYTORCH_JOB: ("kubeflow.org", "v1", "pytorchjobs"),
    WorkloadKind.JOB_SET: ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    WorkloadKind.TRAIN_JOB: ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
}
"""Group, version and plural of the workload kinds that are custom resources."""
REQUEST_TIMEOUT_S: Final = 30.0
"""No API call may hang a job's reconcile for longer."""


class KubeError(Exception):
    """A Kubernetes API call failed; ``status`` is the HTTP status (None: no answer).

    Not an :class:`~perseus_api.errors.ApiError` (a ``ValueError``): that is malformed data,
    and an unreachable API server or a refused call is not."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def not_found(self) -> bool:
        """The object, or its kind (a CRD that is not installed), does not exist: HTTP 404."""
        return self.status == HTTPStatus.NOT_FOUND


def load_api_client(kubeconfig: str) -> Any:
    """A ``kubernetes.client.ApiClient`` from ``kubeconfig``, else the in-cluster account.

    Raises:
        KubeError: the configuration cannot be loaded.
    """
    return kube_client.load_api_client(kubeconfig, KubeError, extra="operator")


def config_map_object(
    namespace: str,
    name: str,
    data: Mapping[str, str],
    owner: Mapping[str, Any],
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A ConfigMap owned by ``owner`` (an owner reference), ready to create."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "ownerReferences": [dict(owner)],
            "annotations": dict(annotations or {}),
            "labels": dict(labels or {}),
        },
        "data": dict(data),
    }


class KubeClient:
    """Async facade over the blocking ``kubernetes`` client for what the operator needs."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._api_client = api_client

    def close(self) -> None:
        self._api_client.close()

    # -- pods and workloads --

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return await self._items(
            lambda: self._core.list_namespaced_pod(
                namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    async def get_workload(
        self, namespace: str, kind: WorkloadKind, name: str
    ) -> dict[str, Any] | None:
        """The workload object, or None when it (or its kind's CRD) does not exist."""
        group, version, plural = WORKLOAD_RESOURCES[kind]
        return await self._get(
            lambda: self._custom.get_namespaced_custom_object(
                group,
                version,
                namespace,
                plural,
                name,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    async def list_workloads(self, namespace: str, kind: WorkloadKind) -> list[dict[str, Any]]:
        """The namespace's workloads of ``kind``; none when the kind's CRD is not installed."""
        group, version, plural = WORKLOAD_RESOURCES[kind]
        try:
            return await self._items(
                lambda: self._custom.list_namespaced_custom_object(
                    group,
                    version,
                    namespace,
                    plural,
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_S,
                )
            )
        except KubeError as exc:
            if exc.not_found:
                return []
            raise

    async def list_namespaces(self) -> list[dict[str, Any]]:
        return await self._items(
            lambda: self._core.list_namespace(
                _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            )
        )

    # -- policies and the jobs they make --

    async def list_policies(self) -> list[dict[str, Any]] | None:
        """Every PerseusPolicy; None when their CRD is not installed."""
        return await self._list_if_installed(POLICY_PLURAL)

    async def patch_policy_status(self, name: str, status: Mapping[str, Any]) -> None:
        await self._patch_cluster_scoped_status(POLICY_PLURAL, name, status)

    # -- cluster-scoped objects of ours (policies, budgets, every node plan) --

    async def _list_cluster_scoped(self, plural: str) -> list[dict[str, Any]]:
        return await self._items(
            lambda: self._custom.list_cluster_custom_object(
                resources.GROUP,
                resources.VERSION,
                plural,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    async def _list_if_installed(self, plural: str) -> list[dict[str, Any]] | None:
        """Every object of ``plural``; None when its CRD is not installed."""
        try:
            return await self._list_cluster_scoped(plural)
        except KubeError as exc:
            if exc.not_found:
                return None
            raise

    async def _patch_cluster_scoped_status(
        self, plural: str, name: str, status: Mapping[str, Any]
    ) -> None:
        await self._call(
            lambda: self._custom.patch_cluster_custom_object_status(
                resources.GROUP,
                resources.VERSION,
                plural,
                name,
                {"status": dict(status)},
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    async def list_jobs(self, namespace: str | None, selector: str = "") -> list[dict[str, Any]]:
        """PerseusJobs of ``namespace`` (None: of every namespace) matching ``selector``."""
        args = (resources.GROUP, resources.VERSION)
        if namespace is None:
            return await self._items(
                lambda: self._custom.list_cluster_custom_object(
                    *args,
                    JOB_PLURAL,
                    label_selector=selector,
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT_S,
                )
            )
        return await self._items(
            lambda: self._custom.list_namespaced_custom_object(
                *args,
                namespace,
                JOB_PLURAL,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    async def create_job(self, body: Mapping[str, Any]) -> None:
        namespace, _ = resources.object_key(body)
        args = (resources.GROUP, resources.VERSION, namespace, JOB_PLURAL)
        await self._call(
            lambda: self._custom.create_namespaced_custom_object(
                *args, dict(body), _request_timeout=REQUEST_TIMEOUT_S
            )
        )

    async def patch_job(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        args = (resources.GROUP, resources.VERSION, namespace, JOB_PLURAL, name)
        await self._call(
            lambda: self._custom.patch_namespaced_custom_object(
                *args, dict(patch), _request_timeout=REQUEST_TIMEOUT_S
            )
        )

    async def delete_job(self, namespace: str, name: str) -> None:
        await self._delete(JOB_PLURAL, namespace, name)

    async def create_event(self, namespace: str, body: Mapping[str, Any]) -> None:
        await self._call(
            lambda: self._core.create_namespaced_event(
                namespace, dict(body), _request_timeout=REQUEST_TIMEOUT_S
            )
        )

    # -- config maps --

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._get(
            lambda: self._core.read_namespaced_config_map(
                name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            )
        )

    async def list_config_maps(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """ConfigMaps matching the label ``selector`` (stored profiles of a model)."""
        return await self._items(
            lambda: self._core.list_namespaced_config_map(
                namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    async def get_node(self, name: str) -> dict[str, Any] | None:
        """The Node (for its GPU product label); None when it does not exist."""
        return await self._get(
            lambda: self._core.read_node(
                name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            )
        )

    async def put_config_map(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        owner: Mapping[str, Any],
        annotations: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        body = config_map_object(namespace, name, data, owner, annotations, labels)
        existing = await self.get_config_map(namespace, name)
        if existing is None:
            await self._call(
                lambda: self._core.create_namespaced_config_map(
                    namespace, body, _request_timeout=REQUEST_TIMEOUT_S
                )
            )
        else:
            await self._call(
                lambda: self._core.patch_namespaced_config_map(
                    name, namespace, body, _request_timeout=REQUEST_TIMEOUT_S
                )
            )

    # -- node plans --

    async def list_node_plans(self, namespace: str, job: str) -> list[dict[str, Any]]:
        selector = f"{resources.JOB_LABEL}={resources.label_value(job)}"
        return await self._node_plans(namespace, label_selector=selector)

    async def list_node_plans_on(
        self, namespace: str, nodes: Collection[str]
    ) -> list[dict[str, Any]]:
        """Every job's node plans in ``namespace`` on one of ``nodes`` (which of their GPUs
        are claimed, and by whom)."""
        wanted = {resources.label_value(n) for n in nodes}
        return [
            p
            for p in await self._node_plans(namespace)
            if ((p.get("metadata") or {}).get("labels") or {}).get(resources.NODE_LABEL) in wanted
        ]

    async def list_all_node_plans(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every PerseusNodePlan of ``namespace`` (None: of the cluster): a power domain's GPUs
        and their reports."""
        if namespace is not None:
            return await self._node_plans(namespace)
        return await self._list_cluster_scoped(resources.NODE_PLAN_PLURAL)

    # -- power budgets --

    async def list_power_budgets(self) -> list[dict[str, Any]] | None:
        """Every PerseusPowerBudget; None when their CRD is not installed."""
        return await self._list_if_installed(BUDGET_PLURAL)

    async def patch_power_budget_status(self, name: str, status: Mapping[str, Any]) -> None:
        await self._patch_cluster_scoped_status(BUDGET_PLURAL, name, status)

    async def list_nodes(self) -> list[dict[str, Any]]:
        """Every Node (power domains select theirs by label)."""
        return await self._items(
            lambda: self._core.list_node(_preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
        )

    async def _node_plans(self, namespace: str, **selector: str) -> list[dict[str, Any]]:
        return await self._items(
            lambda: self._custom.list_namespaced_custom_object(
                resources.GROUP,
                resources.VERSION,
                namespace,
                resources.NODE_PLAN_PLURAL,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
                **selector,
            )
        )

    async def put_node_plan(self, body: Mapping[str, Any], owner: Mapping[str, Any]) -> None:
        """Create the node plan, or replace the spec of the existing one."""
        namespace, name = resources.object_key(body)
        obj = {**body, "metadata": {**body["metadata"], "ownerReferences": [dict(owner)]}}
        args = (resources.GROUP, resources.VERSION, namespace, resources.NODE_PLAN_PLURAL)
        try:
            await self._call(
                lambda: self._custom.create_namespaced_custom_object(
                    *args, obj, _request_timeout=REQUEST_TIMEOUT_S
                )
            )
        except KubeError as exc:
            if exc.status != 409:
                raise
            # Nulls remove the keys an operator of an older version wrote in snake_case.
            spec = resources.without_snake_case_keys(obj["spec"])
            patch = {"metadata": {"labels": obj["metadata"]["labels"]}, "spec": spec}
            await self._call(
                lambda: self._custom.patch_namespaced_custom_object(
                    *args, name, patch, _request_timeout=REQUEST_TIMEOUT_S
                )
            )

    async def delete_node_plan(self, namespace: str, name: str) -> None:
        await self._delete(resources.NODE_PLAN_PLURAL, namespace, name)

    # -- plumbing --

    async def _delete(self, plural: str, namespace: str, name: str) -> None:
        """Delete a ``perseus.energy`` object; one already gone is no error."""
        args = (resources.GROUP, resources.VERSION, namespace, plural, name)
        try:
            await self._call(
                lambda: self._custom.delete_namespaced_custom_object(
                    *args, _request_timeout=REQUEST_TIMEOUT_S
                )
            )
        except KubeError as exc:
            if not exc.not_found:
                raise

    async def _items(self, call: Callable[[], Any]) -> list[dict[str, Any]]:
        response = await self._call(call)
        items = response_json(response).get("items") or []
        return [i for i in items if isinstance(i, dict)]

    async def _get(self, call: Callable[[], Any]) -> dict[str, Any] | None:
        try:
            return response_json(await self._call(call))
        except KubeError as exc:
            if exc.not_found:
                return None
            raise

    async def _call(self, call: Callable[[], T]) -> T:
        from kubernetes.client.exceptions import ApiException

        try:
            return await asyncio.to_thread(call)
        except ApiException as exc:
            raise KubeError(describe_api_error(exc), exc.status) from None
        except OSError as exc:  # urllib3 connection errors are OSErrors too
            raise KubeError(f"Kubernetes API unreachable: {exc}") from None


def response_json(response: Any) -> dict[str, Any]:
    """The JSON object of a response read with ``_preload_content=False`` ({} when none)."""
    data = getattr(response, "data", response)
    if isinstance(data, bytes | str):
        parsed = json.loads(data)
        return parsed if isinstance(parsed, dict) else {}
    return data if isinstance(data, dict) else {}
