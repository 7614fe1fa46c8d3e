"""The agent's Unix-socket server: protocol handling, robustness, socket file and permissions,
threads (one per connection, all of them ended by stop())."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.serving.client_dispatch import (
    MAX_EVENT_AGE_NS,
    ClientSession,
    RequestError,
    event_time_ns,
)
from perseus_agent.serving.local_server import LocalServer
from perseus_agent.serving.socket_file import LocalServerError
from perseus_client.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    StepBeginRequest,
    validate_request,
)
from support.fake_client_handler import Handler
from support.raw_protocol_client import HELLO, Raw


def _server_threads() -> set[threading.Thread]:
    return {
        t for t in threading.enumerate() if t.name.startswith(("perseus-local", "perseus-client"))
    }


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """Every test must leave no server thread behind (each one stops its servers)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while _server_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _server_threads() - before


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Short: pytest's tmp_path can exceed the 108-byte AF_UNIX limit.
    path = Path(tempfile.mkdtemp(prefix="psv", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def handler() -> Handler:
    return Handler()


@pytest.fixture
def server(sock_dir: Path, handler: Handler) -> Iterator[LocalServer]:
    with LocalServer(sock_dir / "run" / "agent.sock", handler) as srv:
        yield srv


@pytest.fixture
def raw(server: LocalServer) -> Iterator[Raw]:
    client = Raw(server.socket_path)
    yield client
    client.close()


def test_all_ops_round_trip(server: LocalServer, handler: Handler, raw: Raw) -> None:
    before = time.monotonic_ns()
    hello = raw.ask(HELLO)
    assert hello["ok"] is True
    assert hello["version"] == PROTOCOL_VERSION
    assert isinstance(hello["connection_id"], int)
    assert raw.ask({"op": "step_begin", "step": 3}) == {"ok": True}
    fwd = raw.ask({"op": "instruction_begin", "name": "forward", "microbatch": 0})
    assert fwd == {"ok": True, "sm_clock_mhz": 1410}
    assert raw.ask({"op": "instruction_end", "name": "forward"}) == {"ok": True}
    bwd = raw.ask({"op": "instruction_begin", "name": "backward", "microbatch": None})
    assert bwd["sm_clock_mhz"] == 1200
    assert raw.ask({"op": "instruction_end", "name": "backward"})["ok"] is True
    assert raw.ask({"op": "step_end", "step": 3})["ok"] is True
    after = time.monotonic_ns()

    assert handler.ops() == [
        "hello",
        "step_begin",
        "instruction_begin",
        "instruction_end",
        "instruction_begin",
        "instruction_end",
        "step_end",
    ]
    stamps = [c[3] for c in handler.calls]
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= after
    assert handler.calls[0][2] == HELLO
    assert handler.calls[2][2] == {"op": "instruction_begin", "name": "forward", "microbatch": 0}

    (session,) = server.sessions()
    assert session.peer_pid == os.getpid() and session.peer_uid == os.getuid()
    assert session.rank == 0 and session.gpu_uuids == ["GPU-0000"] and session.pod == "pod-0"

    raw.close()
    assert handler.disconnected_event.wait(5)
    assert handler.disconnects == [session.connection_id]


def test_socket_and_directory_permissions(sock_dir: Path, handler: Handler) -> None:
    path = sock_dir / "new" / "agent.sock"
    with LocalServer(path, handler, socket_group=os.getgid()):
        st = path.stat()
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
        assert [p.name for p in path.parent.iterdir()] == ["agent.sock"]  # no temp name left
    assert not path.exists()  # removed on stop
    assert path.parent.is_dir()


def test_existing_directory_is_left_alone(sock_dir: Path, handler: Handler) -> None:
    sock_dir.chmod(0o755)
    with LocalServer(sock_dir / "a.sock", handler, socket_mode=0o600):
        assert stat.S_IMODE((sock_dir / "a.sock").stat().st_mode) == 0o600
    assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o755


def test_stale_socket_is_replaced(sock_dir: Path, handler: Handler) -> None:
    path = sock_dir / "agent.sock"
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(os.fspath(path))
    crashed.close()  # the file stays, nobody listens: a crashed agent
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    with LocalServer(path, handler):
        client = Raw(path)
        assert client.ask(HELLO)["ok"] is True
        client.close()


def test_live_socket_is_not_stolen(server: LocalServer, handler: Handler) -> None:
    with pytest.raises(LocalServerError, match="already serving"):
        LocalServer(server.socket_path, handler).start()
    client = Raw(server.socket_path)  # the first server still serves
    assert client.ask(HELLO)["ok"] is True
    client.close()


def test_non_socket_file_is_refused(sock_dir: Path, handler: Handler) -> None:
    path = sock_dir / "agent.sock"
    path.write_text("precious")
    with pytest.raises(LocalServerError, match="not a socket"):
        LocalServer(path, handler).start()
    assert path.read_text() == "precious"
    assert sorted(p.name for p in sock_dir.iterdir()) == ["agent.sock"]


def test_directory_path_is_a_file(sock_dir: Path, handler: Handler) -> None:
    (sock_dir / "d").write_text("")
    with pytest.raises(LocalServerError, match="not a directory"):
        LocalServer(sock_dir / "d" / "agent.sock", handler).start()


def test_path_too_long(handler: Handler) -> None:
    with pytest.raises(ValueError, match="AF_UNIX"):
        LocalServer(Path("/tmp/" + "x" * 120), handler)


def test_bad_socket_mode(sock_dir: Path, handler: Handler) -> None:
    with pytest.raises(ValueError, match="0o777"):
        LocalServer(sock_dir / "a.sock", handler, socket_mode=0o4660)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"{not json\n", "invalid JSON"),
        (b"\xff\xfe\n", "invalid JSON"),
        (b"[1, 2]\n", "JSON object"),
        (b"{}\n", "'op'"),
        (b'{"op": "reboot"}\n', "unknown op"),
        (b'{"op": "step_begin"}\n', "missing field 'step'"),
        (b'{"op": "step_begin", "step": "7"}\n', "must be an integer"),
        (b'{"op": "step_begin", "step": true}\n', "must be an integer"),
        (b'{"op": "step_begin", "step": -1}\n', "out of range"),
        (b'{"op": "instruction_begin", "name": "sideways"}\n', "must be one of"),
        (b'{"op": "hello", "version": 3}\n', "unsupported protocol version 3"),
        (b'{"op": "hello", "version": true}\n', "unsupported protocol version"),
        (b'{"op": "hello", "version": 1, "gpu_uuids": [0], "pid": 1}\n', "gpu_uuids"),
    ],
)
def test_malformed_requests_get_error_replies(
    server: LocalServer, handler: Handler, raw: Raw, line: bytes, error: str
) -> None:
    reply = raw.ask(line)
    assert reply["ok"] is False
    assert error in reply["error"]
    # The connection stays usable.
    assert raw.ask(HELLO)["ok"] is True
    assert raw.ask({"op": "instruction_begin", "name": "forward"})["sm_clock_mhz"] == 1410
    assert handler.ops() == ["hello", "instruction_begin"]


