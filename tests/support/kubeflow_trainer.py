"""Kubeflow Trainer v2 (``trainer-controller-manager``) and the JobSet controller it runs a
TrainJob on, on a :class:`ControlPlane`, with their CRDs, webhooks and the
``torch-distributed`` ClusterTrainingRuntime, for end-to-end tests of real TrainJobs.

Binaries and manifests from ``scripts/build_test_control_plane.sh --only jobset,trainer``
(``PERSEUS_JOBSET_BIN``/``_MANIFESTS``, ``PERSEUS_TRAINER_BIN``/``_MANIFESTS``). Their
webhooks are called at 127.0.0.1 with the certificate of :func:`webhook_certificates`
(Trainer's cert rotator checks it in its Secret; JobSet's internal certificate management is
off, it reads the files). The kube-controller-manager must run its ``job`` controller.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from support.control_plane import ControlPlane
from support.operator_harness import free_port
from support.training_operator import wait_ready, webhook_certificates

TRAINER_NAMESPACE = "kubeflow-system"  # its default (no service-account namespace file here)
TRAINER_SECRET = "kubeflow-trainer-webhook-cert"
TRAINER_WEBHOOK_CONFIGURATION = "validator.trainer.kubeflow.org"
JOBSET_NAMESPACE = "jobset-system"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _at_localhost(configuration: dict[str, Any], name: str, port: int, ca_pem: str) -> Any:
    """A webhook configuration of the module's, each webhook called at 127.0.0.1:``port``."""
    bundle = base64.b64encode(ca_pem.encode()).decode()
    for hook in configuration["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
    configuration["metadata"] = {"name": name}
    return configuration


def _crds(plane: ControlPlane, paths: list[Path]) -> None:
    from support.cluster_harness import wait_established

    crds = [d for p in paths for d in _docs(p)]
    plane.apply(crds)
    for crd in crds:
        wait_established(plane, crd["metadata"]["name"])


def start_jobset(plane: ControlPlane, binary: Path, manifests: Path) -> None:
    """JobSet's CRD and webhooks, then its controller (admin credentials)."""
    _crds(plane, sorted(manifests.glob("*crd_bases*.yaml")))
    certs = webhook_certificates(plane.workdir)
    port, probe = free_port(), free_port()
    names = {
        "MutatingWebhookConfiguration": "jobset-mutating-webhook-configuration",
        "ValidatingWebhookConfiguration": "jobset-validating-webhook-configuration",
    }
    hooks = [
        _at_localhost(d, names[d["kind"]], port, certs["ca.crt"])
        for d in _docs(manifests / "config_components_webhook_manifests.yaml")
    ]
    plane.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": JOBSET_NAMESPACE}}, *hooks]
    )
    config = {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {
            "port": port,
            "host": "127.0.0.1",
            "certDir": str(plane.workdir / "webhook-certs"),
        },
        "metrics": {"bindAddress": f"127.0.0.1:{free_port()}"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{probe}"},
    }
    path = plane.workdir / "jobset-config.yaml"
    path.write_text(yaml.safe_dump(config))
    plane.spawn(
        "jobset", [str(binary), f"--kubeconfig={plane.admin_kubeconfig}", f"--config={path}"]
    )
    wait_ready(plane, "jobset", probe)


def start_trainer(plane: ControlPlane, binary: Path, manifests: Path) -> None:
    """Trainer v2's CRDs (and the PodGroup CRD its coscheduling plugin watches), its webhook,
    the controller, then the ``torch-distributed`` runtime (which its webhook validates)."""
    _crds(
        plane,
        [*sorted(manifests.glob("*crds_trainer*.yaml")), manifests / "podgroups.yaml"],
    )
    certs = webhook_certificates(plane.workdir)
    port, probe = free_port(), free_port()
    (configuration,) = _docs(manifests / "manifests_base_webhook_manifests.yaml")
    plane.apply(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TRAINER_NAMESPACE}},
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": TRAINER_SECRET, "namespace": TRAINER_NAMESPACE},
                "stringData": certs,
            },
            _at_localhost(configuration, TRAINER_WEBHOOK_CONFIGURATION, port, certs["ca.crt"]),
        ]
    )
    plane.spawn(
        "trainer",
        [
            str(binary),
            f"--kubeconfig={plane.admin_kubeconfig}",
            f"--webhook-server-port={port}",
            f"--health-probe-bind-address=127.0.0.1:{probe}",
            "--metrics-bind-address=0",
            "--leader-elect=false",
        ],
    )
    wait_ready(plane, "trainer", probe)
    plane.apply(_docs(manifests / "manifests_base_runtimes_torch_distributed.yaml"))
