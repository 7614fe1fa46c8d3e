"""The blocking API clients of the short-lived callers: the chart's Helm hooks
(:mod:`perseus_operator.chart_hooks`) and the pod injection webhook's threads
(:mod:`perseus_operator.webhook.injection_server`), which run apart from the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from perseus_api import resources
from perseus_api.job import JOB_PLURAL
from perseus_api.kube_client import describe_api_error
from perseus_api.policy import POLICY_PLURAL
from perseus_operator.cluster.kube.client import REQUEST_TIMEOUT_S, KubeError, response_json

T = TypeVar("T")


class HookApi:
    """What the chart's Helm hooks read and delete (:mod:`perseus_operator.chart_hooks`).
    Blocking: a hook is a short command, not the operator's event loop."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self._custom = client.CustomObjectsApi(api_client)
        self._extensions = client.ApiextensionsV1Api(api_client)

    def crds(self) -> list[dict[str, Any]]:
        return self._items(
            lambda: self._extensions.list_custom_resource_definition(
                _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            )
        )

    def policies(self) -> list[dict[str, Any]]:
        return self._items(
            lambda: self._custom.list_cluster_custom_object(
                resources.GROUP,
                resources.VERSION,
                POLICY_PLURAL,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    def delete_policy(self, name: str) -> None:
        self._ignore_404(
            lambda: self._custom.delete_cluster_custom_object(
                resources.GROUP,
                resources.VERSION,
                POLICY_PLURAL,
                name,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    def jobs(self, namespace: str | None) -> list[dict[str, Any]]:
        """PerseusJobs of ``namespace`` (None: of every namespace)."""
        args = (resources.GROUP, resources.VERSION)
        if namespace is None:
            return self._items(
                lambda: self._custom.list_cluster_custom_object(
                    *args, JOB_PLURAL, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
                )
            )
        return self._items(
            lambda: self._custom.list_namespaced_custom_object(
                *args,
                namespace,
                JOB_PLURAL,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    def delete_job(self, namespace: str, name: str) -> None:
        self._ignore_404(
            lambda: self._custom.delete_namespaced_custom_object(
                resources.GROUP,
                resources.VERSION,
                namespace,
                JOB_PLURAL,
                name,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        )

    def _items(self, call: Callable[[], Any]) -> list[dict[str, Any]]:
        items = response_json(self._sync(call)).get("items") or []
        return [i for i in items if isinstance(i, dict)]

    def _ignore_404(self, call: Callable[[], Any]) -> None:
        try:
            self._sync(call)
        except KubeError as exc:
            if not exc.not_found:
                raise

    @staticmethod
    def _sync(call: Callable[[], T]) -> T:
        from kubernetes.client.exceptions import ApiException

        try:
            return call()
        except ApiException as exc:
            raise KubeError(describe_api_error(exc), exc.status) from None
        except OSError as exc:
            raise KubeError(f"Kubernetes API unreachable: {exc}") from None


class PerseusJobLister:
    """The PerseusJobs of one namespace, for the pod injection webhook
    (:mod:`perseus_operator.webhook.injection_server`). Blocking: it runs in the webhook's
    threads."""

    def __init__(self, api_client: Any, timeout_s: float = 5.0) -> None:
        from kubernetes import client

        self._custom = client.CustomObjectsApi(api_client)
        self.timeout_s = timeout_s

    def __call__(self, namespace: str) -> list[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        try:
            response = self._custom.list_namespaced_custom_object(
                resources.GROUP,
                resources.VERSION,
                namespace,
                JOB_PLURAL,
                _preload_content=False,
                _request_timeout=self.timeout_s,
            )
        except ApiException as exc:
            raise KubeError(describe_api_error(exc), exc.status) from None
        items = response_json(response).get("items") or []
        return [item for item in items if isinstance(item, dict)]
