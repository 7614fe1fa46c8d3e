"""The agent's TCP listener: peers told by their pod address, hellos held to that pod, and the
real client reaching it from ``$PERSEUS_AGENT_ADDRESS``.

The servers bind 127.0.0.1, so the test's pods have the address 127.0.0.1 in the pod lists the
address book reads (as a kubelet would have written their status): the code under test is the
same that maps a pod IP on a node."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from perseus_agent.ownership.node_pods import NodePods
from perseus_agent.serving.client_dispatch import ClientSession, RequestError
from perseus_agent.serving.tcp_server import (
    CLIENT_LABEL,
    TcpServer,
    parse_listen_address,
    pod_addresses,
)
from perseus_client import transport
from perseus_client.client import PerseusClient
from perseus_client.protocol import HelloRequest, StepBeginRequest


def _pod(
    name: str,
    ip: str | None = "127.0.0.1",
    *,
    namespace: str = "team-a",
    labelled: bool = True,
    host_network: bool = False,
    phase: str = "Running",
) -> dict[str, Any]:
    labels = {CLIENT_LABEL: "true"} if labelled else {}
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels},
        "spec": {"nodeName": "gpu-node-1", "hostNetwork": host_network},
        "status": status,
    }


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _book(pods: list[dict[str, Any]], clock: Clock | None = None) -> NodePods:
    book = NodePods("gpu-node-1", clock=clock or Clock())
    book.listed(pods)
    return book


def test_an_address_resolves_to_its_pod() -> None:
    book = _book([_pod("llm-0", "10.1.0.5"), _pod("llm-1", "10.1.0.6")])
    found = book.resolve("10.1.0.6")
    assert (found.namespace, found.name, found.uid) == ("team-a", "llm-1", "uid-llm-1")
    assert book.resolve("::ffff:10.1.0.5").name == "llm-0"  # IPv4-mapped peer of a dual stack
    assert book.pod_of_uid("uid-llm-1") == ("team-a", "llm-1")


def _terminating(pod: dict[str, Any]) -> dict[str, Any]:
    pod["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    return pod


@pytest.mark.parametrize(
    ("pods", "ip", "why"),
    [
        ([_pod("llm-0", "10.1.0.5")], "10.9.9.9", "is not the address of a live pod on node"),
        ([_pod("agent", "10.0.0.1", host_network=True)], "10.0.0.1", "host network"),
        ([_pod("web", "10.1.0.7", labelled=False)], "10.1.0.7", f"not labelled {CLIENT_LABEL}"),
        ([_pod("old", "10.1.0.8", phase="Succeeded")], "10.1.0.8", "is not the address"),
        ([_terminating(_pod("going", "10.1.0.8"))], "10.1.0.8", "is not the address"),
        ([_pod("a", "10.1.0.9"), _pod("b", "10.1.0.9")], "10.1.0.9", "several pods"),
        # The node's own address: host-network pods have it; a host process has no pod at all.
        ([_pod("llm-0", "10.1.0.5")], "10.0.0.1", "is not the address of a live pod"),
    ],
)
def test_peers_that_are_not_a_managed_pod_of_this_node_are_refused(
    pods: list[dict[str, Any]], ip: str, why: str
) -> None:
    with pytest.raises(RequestError, match=why):
        _book(pods).resolve(ip)


def test_a_reused_address_is_the_new_pods_at_once_and_no_longer_the_old_ones() -> None:
    """Issue 30, case 2: the old pod ends, another pod (another namespace, unlabelled) gets
    its IP; the watch's events make the address the new pod's, not the old one's."""
    book = _book([_pod("llm-0", "10.1.0.5")])
    assert book.holds("10.1.0.5", "uid-llm-0")
    book.changed("MODIFIED", _terminating(_pod("llm-0", "10.1.0.5")))
    assert not book.holds("10.1.0.5", "uid-llm-0")
    with pytest.raises(RequestError, match="is not the address of a live pod"):
        book.resolve("10.1.0.5")
    book.changed("ADDED", _pod("web", "10.1.0.5", namespace="serving", labelled=False))
    with pytest.raises(RequestError, match="serving/web is not labelled"):
        book.resolve("10.1.0.5")
    book.changed("DELETED", _pod("llm-0", "10.1.0.5"))
    assert book.pod_of_uid("uid-llm-0") is None and book.pod_of_uid("uid-web") == (
        "serving",
        "web",
    )


def test_before_its_first_listing_and_long_without_the_api_no_peer_is_taken() -> None:
    clock = Clock()
    book = NodePods("gpu-node-1", clock=clock, max_stale_s=60.0)
    with pytest.raises(RequestError, match="has not listed the pods of node gpu-node-1 yet"):
        book.resolve("10.1.0.5")
    book.listed([_pod("llm-0", "10.1.0.5")])
    book.lost("HTTP 503: the API server is overloaded")
    clock.now += 60.0  # pods are not scheduled without the API server: the view stands
    assert book.resolve("10.1.0.5").name == "llm-0"
    clock.now += 1.0
    with pytest.raises(RequestError, match=r"for 61 s \(HTTP 503: the API server is overloaded"):
        book.resolve("10.1.0.5")
    assert book.holds("10.1.0.5", "uid-llm-0")  # verified connections go on
    book.changed("MODIFIED", _pod("llm-0", "10.1.0.5"))  # the watch is back
    assert book.resolve("10.1.0.5").name == "llm-0"


