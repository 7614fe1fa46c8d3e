"""Which pod a TCP connection comes from, told by the node's pods as a watch keeps them: no API
call on a connection's path (issue 30, case 4), strangers cost none, a slow API server holds
nobody up, and oversized lines over TCP cost one connection only.

The API is a stand-in with the ``CoreV1Api`` method the watch calls: the listing answers at
once, the watch then hangs (an API server slow to send anything) until the test ends."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from perseus_agent.kube.pod_watch import NodePodWatch
from perseus_agent.ownership.node_pods import NodePods
from perseus_agent.serving.client_dispatch import ClientSession
from perseus_agent.serving.tcp_server import CLIENT_LABEL, TcpServer
from perseus_client.client import PerseusClient
from perseus_client.protocol import MAX_MESSAGE_BYTES, encode_request, hello_request
from support.fake_client_handler import Handler

NODE = "gpu-node-1"


def _pod(name: str, ip: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": f"uid-{name}",
            "labels": {CLIENT_LABEL: "true"},
        },
        "spec": {"nodeName": NODE},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    }


class _Response:
    def __init__(self, data: bytes = b"", hang: threading.Event | None = None) -> None:
        self.data = data
        self._hang = hang

    def stream(self, amt: Any = None, decode_content: bool = True) -> Iterator[bytes]:
        assert self._hang is not None
        self._hang.wait()  # a slow API server: nothing comes
        return iter(())

    def close(self) -> None:
        pass


class SlowApi:
    """Lists at once; every watch hangs until :attr:`released`."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.lists = 0
        self.watches = 0
        self.watching = threading.Event()
        self.released = threading.Event()

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> _Response:
        assert kwargs["field_selector"] == f"spec.nodeName={NODE}"
        if kwargs.get("watch"):
            self.watches += 1
            self.watching.set()
            return _Response(hang=self.released)
        self.lists += 1
        body = {"metadata": {"resourceVersion": "7"}, "items": self.pods}
        return _Response(json.dumps(body).encode())


class Recording(Handler):
    """Also keeps each hello's session (the pod its address was told to be)."""

    def __init__(self) -> None:
        super().__init__()
        self.hellos: list[tuple[ClientSession, dict[str, Any]]] = []

    def hello(self, session: ClientSession, msg: Any, received_ns: int) -> Any:
        self.hellos.append((session, dict(msg)))
        return super().hello(session, msg, received_ns)


@pytest.fixture
def served() -> Iterator[tuple[TcpServer, SlowApi, Recording, NodePods]]:
    api = SlowApi([_pod("llm-0", "127.0.0.1")])
    book = NodePods(NODE)
    watch = NodePodWatch(api, NODE, book.listed, book.changed, book.lost)
    watch.start()
    handler = Recording()
    server = TcpServer("127.0.0.1", 0, handler, book.resolve, book.holds)
    try:
        assert api.watching.wait(10.0)
        server.start()
        yield server, api, handler, book
    finally:
        server.stop()
        api.released.set()
        watch.stop()


HELLO = encode_request(
    hello_request(rank=0, local_rank=0, gpu_uuids=[], pid=1, job=None, namespace=None, pod=None)
)


def _stranger(port: int) -> bytes:
    """Connect from 127.0.0.2 (no pod of the node has it), say hello, read the refusal."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        sock.settimeout(10.0)
        sock.connect(("127.0.0.1", port))
        sock.sendall(HELLO)
        return sock.makefile("rb").readline()


def test_a_flood_of_strangers_costs_no_api_call_and_holds_no_pod_up(
    served: tuple[TcpServer, SlowApi, Recording, NodePods],
) -> None:
    server, api, handler, _ = served
    for _ in range(50):  # each hello waits HELLO_RESOLVE_WAIT_S for its address, in vain
        assert b"127.0.0.2 is not the address of a live pod" in _stranger(server.port)
    # The pod's process connects while the API server sends nothing: told from memory.
    client = PerseusClient(f"tcp://127.0.0.1:{server.port}", rank=0, local_rank=0, gpu_uuids=[])
    try:
        client.on_step_begin(1)
        assert client.connected
    finally:
        client.close()
    assert [s.verified_pod for s, _ in handler.hellos] == [("ml", "llm-0", "uid-llm-0")]
    assert (api.lists, api.watches) == (1, 1)  # one LIST in all, not one per connection


def test_an_oversized_line_over_tcp_closes_that_connection_only(
    served: tuple[TcpServer, SlowApi, Recording, NodePods],
) -> None:
    server, _, handler, _ = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=10.0) as sock:
        sock.sendall(b"x" * (MAX_MESSAGE_BYTES + 10))
        reply = sock.makefile("rb").readline()
        assert f"message exceeds {MAX_MESSAGE_BYTES} bytes".encode() in reply
        assert sock.recv(1) == b""  # closed
    client = PerseusClient(f"tcp://127.0.0.1:{server.port}", rank=0, local_rank=0, gpu_uuids=[])
    try:
        client.on_step_begin(1)
        assert client.connected
    finally:
        client.close()
    assert len(handler.hellos) == 1


def test_the_watch_keeps_the_view_current_and_says_when_it_loses_the_api() -> None:
    events: list[tuple[str, Any]] = []

    class Failing:
        def list_pod_for_all_namespaces(self, **kwargs: Any) -> Mapping[str, Any]:
            raise OSError("connection refused")

    watch = NodePodWatch(
        Failing(),
        NODE,
        lambda pods: events.append(("listed", pods)),
        lambda kind, pod: events.append((kind, pod)),
        lambda why: events.append(("lost", why)),
        min_backoff_s=0.01,
        max_backoff_s=0.02,
    )
    watch.start()
    try:
        deadline = threading.Event()
        for _ in range(500):
            if events:
                break
            deadline.wait(0.01)
    finally:
        watch.stop()
    assert events and events[0][0] == "lost" and "connection refused" in events[0][1]


def test_a_pod_whose_address_arrives_after_its_connection_is_told_at_its_hello(
    served: tuple[TcpServer, SlowApi, Recording, NodePods],
) -> None:
    """The accept loop does not wait for an unknown address: the connection waits, without a
    thread, and its hello asks again (a pod that started a moment before its status came)."""
    server, _, handler, book = served
    with socket.socket() as sock:
        sock.bind(("127.0.0.3", 0))
        sock.settimeout(10.0)
        sock.connect(("127.0.0.1", server.port))
        for _ in range(1000):
            if server.sessions():
                break
            threading.Event().wait(0.01)
        [pending] = server.sessions()
        assert pending.verified_pod is None and pending.address == "127.0.0.3"
        book.changed("ADDED", _pod("llm-1", "127.0.0.3"))
        sock.sendall(HELLO)
        reply = json.loads(sock.makefile("rb").readline())
    assert reply["ok"] is True, reply
    assert [s.verified_pod for s, _ in handler.hellos] == [("ml", "llm-1", "uid-llm-1")]


def test_an_unknown_address_is_waited_for_a_moment() -> None:
    book = NodePods(NODE)
    book.listed([])
    timer = threading.Timer(0.01, book.changed, ("ADDED", _pod("llm-0", "10.1.0.5")))
    timer.start()
    try:
        assert book.resolve("10.1.0.5", 10.0).name == "llm-0"  # returned once it came
    finally:
        timer.cancel()