def test_hello_must_come_first_and_once(raw: Raw, handler: Handler) -> None:
    reply = raw.ask({"op": "step_begin", "step": 0})
    assert reply["ok"] is False and "hello" in reply["error"]
    assert raw.ask(HELLO)["ok"] is True
    reply = raw.ask(HELLO)
    assert reply["ok"] is False and "already" in reply["error"]
    assert handler.ops() == ["hello"]


def test_unknown_fields_are_dropped(raw: Raw, handler: Handler) -> None:
    assert raw.ask({**HELLO, "extra": [1, 2]})["ok"] is True
    assert "extra" not in handler.calls[0][2]


@pytest.mark.parametrize("newline", [True, False])
def test_oversized_line_closes_only_that_connection(
    server: LocalServer, handler: Handler, raw: Raw, newline: bool
) -> None:
    other = Raw(server.socket_path)
    assert other.ask(HELLO)["ok"] is True
    assert raw.ask(HELLO)["ok"] is True

    raw.send(b'{"op": "hello", "pad": "' + b"x" * MAX_MESSAGE_BYTES + (b'"}\n' if newline else b""))
    reply = raw.reply()
    assert reply["ok"] is False and "exceeds" in reply["error"]
    assert raw.at_eof()

    assert other.ask({"op": "step_begin", "step": 1})["ok"] is True
    third = Raw(server.socket_path)
    assert third.ask(HELLO)["ok"] is True
    other.close()
    third.close()