def test_pod_addresses_reads_every_ip_and_none_before_there_is_one() -> None:
    dual = _pod("llm-0", "10.1.0.5")
    dual["status"]["podIPs"].append({"ip": "fd00::5"})
    assert [a.ip for a in pod_addresses(dual)] == ["10.1.0.5", "fd00::5"]
    assert pod_addresses(_pod("pending", None)) == []
    book = _book([dual])
    assert book.resolve("fd00:0:0:0:0:0:0:5").name == "llm-0"  # another spelling of the IPv6


@pytest.mark.parametrize("text", ["7460", "node:7460", "10.0.0.1:", "10.0.0.1:99999", ":7460"])
def test_listen_addresses_are_checked(text: str) -> None:
    with pytest.raises(ValueError, match="HOST"):
        parse_listen_address(text)
    assert parse_listen_address("[::1]:7460") == ("::1", 7460)


class Recorder:
    """The agent's handler, recording what reaches it."""

    def __init__(self) -> None:
        self.hellos: list[tuple[ClientSession, dict[str, Any]]] = []
        self.steps: list[int] = []

    def hello(
        self, session: ClientSession, msg: HelloRequest, received_ns: int
    ) -> Mapping[str, Any]:
        self.hellos.append((session, dict(msg)))
        return {"node": "gpu-node-1", "managed": False, "granularity": None, "gpus": []}

    def step_begin(self, session: ClientSession, msg: StepBeginRequest, received_ns: int) -> None:
        self.steps.append(msg["step"])

    def step_end(self, session: ClientSession, msg: Any, received_ns: int) -> None:
        pass

    def instruction_begin(
        self, session: ClientSession, msg: Any, received_ns: int
    ) -> Mapping[str, Any]:
        return {"sm_clock_mhz": 1410}

    def instruction_end(self, session: ClientSession, msg: Any, received_ns: int) -> None:
        pass

    def disconnected(self, session: ClientSession) -> None:
        pass


@pytest.fixture
def served() -> Iterator[tuple[TcpServer, Recorder, NodePods]]:
    book = _book([_pod("llm-worker-0", "127.0.0.1")])
    recorder = Recorder()
    server = TcpServer(
        "127.0.0.1",
        0,
        recorder,  # type: ignore[arg-type]
        book.resolve,
        book.holds,
    )
    server.start()
    try:
        yield server, recorder, book
    finally:
        server.stop()


def _client(server: TcpServer, **kwargs: Any) -> PerseusClient:
    env = {transport.ADDRESS_ENV: f"tcp://127.0.0.1:{server.port}"}
    address = transport.address_from_env(env)
    return PerseusClient(
        str(address), rank=0, local_rank=0, gpu_uuids=[], retry_interval_s=0.0, **kwargs
    )


def test_a_client_reaches_the_agent_over_tcp_as_the_pod_of_its_address(
    served: tuple[TcpServer, Recorder, NodePods],
) -> None:
    server, recorder, _ = served
    client = _client(server)
    try:
        client.on_step_begin(3)
        assert client.connected
        assert client.on_instruction_begin("forward", 0) == 1410
    finally:
        client.close()
    ((session, hello),) = recorder.hellos
    # The hello named no pod: the agent filled in the address's, and the ownership check
    # gets the pod UID from the address as it gets it from the cgroup on the Unix socket.
    assert (hello["namespace"], hello["pod"]) == ("team-a", "llm-worker-0")
    assert session.verified_pod == ("team-a", "llm-worker-0", "uid-llm-worker-0")
    assert session.address == "127.0.0.1" and session.peer == ("address", "127.0.0.1")
    assert recorder.steps == [3]


def test_a_hello_speaking_for_another_pod_is_refused(
    served: tuple[TcpServer, Recorder, NodePods],
) -> None:
    server, recorder, _ = served
    client = _client(server, pod="someone-else", namespace="team-a")
    try:
        client.on_step_begin(1)
        assert not client.connected
    finally:
        client.close()
    assert recorder.hellos == []


def test_a_connection_from_an_unmanaged_pod_is_refused_before_hello(
    served: tuple[TcpServer, Recorder, NodePods],
) -> None:
    server, recorder, book = served
    book.listed([_pod("web", "127.0.0.1", labelled=False)])
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        reply = sock.makefile("rb").readline()
    assert b'"ok": false' in reply.replace(b'"ok":false', b'"ok": false')
    assert CLIENT_LABEL.encode() in reply
    assert recorder.hellos == []


def test_a_connection_whose_address_changes_hands_speaks_for_nobody(
    served: tuple[TcpServer, Recorder, NodePods],
) -> None:
    """Issue 30, case 2: the connection was taken for pod llm-worker-0; once its address is
    another pod's (the old one ended before the connection did), its requests are refused,
    and a new connection from that address is the new pod's."""
    server, recorder, book = served
    client = _client(server)
    try:
        client.on_step_begin(1)
        assert client.connected and recorder.steps == [1]
        book.changed("DELETED", _pod("llm-worker-0", "127.0.0.1"))
        book.changed("ADDED", _pod("infer", "127.0.0.1", namespace="serving"))
        client.on_step_begin(2)
        assert recorder.steps == [1]  # never reached the handler
        assert client.on_instruction_begin("forward", 0) is None
    finally:
        client.close()
    fresh = _client(server)
    try:
        fresh.on_step_begin(3)
        assert fresh.connected
    finally:
        fresh.close()
    assert [h["namespace"] for _, h in recorder.hellos] == ["team-a", "serving"]
    assert recorder.steps == [1, 3]
