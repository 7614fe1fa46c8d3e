"""The node agent's Kubernetes I/O: its node's plans in, per-GPU reports out.

The only package of the agent that talks to the Kubernetes API (the ``kubernetes`` client,
imported lazily here, so standalone agents do not need it); the other modules of the agent ask
it. The objects are PerseusNodePlans (:mod:`perseus_api.resources`): one per (job, node), spec
a NodePlan, status the agent's report.

- this module: the client configuration and the API objects built on it;
- :mod:`perseus_agent.kube.plan_source`: the list/watch of this node's plans;
- :mod:`perseus_agent.kube.report_writer`: the status writes;
- :mod:`perseus_agent.kube.node`: this node's own object (a label);
- :mod:`perseus_agent.kube.pod_watch`: the list/watch of this node's pods (who a connection is).

What the agent does with the plans is :mod:`perseus_agent.plans.job_plans` (one applier per plan,
the GPUs arbitrated by :mod:`perseus_agent.plans.gpu_arbitration`); the status documents are
:mod:`perseus_agent.plans.plan_status`.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from perseus_agent.errors import AgentError
from perseus_api import kube_client

__all__ = [
    "REQUEST_TIMEOUT_S",
    "KubeConfigError",
    "ObjectKey",
    "close_response",
    "core_v1_api",
    "custom_objects_api",
    "load_api_client",
]

log = logging.getLogger(__name__)

ObjectKey = tuple[str, str]
"""``(namespace, name)`` of a node plan object."""

REQUEST_TIMEOUT_S: Final = 30.0
"""Connect timeout, and read timeout of requests other than watches, in seconds."""


class KubeConfigError(AgentError):
    """No usable Kubernetes client configuration (not in a cluster, bad kubeconfig, ...)."""


def load_api_client(kubeconfig: str | None) -> Any:
    """A ``kubernetes.client.ApiClient``: from ``kubeconfig`` (a path, or several separated
    like ``$KUBECONFIG``) if given, else the pod's in-cluster service account.

    Nothing is requested from the API here.

    Raises:
        KubeConfigError: The configuration cannot be loaded.
    """
    return kube_client.load_api_client(
        kubeconfig,
        KubeConfigError,
        in_cluster_hint=" (not running in a pod? pass --kubeconfig or --standalone)",
        extra="agent",
    )


def custom_objects_api(api_client: Any) -> Any:
    """A ``kubernetes.client.CustomObjectsApi`` on ``api_client``."""
    from kubernetes import client

    return client.CustomObjectsApi(api_client)


def core_v1_api(api_client: Any) -> Any:
    """A ``kubernetes.client.CoreV1Api`` on ``api_client``."""
    from kubernetes import client

    return client.CoreV1Api(api_client)


def close_response(response: Any) -> None:
    """Release a streamed (``_preload_content=False``) response's connection."""
    for method in ("close", "release_conn"):
        fn = getattr(response, method, None)
        if callable(fn):
            try:
                fn()
            except Exception:
                log.debug("error while closing a response", exc_info=True)