def test_largest_allowed_line_is_accepted(raw: Raw) -> None:
    base = json.dumps({**HELLO, "pad": ""}, separators=(",", ":")).encode()
    pad = b"x" * (MAX_MESSAGE_BYTES - len(base) - 1)
    line = base.replace(b'"pad":""', b'"pad":"' + pad + b'"') + b"\n"
    assert len(line) == MAX_MESSAGE_BYTES
    assert raw.ask(line)["ok"] is True


def test_handler_exception_becomes_error_reply(
    server: LocalServer, handler: Handler, raw: Raw, caplog: pytest.LogCaptureFixture
) -> None:
    handler.fail["instruction_begin"] = RuntimeError("NVML exploded")
    handler.fail["step_begin"] = RequestError("unknown GPU GPU-0000")
    assert raw.ask(HELLO)["ok"] is True
    reply = raw.ask({"op": "instruction_begin", "name": "forward", "microbatch": 0})
    assert reply["ok"] is False and "NVML exploded" in reply["error"]
    assert "RuntimeError" in reply["error"]
    assert any("handler.instruction_begin failed" in r.message for r in caplog.records)
    assert raw.ask({"op": "step_begin", "step": 0}) == {
        "ok": False,
        "error": "unknown GPU GPU-0000",
    }
    # Still serving, on this connection and others.
    assert raw.ask({"op": "step_end", "step": 0})["ok"] is True
    other = Raw(server.socket_path)
    assert other.ask(HELLO)["ok"] is True
    other.close()


def test_failed_hello_is_not_a_session(raw: Raw, handler: Handler, server: LocalServer) -> None:
    handler.fail["hello"] = RequestError("no GPU of this pod on this node")
    reply = raw.ask(HELLO)
    assert reply == {"ok": False, "error": "no GPU of this pod on this node"}
    reply = raw.ask({"op": "step_begin", "step": 0})
    assert reply["ok"] is False and "hello" in reply["error"]
    raw.close()
    deadline = time.monotonic() + 5
    while server.sessions() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.sessions() == []
    assert handler.disconnects == []  # only sessions whose hello succeeded


def test_invalid_handler_reply_becomes_error(raw: Raw, handler: Handler) -> None:
    handler.clock_reply = "fast"
    assert raw.ask(HELLO)["ok"] is True
    reply = raw.ask({"op": "instruction_begin", "name": "forward", "microbatch": 0})
    assert reply["ok"] is False and "invalid reply" in reply["error"]


def test_concurrent_clients(server: LocalServer, handler: Handler) -> None:
    # All 8 handler calls must be in flight at once to pass the barrier.
    handler.barrier = threading.Barrier(8, timeout=10)
    replies: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            client = Raw(server.socket_path)
            assert client.ask({**HELLO, "rank": rank})["ok"] is True
            replies.append(client.ask({"op": "instruction_begin", "name": "backward"}))
            client.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors
    assert replies == [{"ok": True, "sm_clock_mhz": 1200}] * 8
    ranks = sorted(c[2]["rank"] for c in handler.calls if c[0] == "hello")
    assert ranks == list(range(8))
    assert len({c[1] for c in handler.calls}) == 8  # distinct connection ids


def test_max_connections(sock_dir: Path, handler: Handler) -> None:
    with LocalServer(sock_dir / "a.sock", handler, max_connections=1) as srv:
        first = Raw(srv.socket_path)
        assert first.ask(HELLO)["ok"] is True
        second = Raw(srv.socket_path)
        reply = second.reply()
        assert reply["ok"] is False and "too many" in reply["error"]
        assert second.at_eof()
        assert first.ask({"op": "step_begin", "step": 0})["ok"] is True
        first.close()
        second.close()


