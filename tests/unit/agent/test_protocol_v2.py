"""Protocol version 2 (chunks, split backwards) beside version 1: the codec both ways, the
agent's server per connection version, and the client's fallback against an older agent."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.serving.client_dispatch import ClientSession, RequestError
from perseus_agent.serving.local_server import LocalServer
from perseus_client import PerseusClient, protocol
from perseus_client.protocol import (
    HelloRequest,
    InstructionBeginRequest,
    InstructionEndRequest,
    ProtocolError,
    StepBeginRequest,
    StepEndRequest,
    decode_request,
    encode_request,
)

HELLO: dict[str, Any] = {"op": "hello", "gpu_uuids": [], "pid": 1, "rank": 0}

# -- codec -------------------------------------------------------------------------------------


def test_hello_names_version_1_or_2_and_keeps_it() -> None:
    for version in (1, 2):
        msg = decode_request(json.dumps({**HELLO, "version": version}).encode())
        assert msg["op"] == "hello" and msg["version"] == version
    with pytest.raises(ProtocolError, match=r"unsupported protocol version 3: .*versions 1, 2"):
        decode_request(json.dumps({**HELLO, "version": 3}).encode())
    assert protocol.PROTOCOL_VERSION == 2
    assert (
        protocol.hello_request(
            rank=0, local_rank=None, gpu_uuids=[], pid=1, job=None, namespace=None, pod=None
        )["version"]
        == 2
    )


@pytest.mark.parametrize("name", ["forward", "backward", "backward_input", "backward_weight"])
def test_version_2_round_trips_chunk_and_every_name(name: str) -> None:
    begin = protocol.instruction_begin_request(name, 3, 1)
    assert begin == {"op": "instruction_begin", "name": name, "microbatch": 3, "chunk": 1}
    assert decode_request(encode_request(begin)) == begin
    end = protocol.instruction_end_request(name, 1)
    assert decode_request(encode_request(end)) == {
        "op": "instruction_end",
        "name": name,
        "chunk": 1,
    }
    # No chunk: the message is exactly version 1's (one chunk per rank).
    assert "chunk" not in protocol.instruction_begin_request(name, 3)
    assert decode_request(b'{"op":"instruction_begin","name":"forward","chunk":null}') == {
        "op": "instruction_begin",
        "name": "forward",
        "microbatch": None,
    }


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b'{"op":"instruction_begin","name":"forward","microbatch":0,"chunk":1}', "'chunk'"),
        (b'{"op":"instruction_end","name":"forward","chunk":0}', "'chunk'"),
        (b'{"op":"instruction_begin","name":"backward_input"}', "'backward_input'"),
        (b'{"op":"instruction_end","name":"backward_weight"}', "'backward_weight'"),
    ],
)
def test_version_1_refuses_chunks_and_split_names_clearly(line: bytes, error: str) -> None:
    with pytest.raises(ProtocolError, match=rf"{error} needs protocol version 2.*version 1"):
        decode_request(line, 1)
    decode_request(line, 2)  # the same line is valid in version 2


def test_version_1_is_unchanged() -> None:
    line = b'{"op":"instruction_begin","name":"backward","microbatch":2,"t_ns":5}'
    assert decode_request(line, 1) == decode_request(line, 2)
    assert decode_request(line, 1) == {
        "op": "instruction_begin",
        "name": "backward",
        "microbatch": 2,
        "t_ns": 5,
    }
    with pytest.raises(ProtocolError, match="must be one of backward, forward, got"):
        decode_request(b'{"op":"instruction_begin","name":"sideways"}', 1)
    with pytest.raises(ProtocolError, match="must be an integer or null"):
        decode_request(b'{"op":"instruction_begin","name":"forward","chunk":"1"}', 2)


def test_version_1_builders_leave_out_chunk_0_and_refuse_the_rest() -> None:
    assert protocol.instruction_begin_request("forward", 1, 0, version=1) == {
        "op": "instruction_begin",
        "name": "forward",
        "microbatch": 1,
    }
    assert protocol.instruction_end_request("forward", 0, version=1) == {
        "op": "instruction_end",
        "name": "forward",
    }
    with pytest.raises(ProtocolError, match="'chunk' needs protocol version 2"):
        protocol.instruction_begin_request("forward", 1, 1, version=1)
    with pytest.raises(ProtocolError, match="'backward_weight' needs protocol version 2"):
        protocol.instruction_end_request("backward_weight", version=1)


# -- server and client -------------------------------------------------------------------------


class Handler:
    """Records requests; with ``speaks``, refuses other hello versions as an older agent does
    (its error text is that of the version-1 agent, :data:`OLD_AGENT_ERROR`)."""

    def __init__(self, speaks: int | None = None) -> None:
        self.speaks = speaks
        self.lock = threading.Lock()
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _record(self, op: str, msg: Mapping[str, Any]) -> None:
        with self.lock:
            self.calls.append((op, dict(msg)))

    def hello(self, session: ClientSession, msg: HelloRequest, received_ns: int) -> None:
        if self.speaks is not None and msg["version"] != self.speaks:
            raise RequestError(OLD_AGENT_ERROR)
        self._record("hello", msg)

    def step_begin(self, session: ClientSession, msg: StepBeginRequest, t_ns: int) -> None:
        self._record("step_begin", msg)

    def step_end(self, session: ClientSession, msg: StepEndRequest, t_ns: int) -> None:
        self._record("step_end", msg)

    def instruction_begin(
        self, session: ClientSession, msg: InstructionBeginRequest, t_ns: int
    ) -> dict[str, Any]:
        self._record("instruction_begin", msg)
        return {"sm_clock_mhz": 1005}

    def instruction_end(
        self, session: ClientSession, msg: InstructionEndRequest, t_ns: int
    ) -> None:
        self._record("instruction_end", msg)

    def disconnected(self, session: ClientSession) -> None:
        pass

    def requests(self) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return [(op, {k: v for k, v in m.items() if k != "t_ns"}) for op, m in self.calls]


OLD_AGENT_ERROR = "unsupported protocol version 2: this side speaks version 1"
"""What the version-1 agent (perseus_client.protocol before version 2) replied to this hello."""


@pytest.fixture
def sock_path() -> Iterator[Path]:
    directory = tempfile.mkdtemp(prefix="pv2", dir="/tmp")
    yield Path(directory) / "agent.sock"
    shutil.rmtree(directory, ignore_errors=True)


def ask(sock: socket.socket, msg: Mapping[str, Any]) -> dict[str, Any]:
    sock.sendall(json.dumps(msg).encode() + b"\n")
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        buf += chunk
    reply: dict[str, Any] = json.loads(buf)
    return reply


def test_the_server_speaks_each_connections_version(sock_path: Path) -> None:
    handler = Handler()
    with LocalServer(sock_path, handler):
        for version in (1, 2):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(str(sock_path))
                reply = ask(sock, {**HELLO, "version": version})
                assert reply["ok"] and reply["version"] == version
                split = {"op": "instruction_begin", "name": "backward_input", "microbatch": 0}
                chunked = {"op": "instruction_end", "name": "forward", "chunk": 1}
                for msg in (split, chunked):
                    reply = ask(sock, msg)
                    if version == 1:
                        assert not reply["ok"]
                        assert "needs protocol version 2" in reply["error"]
                    else:
                        assert reply["ok"], reply
                # The connection stays usable after a refusal.
                assert ask(sock, {"op": "instruction_begin", "name": "forward"})["ok"]
    got = [(op, m.get("name"), m.get("chunk")) for op, m in handler.requests()]
    assert got == [
        ("hello", None, None),
        ("instruction_begin", "forward", None),  # version 1: the split and chunked refused
        ("hello", None, None),
        ("instruction_begin", "backward_input", None),
        ("instruction_end", "forward", 1),
        ("instruction_begin", "forward", None),
    ]


def make_client(path: Path, **kwargs: Any) -> PerseusClient:
    return PerseusClient(path, connect_timeout_s=2.0, reply_timeout_s=5.0, **kwargs)


def test_a_version_2_client_speaks_version_2_to_a_new_agent(sock_path: Path) -> None:
    handler = Handler()
    with LocalServer(sock_path, handler), make_client(sock_path, needs_protocol_version=2) as c:
        assert c.on_instruction_begin("backward_input", 1, 1) == 1005
        c.on_instruction_end("backward_input", 1)
        assert c.protocol_version == 2
    assert handler.requests()[0][1]["version"] == 2
    assert handler.requests()[1:] == [
        ("instruction_begin", {"op": "instruction_begin", "name": "backward_input",
                               "microbatch": 1, "chunk": 1}),
        ("instruction_end", {"op": "instruction_end", "name": "backward_input", "chunk": 1}),
    ]  # fmt: skip


def test_a_client_that_needs_no_version_2_falls_back_to_an_older_agent(
    sock_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Hello v2 refused, hello v1 on the same connection; hooks only version 1 can say go
    through (chunk 0 left out), the others are not sent, with one warning."""
    handler = Handler(speaks=1)
    caplog.set_level(logging.INFO, logger="perseus_client")
    with LocalServer(sock_path, handler), make_client(sock_path) as c:
        assert c.on_instruction_begin("forward", 0, 0) == 1005
        c.on_instruction_end("forward", 0)
        assert c.protocol_version == 1 and c.connections == 1
        assert c.on_instruction_begin("forward", 0, 1) is None
        c.on_instruction_begin("backward_weight", 0)
        assert c.connected  # a hook it cannot say does not drop the connection
    assert handler.requests() == [
        ("hello", {**handler.requests()[0][1], "version": 1}),
        ("instruction_begin", {"op": "instruction_begin", "name": "forward", "microbatch": 0}),
        ("instruction_end", {"op": "instruction_end", "name": "forward"}),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "speaks protocol version 1 only" in warnings[0]
    assert "'chunk' needs protocol version 2" in warnings[0]


def test_a_client_that_needs_version_2_says_to_upgrade_an_older_agent(
    sock_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handler = Handler(speaks=1)
    with LocalServer(sock_path, handler), make_client(sock_path, needs_protocol_version=2) as c:
        assert c.on_instruction_begin("backward_input", 0) is None
        assert not c.connected and c.connections == 0
    assert handler.requests() == []  # no version-1 hello: its hooks could not be said
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "upgrade the Perseus node agent" in warnings[0], warnings
    assert OLD_AGENT_ERROR in warnings[0]


def test_needs_protocol_version_is_checked() -> None:
    with pytest.raises(ValueError, match="needs_protocol_version must be one of"):
        PerseusClient("/nonexistent", needs_protocol_version=3)
