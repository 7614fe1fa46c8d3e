"""The pod injection webhook's patch (pure) and its HTTPS server: managed workloads' pods get
the agent's TCP address and their identity, nothing privileged, once; other pods nothing."""

from __future__ import annotations

import base64
import copy
import functools
import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from perseus_agent.serving import tcp_server
from perseus_client import transport
from perseus_operator.webhook.injection import (
    ADDRESS_ENV,
    CLIENT_LABEL,
    INJECTED_ANNOTATION,
    InjectionConfig,
    admission_response,
    build_patch,
    selecting_job,
    target_containers,
)
from perseus_operator.webhook.injection_server import InjectionServer

CONFIG = InjectionConfig(agent_port=7460)


def _job(name: str, workload: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team-a"}, "spec": {"workload": workload}}


JOBS = [
    _job("llm", {"kind": "PyTorchJob", "name": "llm"}),
    _job("sets", {"kind": "JobSet", "name": "big"}),
    _job("bare", {"kind": "Pods", "podSelector": {"matchLabels": {"app": "trainer"}}}),
]


def _pod(labels: dict[str, str], containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "llm-worker-", "namespace": "team-a", "labels": labels},
        "spec": {
            "containers": containers
            if containers is not None
            else [
                {
                    "name": "pytorch",
                    "image": "train:1",
                    "env": [{"name": "RANK", "value": "0"}],
                    "resources": {"limits": {"nvidia.com/gpu": "8"}},
                }
            ]
        },
    }