def test_stop_closes_connections_and_is_idempotent(sock_dir: Path, handler: Handler) -> None:
    srv = LocalServer(sock_dir / "a.sock", handler)
    srv.start()
    assert srv.running
    client = Raw(srv.socket_path)
    assert client.ask(HELLO)["ok"] is True
    srv.stop()
    assert not srv.running
    assert client.at_eof()
    assert handler.disconnects == [1]
    assert not srv.socket_path.exists()
    srv.stop()
    client.close()
    # A stopped server can start again on the same path.
    srv.start()
    again = Raw(srv.socket_path)
    assert again.ask(HELLO)["ok"] is True
    again.close()
    srv.stop()


def test_stop_leaves_a_foreign_socket(sock_dir: Path, handler: Handler) -> None:
    path = sock_dir / "a.sock"
    srv = LocalServer(path, handler)
    srv.start()
    path.unlink()  # someone replaced our socket with theirs
    foreign = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    foreign.bind(os.fspath(path))
    srv.stop()
    assert path.exists()
    foreign.close()


def test_requests_on_one_connection_are_handled_in_order(raw: Raw, handler: Handler) -> None:
    # Pipelined: all lines in one write; each reply still comes in order, one per request.
    lines = [HELLO] + [{"op": "step_begin", "step": i} for i in range(50)]
    raw.send(b"".join(json.dumps(m).encode() + b"\n" for m in lines))
    replies = [raw.reply() for _ in lines]
    assert all(r["ok"] is True for r in replies)
    assert [c[2].get("step") for c in handler.calls[1:]] == list(range(50))
    stamps = [c[3] for c in handler.calls]
    assert stamps == sorted(stamps)


def test_request_split_across_writes(raw: Raw, handler: Handler) -> None:
    data = json.dumps(HELLO).encode() + b"\n" + b'{"op": "step_begin", "step": 4}\n'
    for i in range(0, len(data), 7):
        raw.send(data[i : i + 7])
        time.sleep(0.001)
    assert raw.reply()["ok"] is True
    assert raw.reply() == {"ok": True}
    assert handler.ops() == ["hello", "step_begin"]


def test_much_oversized_input_gets_the_reply_then_eof(server: LocalServer, raw: Raw) -> None:
    # Far more than one read: the reply must still arrive, then a clean EOF (no reset).
    sender = threading.Thread(target=raw.send, args=(b"x" * 100_000,))
    sender.start()
    reply = raw.reply()
    assert reply["ok"] is False and "exceeds" in reply["error"]
    sender.join(5)
    assert raw.at_eof()


def test_each_connection_has_its_own_thread(server: LocalServer, handler: Handler) -> None:
    clients = [Raw(server.socket_path) for _ in range(3)]
    for rank, client in enumerate(clients):
        assert client.ask({**HELLO, "rank": rank})["ok"] is True
    assert len(_server_threads()) == 1 + 3  # the accept loop and one per connection
    clients[0].close()
    deadline = time.monotonic() + 5
    while len(server.sessions()) > 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s.rank for s in server.sessions()] == [1, 2]
    assert len(_server_threads()) == 1 + 2
    for client in clients[1:]:
        client.close()


def test_busy_handler_does_not_block_other_sessions(server: LocalServer, handler: Handler) -> None:
    handler.gate = threading.Event()
    slow, fast = Raw(server.socket_path), Raw(server.socket_path)
    assert slow.ask(HELLO)["ok"] is True
    assert fast.ask({**HELLO, "rank": 1})["ok"] is True
    slow.send(b'{"op": "instruction_begin", "name": "forward"}\n')
    assert handler.entered.wait(5)
    assert fast.ask({"op": "step_begin", "step": 0}) == {"ok": True}  # while slow's call waits
    handler.gate.set()
    assert slow.reply() == {"ok": True, "sm_clock_mhz": 1410}
    slow.close()
    fast.close()


def test_max_connections_frees_slots(sock_dir: Path, handler: Handler) -> None:
    with LocalServer(sock_dir / "a.sock", handler, max_connections=2) as srv:
        first, second = Raw(srv.socket_path), Raw(srv.socket_path)
        assert first.ask(HELLO)["ok"] is True and second.ask(HELLO)["ok"] is True
        first.close()
        deadline = time.monotonic() + 5
        while len(srv.sessions()) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        third = Raw(srv.socket_path)
        assert third.ask(HELLO)["ok"] is True
        second.close()
        third.close()


