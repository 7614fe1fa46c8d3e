"""The Kubernetes client helpers of both components' Kubernetes I/O (perseus_api.kube_client)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perseus_api.kube_client import describe_api_error, http_status, load_api_client

kubernetes = pytest.importorskip("kubernetes", reason="the operator and agent extras bring it")
from kubernetes.client.exceptions import ApiException  # noqa: E402


class _LoadError(Exception):
    pass


def _api_exception(status: int, reason: str, body: object) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = body if isinstance(body, str | bytes | None) else json.dumps(body)
    return exc


def test_a_failed_call_says_its_status_reason_and_the_servers_message() -> None:
    message = 'perseusjobs.perseus.energy "gpt3" is forbidden: User "x" cannot patch'
    exc = _api_exception(403, "Forbidden", {"kind": "Status", "message": message})
    assert http_status(exc) == 403
    assert describe_api_error(exc) == f"HTTP 403 Forbidden: {message}"
    assert describe_api_error(_api_exception(500, "Internal Server Error", "not json")) == (
        "HTTP 500 Internal Server Error"
    )
    assert describe_api_error(_api_exception(404, "", None)) == "HTTP 404"


def test_an_error_without_an_answer_is_named_by_its_type() -> None:
    exc = ConnectionRefusedError(111, "Connection refused")
    assert http_status(exc) is None
    assert describe_api_error(exc) == "ConnectionRefusedError: [Errno 111] Connection refused"


def test_a_configuration_that_cannot_load_raises_the_callers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "kubeconfig"
    with pytest.raises(_LoadError, match=f"cannot load the kubeconfig {missing}: "):
        load_api_client(str(missing), _LoadError, in_cluster_hint=" (hint)")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(_LoadError, match=r"cannot load the in-cluster configuration: .* \(hint\)$"):
        load_api_client(None, _LoadError, in_cluster_hint=" (hint)")


def test_a_kubeconfig_loads_without_a_request(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    client = load_api_client(str(kubeconfig), _LoadError)
    assert client.configuration.host == "https://127.0.0.1:1"