def _applied(pod: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    return jsonpatch.apply_patch(copy.deepcopy(pod), ops)  # type: ignore[no-any-return]


def _env(container: Mapping[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or ()}


def test_a_pytorchjob_pod_gets_the_agent_address_and_its_identity() -> None:
    pod = _pod(
        {"training.kubeflow.org/job-name": "llm", "training.kubeflow.org/replica-type": "worker"}
    )
    job, ops = build_patch(pod, JOBS, CONFIG)
    assert job == "llm"
    out = _applied(pod, ops)
    env = _env(out["spec"]["containers"][0])
    assert env["RANK"] == "0"  # the author's entries stay, first
    assert env["PERSEUS_HOST_IP"] == {
        "fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}
    }
    assert env[ADDRESS_ENV] == "tcp://$(PERSEUS_HOST_IP):7460"
    assert env["POD_NAME"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert "PERSEUS_JOB" not in env  # the patch names no PerseusJob (issue 30, case 5)
    names = [e["name"] for e in out["spec"]["containers"][0]["env"]]
    assert names.index("PERSEUS_HOST_IP") < names.index(ADDRESS_ENV)  # $(VAR) order
    assert out["metadata"]["labels"][CLIENT_LABEL] == "true"
    assert out["metadata"]["annotations"] == {INJECTED_ANNOTATION: "true"}
    # Nothing else changes: no volume, security context, host namespace or capability.
    assert {op["op"] for op in ops} == {"add"}
    assert all(
        op["path"].startswith(
            ("/spec/containers/0/env", "/metadata/labels", "/metadata/annotations")
        )
        for op in ops
    )
    stripped = copy.deepcopy(out)
    stripped["spec"]["containers"][0]["env"] = pod["spec"]["containers"][0]["env"]
    stripped["metadata"] = pod["metadata"]
    assert stripped == pod


def test_the_injected_address_is_what_the_client_and_agent_read() -> None:
    assert ADDRESS_ENV == transport.ADDRESS_ENV
    assert CLIENT_LABEL == tcp_server.CLIENT_LABEL
    expanded = "tcp://$(PERSEUS_HOST_IP):7460".replace("$(PERSEUS_HOST_IP)", "10.0.0.5")
    assert transport.parse_address(expanded) == transport.AgentAddress("10.0.0.5", 7460)


def test_the_patch_is_idempotent() -> None:
    pod = _pod({"training.kubeflow.org/job-name": "llm"})
    _, ops = build_patch(pod, JOBS, CONFIG)
    once = _applied(pod, ops)
    assert build_patch(once, JOBS, CONFIG) == ("llm", [])


def test_the_authors_own_variables_win() -> None:
    pod = _pod({"app": "trainer"})
    pod["spec"]["containers"][0]["env"] = [
        {"name": ADDRESS_ENV, "value": "unix:///run/perseus/agent.sock"},
        {"name": "POD_NAME", "value": "fixed"},
    ]
    job, ops = build_patch(pod, JOBS, CONFIG)
    env = _env(_applied(pod, ops)["spec"]["containers"][0])
    assert job == "bare"
    assert env[ADDRESS_ENV] == "unix:///run/perseus/agent.sock" and env["POD_NAME"] == "fixed"


@pytest.mark.parametrize(
    "labels",
    [
        {},
        {"training.kubeflow.org/job-name": "other"},
        {"jobset.sigs.k8s.io/jobset-name": "llm"},  # a JobSet named like the PyTorchJob
        {"app": "web"},
    ],
)
def test_pods_of_no_perseusjob_are_untouched(labels: dict[str, str]) -> None:
    assert build_patch(_pod(labels), JOBS, CONFIG) == (None, [])


def test_an_empty_pod_selector_selects_nothing() -> None:
    jobs = [_job("all", {"kind": "Pods", "podSelector": {}})]
    assert selecting_job(_pod({"app": "x"}), jobs) is None


def test_opted_out_and_host_network_pods_are_left_alone() -> None:
    pod = _pod({"training.kubeflow.org/job-name": "llm"})
    pod["metadata"]["annotations"] = {"perseus.energy/inject": "false"}
    assert build_patch(pod, JOBS, CONFIG) == ("llm", [])
    pod = _pod({"training.kubeflow.org/job-name": "llm"})
    pod["spec"]["hostNetwork"] = True
    assert build_patch(pod, JOBS, CONFIG) == ("llm", [])


def test_containers_chosen_are_the_gpu_ones_else_the_training_one() -> None:
    sidecar = {"name": "log", "image": "fluent"}
    gpu = {"name": "worker", "image": "t", "resources": {"requests": {"nvidia.com/gpu": 1}}}
    pytorch = {"name": "pytorch", "image": "t"}
    assert target_containers(_pod({}, [sidecar, gpu, dict(gpu, name="worker2")])) == [1, 2]
    assert target_containers(_pod({}, [sidecar, pytorch])) == [1]
    assert target_containers(_pod({}, [dict(sidecar, name="main"), sidecar])) == [0]
    pod = _pod({"jobset.sigs.k8s.io/jobset-name": "big"}, [sidecar, gpu])
    pod["spec"]["initContainers"] = [{"name": "init", "image": "x"}]
    _, ops = build_patch(pod, JOBS, CONFIG)
    out = _applied(pod, ops)
    assert (
        "env" not in out["spec"]["containers"][0] and "env" not in out["spec"]["initContainers"][0]
    )
    assert _env(out["spec"]["containers"][1])["POD_NAME"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )


def test_the_admission_response_carries_the_patch_only_for_creates() -> None:
    pod = _pod({"training.kubeflow.org/job-name": "llm"})
    review = {
        "request": {"uid": "u-1", "operation": "CREATE", "namespace": "team-a", "object": pod}
    }
    answer = admission_response(review, JOBS, CONFIG)["response"]
    assert (
        answer["uid"] == "u-1" and answer["allowed"] is True and answer["patchType"] == "JSONPatch"
    )
    assert json.loads(base64.b64decode(answer["patch"])) == build_patch(pod, JOBS, CONFIG)[1]
    review["request"]["operation"] = "UPDATE"
    assert admission_response(review, JOBS, CONFIG)["response"] == {"uid": "u-1", "allowed": True}


# -- the HTTPS server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt")],
        check=True, capture_output=True,
    )  # fmt: skip
    return d


@pytest.fixture
def server(tls: Path) -> Iterator[tuple[InjectionServer, list[str]]]:
    asked: list[str] = []

    def list_jobs(namespace: str) -> list[dict[str, Any]]:
        asked.append(namespace)
        if namespace == "broken":
            raise OSError("API server unavailable")
        return JOBS

    srv = InjectionServer("127.0.0.1", 0, tls / "tls.crt", tls / "tls.key", list_jobs, CONFIG)
    srv.start()
    try:
        yield srv, asked
    finally:
        srv.stop()


def _post(srv: InjectionServer, tls: Path, review: dict[str, Any]) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(tls / "tls.crt"))
    request = urllib.request.Request(
        f"https://127.0.0.1:{srv.port}/mutate",
        data=json.dumps(review).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_server_answers_admission_reviews_over_tls(
    server: tuple[InjectionServer, list[str]], tls: Path
) -> None:
    srv, asked = server
    pod = _pod({"training.kubeflow.org/job-name": "llm"})
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-2", "operation": "CREATE", "namespace": "team-a", "object": pod},
    }
    status, body = _post(srv, tls, review)
    assert status == 200
    answer = json.loads(body)
    assert answer["kind"] == "AdmissionReview" and answer["response"]["uid"] == "u-2"
    assert (
        json.loads(base64.b64decode(answer["response"]["patch"]))
        == build_patch(pod, JOBS, CONFIG)[1]
    )
    assert asked == ["team-a"]


def test_the_server_fails_the_call_when_it_cannot_list_the_jobs(
    server: tuple[InjectionServer, list[str]], tls: Path
) -> None:
    srv, _ = server
    review = {
        "request": {"uid": "u-3", "operation": "CREATE", "namespace": "broken", "object": _pod({})}
    }
    status, body = _post(srv, tls, review)
    assert status == 500 and b"cannot list the PerseusJobs" in body  # failurePolicy decides
    assert b"API server unavailable" not in body  # the details are the operator's log's
    status, _ = _post(srv, tls, {"nonsense": True})
    assert status == 400


# -- exposure: what anyone reaching the port gets (issue 30, case 5) ------------------------------


def _bounded_server(tls: Path, **limits: Any) -> InjectionServer:
    jobs = [_job("secret-name", {"kind": "PyTorchJob", "name": "llm"})]
    srv = InjectionServer(
        "127.0.0.1", 0, tls / "tls.crt", tls / "tls.key", lambda ns: jobs, CONFIG, **limits
    )
    srv.start()
    return srv


def _review(namespace: str = "team-a") -> dict[str, Any]:
    pod = _pod({"training.kubeflow.org/job-name": "llm"})
    return {"request": {"uid": "u", "operation": "CREATE", "namespace": namespace, "object": pod}}


def test_the_answer_names_no_perseusjob(tls: Path) -> None:
    """A made-up pod of another namespace is patched (one bit: some job selects it), but the
    answer carries no PerseusJob name, not even base64-encoded."""
    srv = _bounded_server(tls)
    try:
        status, body = _post(srv, tls, _review("someone-elses"))
    finally:
        srv.stop()
    assert status == 200
    patch = base64.b64decode(json.loads(body)["response"]["patch"])
    assert b"secret-name" not in body and b"secret-name" not in patch


def test_connections_beyond_the_bound_are_closed_before_their_handshake(tls: Path) -> None:
    srv = _bounded_server(tls, max_connections=4)
    silent = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
    try:
        wait_until(lambda: srv.open_connections == 4)
        with socket.create_connection(("127.0.0.1", srv.port)) as extra:
            extra.settimeout(5.0)
            assert extra.recv(1) == b""  # closed at accept, no thread and no handshake
        assert srv.open_connections == 4
    finally:
        for sock in silent:
            sock.close()
    try:
        wait_until(lambda: srv.open_connections == 0)
        assert _post(srv, tls, _review())[0] == 200  # slots freed
    finally:
        srv.stop()


def test_a_request_has_a_total_time_however_slowly_it_drips(tls: Path) -> None:
    """Each read used to get a fresh timeout: a byte every few seconds held a thread forever.
    Now the request's whole time counts, from its start."""
    srv = _bounded_server(tls, request_timeout_s=1.0)
    context = ssl.create_default_context(cafile=str(tls / "tls.crt"))
    drips = 0
    try:
        with (
            socket.create_connection(("127.0.0.1", srv.port)) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
        ):
            conn.settimeout(0.3)
            # One byte every 0.3 s, up to 12 s: the old per-read timeout (10 s) never ends it.
            for drips in range(1, 40):
                try:
                    conn.sendall(b"P" if drips == 1 else b"O")
                    if conn.recv(1) == b"":
                        break
                except TimeoutError:
                    continue  # no answer yet: drip on
                except (OSError, ssl.SSLError):
                    break  # reset by the server: closed
            closed = _closed(conn)
    finally:
        srv.stop()
    assert closed and drips < 39


def _closed(conn: ssl.SSLSocket) -> bool:
    conn.settimeout(5.0)
    try:
        return conn.recv(1) == b""
    except (OSError, ssl.SSLError):
        return True


def test_client_certificates_can_be_required(tls: Path, tmp_path: Path) -> None:
    """Where the API server presents a client certificate, nobody else is served."""
    ca = tmp_path / "client-ca"
    ca.mkdir()
    run = functools.partial(subprocess.run, check=True, capture_output=True)
    run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=client-ca",
            "-keyout",
            str(ca / "ca.key"),
            "-out",
            str(ca / "ca.crt"),
        ]
    )
    run(
        [
            "openssl",
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=kube-apiserver",
            "-keyout",
            str(ca / "c.key"),
            "-out",
            str(ca / "c.csr"),
        ]
    )
    run(["openssl", "x509", "-req", "-in", str(ca / "c.csr"), "-CA", str(ca / "ca.crt"),
         "-CAkey", str(ca / "ca.key"), "-CAcreateserial", "-days", "1",
         "-out", str(ca / "c.crt")])  # fmt: skip
    srv = _bounded_server(tls, client_ca_file=ca / "ca.crt")
    try:
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _post(srv, tls, _review())
        context = ssl.create_default_context(cafile=str(tls / "tls.crt"))
        context.load_cert_chain(ca / "c.crt", ca / "c.key")
        request = urllib.request.Request(
            f"https://127.0.0.1:{srv.port}/mutate", data=json.dumps(_review()).encode()
        )
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            assert response.status == 200
    finally:
        srv.stop()


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


def test_the_webhook_listens_on_an_ipv6_address(tls: Path) -> None:
    """An IPv6-only or dual-stack cluster's pod address (``--webhook-address=[::]:8443``):
    the server used to bind IPv4 sockets only."""
    srv = InjectionServer("::1", 0, tls / "tls.crt", tls / "tls.key", lambda ns: JOBS, CONFIG)
    srv.start()
    try:
        context = ssl.create_default_context(cafile=str(tls / "tls.crt"))
        context.check_hostname = False  # the test certificate names 127.0.0.1
        with (
            socket.create_connection(("::1", srv.port)) as raw,
            context.wrap_socket(raw) as conn,
        ):
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        srv.stop()