def test_stop_is_prompt_with_idle_and_half_sent_connections(
    sock_dir: Path, handler: Handler
) -> None:
    before = set(threading.enumerate())
    srv = LocalServer(sock_dir / "a.sock", handler)
    srv.start()
    clients = [Raw(srv.socket_path) for _ in range(5)]
    for rank, client in enumerate(clients):
        assert client.ask({**HELLO, "rank": rank})["ok"] is True
    clients[0].send(b'{"op": "step_begin", ')  # a partial line: its thread waits for the rest
    silent = Raw(srv.socket_path)  # connected, never said hello
    deadline = time.monotonic() + 5
    while len(srv.sessions()) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    srv.stop()
    assert time.monotonic() - started < 1.0
    assert set(threading.enumerate()) - before == set()
    assert sorted(handler.disconnects) == [1, 2, 3, 4, 5]  # once each, not the silent one
    assert srv.sessions() == []
    for client in [*clients, silent]:
        assert client.at_eof()
        client.close()


def test_stop_does_not_wait_forever_for_a_stuck_handler(
    sock_dir: Path, handler: Handler, caplog: pytest.LogCaptureFixture
) -> None:
    handler.gate = threading.Event()
    srv = LocalServer(sock_dir / "a.sock", handler)
    srv.start()
    client = Raw(srv.socket_path)
    assert client.ask(HELLO)["ok"] is True
    client.send(b'{"op": "instruction_begin", "name": "forward"}\n')
    assert handler.entered.wait(5)
    with caplog.at_level(logging.WARNING, logger="perseus_agent.serving.local_server"):
        started = time.monotonic()
        srv.stop(timeout=0.2)
        assert time.monotonic() - started < 1.0
    assert any("still busy in the handler" in r.message for r in caplog.records)
    assert not srv.running and not srv.socket_path.exists()
    handler.gate.set()  # the call returns, its reply cannot be sent, the thread ends
    assert handler.disconnected_event.wait(5)
    assert handler.disconnects == [1]
    assert client.at_eof()
    client.close()


def test_stop_from_a_handler_is_refused(sock_dir: Path) -> None:
    errors: list[BaseException] = []

    class Stopper(Handler):
        def step_begin(
            self, session: ClientSession, msg: StepBeginRequest, received_ns: int
        ) -> None:
            try:
                srv.stop()  # would wait for its own thread
            except RuntimeError as exc:
                errors.append(exc)

    srv = LocalServer(sock_dir / "a.sock", Stopper())
    with srv:
        client = Raw(srv.socket_path)
        assert client.ask(HELLO)["ok"] is True
        assert client.ask({"op": "step_begin", "step": 0}) == {"ok": True}
        assert srv.running
        client.close()
    assert len(errors) == 1 and "own threads" in str(errors[0])


def test_an_event_is_timed_by_the_client_when_its_time_is_plausible() -> None:
    received_ns = 5_000_000_000
    stamped = {"op": "step_begin", "step": 1, "t_ns": received_ns - 400_000}
    assert event_time_ns(stamped, received_ns) == received_ns - 400_000
    # From the future, more than a second old, or absent: the receipt time.
    for t_ns in (received_ns + 1, received_ns - MAX_EVENT_AGE_NS - 1):
        assert event_time_ns({**stamped, "t_ns": t_ns}, received_ns) == received_ns
    assert event_time_ns({"op": "step_begin", "step": 1}, received_ns) == received_ns


def test_an_event_time_must_be_a_non_negative_integer() -> None:
    assert validate_request({"op": "instruction_end", "name": "forward", "t_ns": 7})["t_ns"] == 7
    for bad in (-1, "7", 1.5, True):
        with pytest.raises(ProtocolError, match="t_ns"):
            validate_request({"op": "instruction_end", "name": "forward", "t_ns": bad})
    assert "t_ns" not in validate_request({"op": "step_end", "step": 2, "t_ns": None})
