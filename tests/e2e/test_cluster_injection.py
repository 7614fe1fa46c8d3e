"""Pods of managed workloads need no hand edits and pass PodSecurity ``baseline`` (issue 17,
item 1), on the real kube-apiserver.

The operator process serves its admission webhook (``--webhook-address``, as the chart runs
it) on 127.0.0.1 with a certificate made here; the chart's MutatingWebhookConfiguration is
registered with that address as its ``url`` (no Service routing without a cluster network),
everything else as rendered. In a namespace enforcing ``baseline``:

* a pod of a PyTorchJob a PerseusJob selects is admitted, with the agent's address and its
  identity injected and nothing else changed;
* today's way (a hostPath volume to the agent's socket) is refused by PodSecurity;
* a real agent process (Kubernetes mode, emulated GPUs, ``--tcp-address`` on 127.0.0.1) is
  reached by a ``perseus_client`` in this process from the injected environment, expanded as
  the kubelet would (``status.hostIP`` and the pod IP are 127.0.0.1 in the pod status this test
  writes in the kubelet's place: the peer then is 127.0.0.1, which the agent maps to the pod
  through the API server's pod list, the same code as on a node);
* with the operator down, pods are still created (``failurePolicy: Ignore``), as written.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from perseus_client.client import PerseusClient
from support.agent_process import Agent, wait_for
from support.cluster_harness import Cluster
from support.helm_render import render
from support.operator_harness import OperatorProcess, free_port, perseus_job

NAMESPACE = "inject-baseline"
NODE = "inject-node-1"
JOB = "llm"


def _tls(d: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 signed by it, as the chart makes them."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", str(d / "tls.key"), "-out", str(d / "tls.csr"))  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(d / "tls.csr"), "-CA", str(d / "ca.crt"), "-CAkey",
        str(d / "ca.key"), "-CAcreateserial", "-days", "1", "-extfile", str(d / "san.ext"),
        "-out", str(d / "tls.crt"))  # fmt: skip


def _webhook_configuration(port: int, ca: bytes) -> dict[str, Any]:
    config = render().one("MutatingWebhookConfiguration")
    config["metadata"] = {"name": "perseus-pod-injection-e2e"}
    [hook] = config["webhooks"]
    hook["clientConfig"] = {
        "url": f"https://127.0.0.1:{port}/mutate",
        "caBundle": base64.b64encode(ca).decode(),
    }
    return config


def _training_pod(name: str) -> dict[str, Any]:
    """A pod as the training operator creates it for PyTorchJob ``llm``: no Perseus in it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {
                "training.kubeflow.org/job-name": JOB,
                "training.kubeflow.org/replica-type": "worker",
                "training.kubeflow.org/replica-index": "0",
            },
        },
        "spec": {
            "nodeName": NODE,
            "containers": [
                {
                    "name": "pytorch",
                    "image": "trainer:1",
                    "env": [{"name": "RANK", "value": "0"}],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def _hostpath_pod() -> dict[str, Any]:
    """Today's hand edit: the agent's socket directory from the host, and its group."""
    pod = _training_pod("llm-worker-hostpath")
    pod["spec"]["securityContext"] = {"supplementalGroups": [2940]}
    pod["spec"]["volumes"] = [{"name": "perseus", "hostPath": {"path": "/run/perseus"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "perseus", "mountPath": "/run/perseus"}
    ]
    return pod


def _create(cluster: Cluster, pod: Mapping[str, Any]) -> tuple[int, str]:
    done = cluster.plane.kubectl(
        "create", "-o", "json", "-f", "-", stdin=json.dumps(pod), check=False
    )
    return done.returncode, done.stdout + done.stderr


def _kubelet_env(pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: downward API fields from the pod,
    ``$(VAR)`` from earlier entries."""
    fields = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "status.hostIP": pod["status"]["hostIP"],
    }
    env: dict[str, str] = {}
    for entry in container.get("env") or ():
        if "valueFrom" in entry:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                entry.get("value", ""),
            )
    return env


def _webhook_ready(port: int, ca: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/healthz", context=context, timeout=2
        ) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture
def agent(cluster: Cluster, tmp_path: Path) -> Iterator[Agent]:
    cluster.node(NODE, gpus=1)
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="pinj-"))
    process = Agent(
        tmp_path, socket_dir / "run", num_gpus=1, node=NODE, tcp=True,
        kubeconfig=cluster.agent_kubeconfig(NODE),
    )  # fmt: skip
    try:
        process.start()
        yield process
    finally:
        process.kill_if_running()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_a_managed_pod_in_a_baseline_namespace_is_injected_and_reaches_the_agent(
    cluster: Cluster, agent: Agent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    labels = {"pod-security.kubernetes.io/enforce": "baseline"}
    cluster.plane.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": NAMESPACE, "labels": labels},
            }
        ]
    )
    job = perseus_job(JOB, NAMESPACE, "unused", stages=2, dp=1, microbatches=4)
    job["spec"]["workload"] = {"kind": "PyTorchJob", "name": JOB}
    cluster.plane.apply([job])
    _tls(tmp_path)
    port = free_port()
    assert agent.tcp_port is not None
    operator = OperatorProcess(
        cluster.operator_kubeconfig,
        args=[
            f"--webhook-address=127.0.0.1:{port}",
            f"--webhook-cert-dir={tmp_path}",
            f"--agent-tcp-port={agent.tcp_port}",
        ],
    )
    try:
        operator.wait_for("the webhook", lambda: _webhook_ready(port, tmp_path / "ca.crt"))
        cluster.plane.apply([_webhook_configuration(port, (tmp_path / "ca.crt").read_bytes())])
        time.sleep(1.0)  # the API server's webhook informer picks the configuration up

        status, output = _create(cluster, _training_pod("llm-worker-0"))
        assert status == 0, output
        pod = json.loads(output)
        [container] = pod["spec"]["containers"]
        names = [e["name"] for e in container["env"]]
        assert names == ["RANK", "PERSEUS_HOST_IP", "PERSEUS_AGENT_ADDRESS", "POD_NAME",
                         "POD_NAMESPACE"]  # fmt: skip
        env = {e["name"]: e for e in container["env"]}
        assert env["PERSEUS_AGENT_ADDRESS"]["value"] == f"tcp://$(PERSEUS_HOST_IP):{agent.tcp_port}"
        assert env["PERSEUS_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
        assert pod["metadata"]["labels"]["perseus.energy/agent-client"] == "true"
        assert pod["metadata"]["annotations"]["perseus.energy/injected"] == "true"
        # Nothing privileged was added: no host path, no host namespace, no capability.
        assert [v for v in pod["spec"].get("volumes") or () if "hostPath" in v] == []
        assert not pod["spec"].get("hostNetwork") and not pod["spec"].get("hostPID")
        assert "securityContext" not in container

        status, output = _create(cluster, _hostpath_pod())
        assert status != 0, output
        assert 'violates PodSecurity "baseline:latest"' in output and "hostPath volumes" in output

        # The kubelet's part: the pod runs on the node, at an address (127.0.0.1 here).
        status_patch = {
            "status": {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
            }
        }
        cluster.core.patch_namespaced_pod_status("llm-worker-0", NAMESPACE, status_patch)
        pod["status"] = status_patch["status"]
        env_values = _kubelet_env(pod, container)
        assert env_values["PERSEUS_AGENT_ADDRESS"] == f"tcp://127.0.0.1:{agent.tcp_port}"
        for name, value in env_values.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("PERSEUS_AGENT_SOCKET", raising=False)
        client = PerseusClient(local_rank=0, gpu_uuids=[], retry_interval_s=0.0)
        try:
            client.on_step_begin(1)
            assert client.connected, agent.log[-3000:]
            client.on_step_end(1)
            assert client.connected
        finally:
            client.close()
        wait_for(
            lambda: "rank 0 (pid" in agent.log and "called in" in agent.log,
            "the agent to see the hello",
            agent,
        )

        # A process of that pod speaking for another pod is refused.
        impostor = PerseusClient(
            pod="llm-worker-9", local_rank=0, gpu_uuids=[], retry_interval_s=0.0
        )
        try:
            impostor.on_step_begin(1)
            assert not impostor.connected
        finally:
            impostor.close()
        assert "this connection comes from pod" in agent.log or "hello says pod" in agent.log
    finally:
        out = operator.stop()
    assert "injecting the agent's address into pod inject-baseline/llm-worker-0" in out, out[-5000:]

    # The operator is down: pods are created as written (failurePolicy Ignore).
    status, output = _create(cluster, _training_pod("llm-worker-1"))
    assert status == 0, output
    created = json.loads(output)
    assert [e["name"] for e in created["spec"]["containers"][0]["env"]] == ["RANK"]
    cluster.plane.kubectl("delete", "mutatingwebhookconfiguration", "perseus-pod-injection-e2e")
