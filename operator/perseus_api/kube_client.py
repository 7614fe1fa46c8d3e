"""What the operator's and the node agent's Kubernetes modules share: loading the client
configuration, and one line that says how an API call failed.

Each component still has one place that talks to the API (the packages
``perseus_operator/cluster/kube/`` and ``perseus_agent/kube/``) and raises its own error type;
this module makes no request and holds no client. The ``kubernetes`` package is imported
only inside :func:`load_api_client`, so importing this module costs nothing where it is not
installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["describe_api_error", "http_status", "load_api_client"]


def load_api_client(
    kubeconfig: str | None,
    error: Callable[[str], Exception],
    *,
    in_cluster_hint: str = "",
    extra: str = "",
) -> Any:
    """A ``kubernetes.client.ApiClient``: from ``kubeconfig`` (a path, or several separated
    like ``$KUBECONFIG``) if given, else the pod's in-cluster service account. Nothing is
    requested from the API here.

    Raises:
        Exception: ``error(message)`` when the configuration cannot be loaded (the message
            ends with ``in_cluster_hint`` when there was no kubeconfig), or when the
            ``kubernetes`` package is missing (naming the pyproject ``extra`` that brings it).
    """
    try:
        from kubernetes import client, config
    except ImportError as exc:  # pragma: no cover - a packaging error, see perseus_api.extras
        install = f"; install perseus-k8s[{extra}]" if extra else ""
        raise error(f"the Kubernetes client is not installed ({exc}){install}") from None
    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(
                config_file=kubeconfig, client_configuration=configuration, persist_config=False
            )
        else:
            config.load_incluster_config(client_configuration=configuration)
    except Exception as exc:  # ConfigException, YAML and I/O errors alike: all fatal here
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster configuration"
        hint = "" if kubeconfig else in_cluster_hint
        raise error(f"cannot load the {where}: {exc}{hint}") from None
    return client.ApiClient(configuration)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a failed API call (a ``kubernetes`` ``ApiException``); ``None`` for
    an error that got no answer."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and status > 0 else None


def describe_api_error(exc: BaseException) -> str:
    """``HTTP 403 Forbidden: <the API server's message>`` for a failed call, else the
    exception's type and text."""
    status = http_status(exc)
    if status is None:
        return f"{type(exc).__name__}: {exc}"
    reason = getattr(exc, "reason", "") or ""
    body = getattr(exc, "body", None)
    message = ""
    if isinstance(body, str | bytes):
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
            message = parsed["message"]
    return f"HTTP {status} {reason}".strip() + (f": {message}" if message else "")
