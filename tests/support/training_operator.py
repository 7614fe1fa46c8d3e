"""Kubeflow's training-operator (v1, ``training-operator.v1``) on a :class:`ControlPlane`, with
its own PyTorchJob CRD and validating webhook, for end-to-end tests of real PyTorchJobs.

The binary and the manifests come from ``scripts/build_test_control_plane.sh``
(``PERSEUS_TRAINING_OPERATOR_BIN``, ``PERSEUS_TRAINING_OPERATOR_MANIFESTS``). In a cluster the
operator's webhook certificate lives in a Secret that the kubelet mounts at a fixed path and
that the operator's cert rotator keeps valid; here the test does both: it writes a CA and a
serving certificate (for the operator's service DNS name, which the rotator checks, and for
127.0.0.1, where the API server calls the webhook) into the Secret and into that path, so the
rotator keeps them and the API server calls the real webhook on every PyTorchJob write.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from support.control_plane import ControlPlane
from support.operator_harness import free_port

NAMESPACE = "kubeflow"  # the operator's (MY_POD_NAMESPACE): its Secret is looked up there
SERVICE = "training-operator"  # --webhook-service-name: the DNS name the rotator checks
SECRET = "training-operator-webhook-cert"
WEBHOOK_CONFIGURATION = "validator.training-operator.kubeflow.org"  # named in its cert code
# Hard-coded in the operator (pkg/cert): where the Secret would be mounted.
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")
PYTORCH_WEBHOOK_PATH = "/validate-kubeflow-org-v1-pytorchjob"
READY_TIMEOUT_S = 60.0


def pytorch_job_crd(manifests: Path) -> dict[str, Any]:
    """The operator's own PyTorchJob CRD (full schema, status subresource)."""
    crd: dict[str, Any] = yaml.safe_load((manifests / "kubeflow.org_pytorchjobs.yaml").read_text())
    return crd


def _webhook_configuration(manifests: Path, port: int, ca_pem: str) -> dict[str, Any]:
    """The module's ValidatingWebhookConfiguration, PyTorchJob's webhook only, called at
    127.0.0.1 (there is no Service) under the name the operator's rotator looks for."""
    import base64

    docs = [d for d in yaml.safe_load_all((manifests / "webhook.yaml").read_text()) if d]
    (configuration,) = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    hooks = [
        h
        for h in configuration["webhooks"]
        if h["clientConfig"]["service"]["path"].endswith(PYTORCH_WEBHOOK_PATH)
    ]
    if len(hooks) != 1:
        raise AssertionError(f"no single PyTorchJob webhook in {manifests / 'webhook.yaml'}")
    hook = hooks[0]
    hook["clientConfig"] = {
        "url": f"https://127.0.0.1:{port}{PYTORCH_WEBHOOK_PATH}",
        "caBundle": base64.b64encode(ca_pem.encode()).decode(),
    }
    configuration["metadata"] = {"name": WEBHOOK_CONFIGURATION}
    configuration["webhooks"] = [hook]
    return dict(configuration)


# Every webhook server here reads the same hard-coded directory (the training-operator's and
# Trainer v2's), so one serving certificate names all their services, signed by one CA that
# each one's rotator accepts under its own CA name.
CA_NAMES = ("training-operator-ca", "kubeflow-trainer-ca")
SERVICE_NAMES = (
    f"{SERVICE}.{NAMESPACE}.svc",
    "kubeflow-trainer-controller-manager.kubeflow-system.svc",
)


def webhook_certificates(workdir: Path) -> dict[str, str]:
    """A CA and a serving certificate it signed (for the services and 127.0.0.1), for ten
    years (the rotators replace certificates expiring within 90 days); made once per
    ``workdir``, and written to :data:`CERT_DIR` as the kubelet would mount them."""
    d = workdir / "webhook-certs"
    names = ("ca.crt", "ca.key", "tls.crt", "tls.key")
    if not (d / "tls.crt").exists():
        d.mkdir(exist_ok=True)
        _make_certificates(d)
    certs = {name: (d / name).read_text() for name in names}
    CERT_DIR.mkdir(parents=True, exist_ok=True)
    for name in ("tls.crt", "tls.key"):
        (CERT_DIR / name).write_text(certs[name])
    return certs


def _make_certificates(d: Path) -> None:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ca_sans = ",".join(f"DNS:{name}" for name in CA_NAMES)
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
        "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"),
        "-subj", "/O=perseus-test/CN=perseus-test-webhook-ca",
        "-addext", f"subjectAltName={ca_sans}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,digitalSignature,keyEncipherment",
    )  # fmt: skip
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "tls.key"),
        "-out", str(d / "tls.csr"), "-subj", f"/CN={SERVICE_NAMES[0]}",
    )  # fmt: skip
    sans = ",".join([*(f"DNS:{name}" for name in SERVICE_NAMES), "IP:127.0.0.1"])
    (d / "ext.cnf").write_text(
        f"subjectAltName={sans}\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    )
    openssl(
        "x509", "-req", "-in", str(d / "tls.csr"), "-CA", str(d / "ca.crt"),
        "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "3650",
        "-extfile", str(d / "ext.cnf"), "-out", str(d / "tls.crt"),
    )  # fmt: skip
    for key in ("ca.key", "tls.key"):  # the rotators parse PKCS #1 keys only
        openssl("rsa", "-in", str(d / key), "-traditional", "-out", str(d / key))


def wait_ready(plane: ControlPlane, name: str, probe_port: int) -> None:
    """Until ``name``'s ``/readyz`` answers 200; fails with its log."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{probe_port}/readyz", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{name} not ready in {READY_TIMEOUT_S} s:\n{plane.log(name)}")


def start_training_operator(plane: ControlPlane, binary: Path, manifests: Path) -> None:
    """The PyTorchJob CRD (Established), the webhook's Secret and configuration, then the
    operator (PyTorchJob controller only, admin credentials), stopped with ``plane``."""
    from support.cluster_harness import wait_established

    crd = pytorch_job_crd(manifests)
    plane.apply([crd])
    wait_established(plane, crd["metadata"]["name"])
    certs = webhook_certificates(plane.workdir)
    port = free_port()
    plane.apply(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": SECRET, "namespace": NAMESPACE},
                "stringData": certs,
            },
            _webhook_configuration(manifests, port, certs["ca.crt"]),
        ]
    )
    probe_port = free_port()
    plane.spawn(
        "training-operator",
        [
            str(binary),
            f"--kubeconfig={plane.admin_kubeconfig}",
            "--enable-scheme=pytorchjob",  # only its CRD is installed
            f"--webhook-server-port={port}",
            f"--webhook-service-name={SERVICE}",
            f"--webhook-secret-name={SECRET}",
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--health-probe-bind-address=127.0.0.1:{probe_port}",
            "--leader-elect=false",
        ],
        env={**os.environ, "MY_POD_NAMESPACE": NAMESPACE},
    )
    # Ready once its webhook serves (certificates checked, CA injected): before that the API
    # server refuses every PyTorchJob write (the webhook's failurePolicy is Fail).
    wait_ready(plane, "training-operator", probe_port)
