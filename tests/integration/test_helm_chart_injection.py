"""The chart's pod injection (issue 17, item 1): the webhook configuration, its certificate and
Service, the operator serving it, and the agents listening on the node's address.

On the real kube-apiserver: ``tests/e2e/test_cluster_injection.py``."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any

import pytest

from perseus_operator.main import build_parser
from support.helm_render import NAMESPACE, lint, render, validate_values


def _operator(values: dict[str, Any] | None = None) -> dict[str, Any]:
    deployment = render(values).one("Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return {"pod": deployment["spec"]["template"]["spec"], "container": container}


def test_new_pods_are_sent_to_the_operator_and_never_refused_by_default() -> None:
    rendered = render()
    [config] = rendered.of_kind("MutatingWebhookConfiguration")
    [hook] = config["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    assert hook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    [excluded] = hook["namespaceSelector"]["matchExpressions"]
    assert excluded["operator"] == "NotIn"
    assert set(excluded["values"]) == {"kube-system", NAMESPACE}
    service_ref = hook["clientConfig"]["service"]
    assert service_ref["path"] == "/mutate" and service_ref["namespace"] == NAMESPACE
    service = rendered.one("Service", "-webhook")
    assert service["metadata"]["name"] == service_ref["name"]
    assert service["spec"]["ports"] == [
        {"name": "webhook", "port": service_ref["port"], "targetPort": "webhook", "protocol": "TCP"}
    ]
    operator = _operator()
    ports = {p["name"]: p["containerPort"] for p in operator["container"]["ports"]}
    assert ports["webhook"] == 9443
    assert (
        service["spec"]["selector"] == render().one("Deployment")["spec"]["selector"]["matchLabels"]
    )
    assert (
        render({"injection": {"failurePolicy": "Fail"}}).one("MutatingWebhookConfiguration")[
            "webhooks"
        ][0]["failurePolicy"]
        == "Fail"
    )


def test_the_operator_serves_the_webhook_with_the_agents_port(tmp_path: Path) -> None:
    values = {"agent": {"tcp": {"port": 7999}}, "injection": {"port": 9555}}
    operator = _operator(values)
    args = build_parser().parse_args(operator["container"]["args"])
    assert args.webhook_address == "0.0.0.0:9555"
    assert args.agent_tcp_port == 7999
    mount = next(m for m in operator["container"]["volumeMounts"] if m["name"] == "webhook-tls")
    assert Path(mount["mountPath"]) == args.webhook_cert_dir and mount["readOnly"] is True
    assert "subPath" not in mount  # a rotated certificate must show up in place
    volume = next(v for v in operator["pod"]["volumes"] if v["name"] == "webhook-tls")
    rendered = render(values)
    secret = rendered.one("Secret", "-webhook-tls")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    agent = rendered.one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert "--tcp-address=$(HOST_IP):7999" in agent["args"]


def test_the_generated_certificate_is_for_the_service_and_its_ca_is_the_bundle(
    tmp_path: Path,
) -> None:
    rendered = render()
    secret = rendered.one("Secret", "-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    for key in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    hook = rendered.one("MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stderr
    san = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    service = hook["clientConfig"]["service"]["name"]
    assert f"DNS:{service}.{NAMESPACE}.svc" in san


def test_a_provided_secret_is_used_as_it_is_and_cert_manager_fills_the_bundle() -> None:
    values = {"injection": {"tls": {"secretName": "my-cert", "certManager": {"enabled": True}}}}
    rendered = render(values)
    assert not [s for s in rendered.of_kind("Secret") if s["metadata"]["name"].endswith("-tls")]
    config = rendered.one("MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{NAMESPACE}/my-cert"
    }
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    volume = next(v for v in _operator(values)["pod"]["volumes"] if v["name"] == "webhook-tls")
    assert volume["secret"]["secretName"] == "my-cert"


@pytest.mark.parametrize(
    "values",
    [{"injection": {"enabled": False}}, {"agent": {"tcp": {"enabled": False}}}],
    ids=["injection-off", "tcp-off"],
)
def test_without_injection_nothing_of_it_is_rendered(values: dict[str, Any]) -> None:
    rendered = render(values)
    assert rendered.of_kind("MutatingWebhookConfiguration") == []
    assert not [
        s for s in rendered.of_kind("Service") if s["metadata"]["name"].endswith("-webhook")
    ]
    args = _operator(values)["container"]["args"]
    assert not [a for a in args if a.startswith("--webhook")]


def test_extra_namespace_selection_narrows_the_default() -> None:
    values = {
        "injection": {"namespaceSelector": {"matchLabels": {"perseus.energy/enabled": "true"}}}
    }
    selector = render(values).one("MutatingWebhookConfiguration")["webhooks"][0][
        "namespaceSelector"
    ]
    assert selector["matchLabels"] == {"perseus.energy/enabled": "true"}
    assert selector["matchExpressions"][0]["key"] == "kubernetes.io/metadata.name"


def test_the_values_are_checked() -> None:
    validate_values({"injection": {"failurePolicy": "Ignore", "port": 9443}})
    for bad in ({"failurePolicy": "Sometimes"}, {"port": 0}, {"tlss": {}}):
        with pytest.raises(Exception, match="/injection"):
            validate_values({"injection": bad})
    assert not lint({"injection": {"failurePolicy": "Fail"}}).get("errors")


def test_a_namespaced_operator_is_asked_about_its_namespaces_only() -> None:
    values = {"operator": {"watchNamespaces": ["ml", "research"]}}
    hook = render(values).one("MutatingWebhookConfiguration")["webhooks"][0]
    expressions = hook["namespaceSelector"]["matchExpressions"]
    assert {
        "key": "kubernetes.io/metadata.name",
        "operator": "In",
        "values": ["ml", "research"],
    } in (expressions)
