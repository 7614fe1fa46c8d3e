"""perseus_client: the training-side hooks, against a real LocalServer, and the wire protocol."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import perseus_client
from perseus_agent.serving.client_dispatch import RequestError
from perseus_agent.serving.local_server import LocalServer
from perseus_client import PerseusClient, protocol
from perseus_client import default_client as client_module
from perseus_client.protocol import (
    ProtocolError,
)
from support.fake_client_handler import Handler

IDENTITY_ENV = (
    "RANK",
    "LOCAL_RANK",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "POD_NAME",
    "POD_NAMESPACE",
    "PERSEUS_JOB",
    "PERSEUS_AGENT_SOCKET",
)


def make_client(socket_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> PerseusClient:
    """A client with generous timeouts, so that a loaded test machine cannot make it give up."""
    kwargs.setdefault("connect_timeout_s", 2.0)
    kwargs.setdefault("reply_timeout_s", 5.0)
    return PerseusClient(socket_path, **kwargs)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in IDENTITY_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(client_module, "_default", None)
    yield
    default = client_module._default
    if default is not None:
        default.close()


@pytest.fixture
def sock_path() -> Iterator[Path]:
    # Short: pytest's tmp_path can exceed the 108-byte AF_UNIX limit.
    directory = tempfile.mkdtemp(prefix="pcl", dir="/tmp")
    yield Path(directory) / "agent.sock"
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def handler() -> Handler:
    return Handler()


@pytest.fixture
def server(sock_path: Path, handler: Handler) -> Iterator[LocalServer]:
    with LocalServer(sock_path, handler) as srv:
        yield srv


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="perseus_client")
    return caplog


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "perseus_client" and r.levelno >= logging.WARNING
    ]


# ---------------------------------------------------------------------------
# Against a live agent


def test_all_hooks_round_trip(server: LocalServer, handler: Handler) -> None:
    with make_client(server.socket_path, rank=5, local_rank=1, gpu_uuids=["GPU-x"]) as c:
        with c.step(7):
            with c.instruction("forward", 0) as clock:
                assert clock == 1410
            assert c.on_instruction_begin("backward", 0) == 1200
            c.on_instruction_end("backward")
        c.on_step_begin(8)
        assert c.on_instruction_begin("forward") == 1410
        c.on_instruction_end("forward")
        c.on_step_end(8)
        assert c.connected and c.connections == 1

    assert handler.ops() == [
        "hello",
        "step_begin",
        "instruction_begin",
        "instruction_end",
        "instruction_begin",
        "instruction_end",
        "step_end",
        "step_begin",
        "instruction_begin",
        "instruction_end",
        "step_end",
    ]
    msgs = [c[2] for c in handler.calls]
    assert msgs[0]["rank"] == 5 and msgs[0]["local_rank"] == 1
    assert msgs[0]["gpu_uuids"] == ["GPU-x"] and msgs[0]["pid"] == os.getpid()
    # Every event carries its own time (the node's monotonic clock), in order; the handler
    # is given that time, not the receipt's.
    stamps = [m.pop("t_ns") for m in msgs[1:]]
    assert stamps == sorted(stamps) and "t_ns" not in msgs[0]
    assert [c[3] for c in handler.calls[1:]] == stamps
    assert msgs[1] == {"op": "step_begin", "step": 7}
    assert msgs[2] == {"op": "instruction_begin", "name": "forward", "microbatch": 0}
    assert msgs[3] == {"op": "instruction_end", "name": "forward"}
    assert msgs[8] == {"op": "instruction_begin", "name": "forward", "microbatch": None}
    assert len({c[1] for c in handler.calls}) == 1  # one connection throughout


def test_identity_from_environment(
    server: LocalServer, handler: Handler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERSEUS_AGENT_SOCKET", os.fspath(server.socket_path))
    monkeypatch.setenv("RANK", "12")
    monkeypatch.setenv("LOCAL_RANK", "4")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-1b2c3d4e-aaaa,GPU-5f6a7b8c-bbbb")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("POD_NAME", "llm-worker-3")
    monkeypatch.setenv("POD_NAMESPACE", "team-a")
    monkeypatch.setenv("PERSEUS_JOB", "llm")
    client = make_client()
    assert client.socket_path == os.fspath(server.socket_path)
    client.on_step_begin(0)
    client.close()
    (hello,) = handler.hellos()
    assert hello == {
        "op": "hello",
        "version": protocol.PROTOCOL_VERSION,
        "rank": 12,
        "local_rank": 4,
        "gpu_uuids": ["GPU-1b2c3d4e-aaaa", "GPU-5f6a7b8c-bbbb"],
        "pid": os.getpid(),
        "job": "llm",
        "namespace": "team-a",
        "pod": "llm-worker-3",
    }


@pytest.mark.parametrize(
    ("nvidia", "cuda", "expected"),
    [
        ("GPU-a,GPU-b", None, ["GPU-a", "GPU-b"]),
        ("all", "GPU-c", ["GPU-c"]),
        (None, "MIG-d", ["MIG-d"]),
        ("0,1", "0", []),
        ("GPU-a,1", None, []),
        ("none", None, []),
        (None, None, []),
    ],
)
def test_gpu_uuids_from_env(nvidia: str | None, cuda: str | None, expected: list[str]) -> None:
    env = {}
    if nvidia is not None:
        env["NVIDIA_VISIBLE_DEVICES"] = nvidia
    if cuda is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda
    assert perseus_client.gpu_uuids_from_env(env) == expected


def test_default_identity_without_environment() -> None:
    client = PerseusClient()
    assert client.socket_path == protocol.DEFAULT_SOCKET_PATH
    assert client.rank is None and client.local_rank is None and client.gpu_uuids == []
    assert client.job is None and client.namespace is None and client.pod is None


def test_bad_rank_in_environment_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("LOCAL_RANK", "-1")
    client = PerseusClient()
    assert client.rank is None and client.local_rank is None


def test_many_threads_share_one_client(server: LocalServer, handler: Handler) -> None:
    client = make_client(server.socket_path)
    results: list[int | None] = []
    lock = threading.Lock()

    def run() -> None:
        for mb in range(25):
            clock = client.on_instruction_begin("forward", mb)
            client.on_instruction_end("forward")
            with lock:
                results.append(clock)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    client.close()
    assert results == [1410] * 200
    assert handler.ops().count("hello") == 1


def test_eight_clients_at_once(server: LocalServer, handler: Handler) -> None:
    clocks: dict[int, list[int | None]] = {}
    start = threading.Barrier(8)

    def run(rank: int) -> None:
        with make_client(server.socket_path, rank=rank) as client:
            start.wait(10)
            clocks[rank] = [client.on_instruction_begin("backward", mb) for mb in range(20)]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert clocks == {r: [1200] * 20 for r in range(8)}
    assert sorted(h["rank"] for h in handler.hellos()) == list(range(8))


def test_synchronize_called_only_while_connected(server: LocalServer, sock_path: Path) -> None:
    calls: list[int] = []
    with make_client(server.socket_path, synchronize=lambda: calls.append(1)) as client:
        with client.instruction("forward", 0):
            pass
        client.on_step_begin(0)
    assert len(calls) == 2  # instruction begin and end, not steps
    missing = PerseusClient(sock_path.with_name("nope.sock"), synchronize=lambda: calls.append(1))
    missing.on_instruction_begin("forward")
    assert len(calls) == 2


def test_failing_synchronize_does_not_raise(
    server: LocalServer, logs: pytest.LogCaptureFixture
) -> None:
    def boom() -> None:
        raise RuntimeError("CUDA error")

    with make_client(server.socket_path, synchronize=boom) as client:
        assert client.on_instruction_begin("forward") == 1410
        assert client.on_instruction_begin("forward") == 1410
    assert len(warnings(logs)) == 1


def test_step_end_sent_when_training_raises(server: LocalServer, handler: Handler) -> None:
    client = make_client(server.socket_path)
    with pytest.raises(KeyError), client.step(1), client.instruction("forward", 0):
        raise KeyError("training bug")  # the training's own exception propagates
    client.close()
    assert handler.ops()[-2:] == ["instruction_end", "step_end"]


def test_module_level_hooks(server: LocalServer, handler: Handler) -> None:
    perseus_client.configure(server.socket_path, rank=2, reply_timeout_s=5.0)
    assert perseus_client.get_client() is perseus_client.get_client()
    with perseus_client.step(0), perseus_client.instruction("forward", 0) as clock:
        assert clock == 1410
    perseus_client.on_step_begin(1)
    assert perseus_client.on_instruction_begin("backward", 3) == 1200
    perseus_client.on_instruction_end("backward")
    perseus_client.on_step_end(1)
    old = perseus_client.get_client()
    perseus_client.configure(server.socket_path, rank=3)  # replaces and closes the old one
    assert not old.connected
    assert handler.ops().count("step_begin") == 2
    assert handler.hellos()[0]["rank"] == 2


def test_get_client_defaults_from_env(
    server: LocalServer, handler: Handler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERSEUS_AGENT_SOCKET", os.fspath(server.socket_path))
    monkeypatch.setenv("RANK", "1")
    assert perseus_client.on_instruction_begin("forward", 0) == 1410
    assert handler.hellos()[0]["rank"] == 1


# ---------------------------------------------------------------------------
# Without a (working) agent: no-op, one warning, no exception


def test_no_agent_is_a_quiet_no_op(sock_path: Path, logs: pytest.LogCaptureFixture) -> None:
    client = PerseusClient(sock_path, retry_interval_s=0.05)
    begin = time.perf_counter()
    for i in range(300):
        with client.step(i):
            assert client.on_instruction_begin("forward", i) is None
            client.on_instruction_end("forward")
    assert time.perf_counter() - begin < 1.0
    time.sleep(0.06)
    assert client.on_instruction_begin("forward", 0) is None  # a retry, failing quietly
    (warning,) = warnings(logs)
    assert os.fspath(sock_path) in warning and "no-ops" in warning
    assert any("still unavailable" in r.getMessage() for r in logs.records)
    assert not client.connected


def test_socket_file_without_listener(sock_path: Path, logs: pytest.LogCaptureFixture) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.fspath(sock_path))
    dead.close()
    client = PerseusClient(sock_path)
    assert client.on_instruction_begin("forward") is None
    client.on_step_end(0)
    assert len(warnings(logs)) == 1


def test_hung_agent_times_out(sock_path: Path, logs: pytest.LogCaptureFixture) -> None:
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(os.fspath(sock_path))
    hung.listen(8)  # accepts into the backlog, never answers
    try:
        client = PerseusClient(sock_path, reply_timeout_s=0.05)
        begin = time.perf_counter()
        assert client.on_instruction_begin("forward") is None
        assert time.perf_counter() - begin < 1.0
        for _ in range(50):
            assert client.on_instruction_begin("forward") is None
        assert time.perf_counter() - begin < 1.0
        (warning,) = warnings(logs)
        assert "hello failed" in warning
    finally:
        hung.close()


def test_garbage_reply(sock_path: Path, logs: pytest.LogCaptureFixture) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(sock_path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 400 Bad Request\n")
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        client = make_client(sock_path)
        assert client.on_instruction_begin("forward") is None
        client.on_step_begin(0)
        (warning,) = warnings(logs)
        assert "invalid JSON" in warning
    finally:
        thread.join(5)
        listener.close()


def test_agent_rejects_hello(
    server: LocalServer, handler: Handler, logs: pytest.LogCaptureFixture
) -> None:
    handler.fail["hello"] = RequestError("no GPU of pod x on this node")
    client = make_client(server.socket_path)
    assert client.on_instruction_begin("forward") is None
    assert client.on_instruction_begin("forward") is None
    (warning,) = warnings(logs)
    assert "no GPU of pod x on this node" in warning
    assert handler.ops() == ["hello"]  # no retry before the interval
    client.close()


def test_refused_hook_keeps_connection(
    server: LocalServer, handler: Handler, logs: pytest.LogCaptureFixture
) -> None:
    handler.fail["step_begin"] = RequestError("no plan yet")
    with make_client(server.socket_path) as client:
        client.on_step_begin(0)
        client.on_step_begin(1)
        assert client.on_instruction_begin("forward") == 1410
        assert client.connected
    (warning,) = warnings(logs)
    assert "no plan yet" in warning


def test_invalid_arguments_do_not_raise(
    server: LocalServer, handler: Handler, logs: pytest.LogCaptureFixture
) -> None:
    with make_client(server.socket_path) as client:
        assert client.on_instruction_begin("sideways") is None
        client.on_step_begin(-1)
        client.on_step_end("seven")  # type: ignore[arg-type]
        assert client.on_instruction_begin("forward", 0) == 1410
    assert len(warnings(logs)) == 1
    assert "step_begin" not in handler.ops()


def test_agent_dies_and_comes_back(
    sock_path: Path, handler: Handler, logs: pytest.LogCaptureFixture
) -> None:
    first = LocalServer(sock_path, handler)
    first.start()
    client = make_client(sock_path, retry_interval_s=0.5)
    assert client.on_instruction_begin("forward", 0) == 1410

    first.stop()  # the agent dies mid-run
    with client.step(1):
        assert client.on_instruction_begin("forward", 1) is None
        client.on_instruction_end("forward")
    assert not client.connected
    assert len(warnings(logs)) == 1

    second_handler = Handler()
    with LocalServer(sock_path, second_handler):
        assert client.on_instruction_begin("forward", 2) is None  # within the retry interval
        assert second_handler.ops() == []
        deadline = time.monotonic() + 5
        clock = None
        while clock is None and time.monotonic() < deadline:
            time.sleep(0.05)
            clock = client.on_instruction_begin("backward", 3)
        assert clock == 1200
        assert client.connected and client.connections == 2
        assert second_handler.ops() == ["hello", "instruction_begin"]
    client.close()
    assert any("Reconnected" in w for w in warnings(logs))
    assert len(warnings(logs)) == 2  # the outage and the recovery, nothing per call


def test_close_makes_hooks_no_ops(server: LocalServer, handler: Handler) -> None:
    client = make_client(server.socket_path)
    client.on_step_begin(0)
    client.close()
    client.on_step_end(0)
    assert client.on_instruction_begin("forward") is None
    assert handler.ops() == ["hello", "step_begin"]
    assert "closed" in repr(client)


def test_after_fork_reconnects_with_own_session(server: LocalServer, handler: Handler) -> None:
    client = make_client(server.socket_path, retry_interval_s=60)
    client.on_step_begin(0)
    client._after_fork_in_child()  # what a forked child runs
    assert not client.connected
    client.on_step_begin(1)  # connects at once despite the long retry interval
    assert handler.ops() == ["hello", "step_begin", "hello", "step_begin"]
    client.close()


# ---------------------------------------------------------------------------
# Protocol


# ---------------------------------------------------------------------------
# Pipelined mode


def test_pipelined_hooks_arrive_in_order_and_close_waits_for_them(
    server: LocalServer, handler: Handler
) -> None:
    client = make_client(server.socket_path, pipelined=True, max_outstanding=4)
    expected = ["hello"]
    for step in range(20):
        with client.step(step):
            for mb in range(3):
                with client.instruction("forward", mb) as clock:
                    assert clock is None  # not waited for
                with client.instruction("backward", mb):
                    pass
        expected += ["step_begin"] + ["instruction_begin", "instruction_end"] * 6 + ["step_end"]
    assert client.flush()  # every hook sent has been handled
    assert handler.ops() == expected
    client.on_step_begin(20)
    client.close()  # waits for the pending replies too
    assert handler.ops() == [*expected, "step_begin"]
    assert client.connections == 1
    begins = [c[2] for c in handler.calls if c[0] == "instruction_begin"]
    for begin in begins:
        begin.pop("t_ns")
    assert begins[:2] == [
        {"op": "instruction_begin", "name": "forward", "microbatch": 0},
        {"op": "instruction_begin", "name": "backward", "microbatch": 0},
    ]


def test_pipelined_error_replies_are_logged_once_and_keep_the_connection(
    server: LocalServer, handler: Handler, logs: pytest.LogCaptureFixture
) -> None:
    handler.fail["step_begin"] = RequestError("no plan yet")
    with make_client(server.socket_path, pipelined=True) as client:
        for step in range(5):
            client.on_step_begin(step)
            client.on_instruction_begin("forward")
        client.on_step_end(4)
        assert client.connected
    assert handler.ops().count("step_begin") == 5
    (warning,) = warnings(logs)
    assert "refused step_begin: no plan yet" in warning


def test_pipelined_hooks_give_up_on_a_stuck_agent(
    sock_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(sock_path))
    listener.listen(1)
    hello_done = threading.Event()

    def serve() -> None:  # answers hello, then reads requests and never answers again
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b'{"ok": true}\n')
        hello_done.set()
        conn.settimeout(5)
        with contextlib.suppress(OSError):
            while conn.recv(4096):
                pass
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        client = PerseusClient(
            sock_path, pipelined=True, max_outstanding=3, reply_timeout_s=0.1, connect_timeout_s=2
        )
        for step in range(3):
            client.on_step_begin(step)  # sent, not waited for
        assert client.connected
        begin = time.perf_counter()
        client.on_step_begin(3)  # 3 pending: waits for one, times out, drops the connection
        assert time.perf_counter() - begin < 2.0
        assert not client.connected
        client.on_step_begin(4)  # a no-op now
        (warning,) = warnings(logs)
        assert "3 replies pending" in warning
        client.close()
    finally:
        thread.join(10)
        listener.close()


def test_pipelined_client_notices_a_dead_agent_and_reconnects(
    sock_path: Path, handler: Handler, logs: pytest.LogCaptureFixture
) -> None:
    first = LocalServer(sock_path, handler)
    first.start()
    client = make_client(sock_path, pipelined=True, retry_interval_s=0.2)
    client.on_step_begin(0)
    first.stop()
    deadline = time.monotonic() + 5
    while client.connected and time.monotonic() < deadline:
        client.on_step_begin(1)  # fails on send or on reading the closed connection
        time.sleep(0.01)
    assert not client.connected
    second = Handler()
    with LocalServer(sock_path, second):
        while "step_begin" not in second.ops() and time.monotonic() < deadline:
            time.sleep(0.05)
            client.on_step_begin(2)
        client.close()
    assert second.ops()[:2] == ["hello", "step_begin"]
    assert any("Reconnected" in w for w in warnings(logs))


def test_max_outstanding_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_outstanding"):
        PerseusClient("/nonexistent", pipelined=True, max_outstanding=0)


def test_request_builders_encode_and_decode() -> None:
    requests: list[Mapping[str, Any]] = [
        protocol.hello_request(
            rank=None, local_rank=0, gpu_uuids=["GPU-a"], pid=1, job=None, namespace="n", pod=None
        ),
        protocol.step_begin_request(0),
        protocol.step_end_request(2**40),
        protocol.instruction_begin_request("forward", 3),
        protocol.instruction_begin_request("backward"),
        protocol.instruction_end_request("backward"),
    ]
    for request in requests:
        line = protocol.encode_request(request)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert protocol.decode_request(line) == request
    assert requests[0]["version"] == protocol.PROTOCOL_VERSION


@pytest.mark.parametrize(
    "bad",
    [
        {"op": "step_begin", "step": 1.5},
        {"op": "step_begin", "step": False},
        {"op": "instruction_begin", "name": "forward", "microbatch": "0"},
        {"op": "instruction_end", "name": None},
        {"op": "hello", "version": 1, "gpu_uuids": "GPU-a", "pid": 1},
        {"op": "hello", "version": 1, "gpu_uuids": [], "pid": 1, "pod": 3},
        {"op": "hello", "version": 0, "gpu_uuids": [], "pid": 1},
        {"op": "hello", "version": 1.0, "gpu_uuids": [], "pid": 1},
        {"op": "nop"},
    ],
)
def test_invalid_requests(bad: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        protocol.encode_request(bad)


def test_size_limit() -> None:
    uuids = ["GPU-" + "a" * 5000]
    big = protocol.hello_request(
        rank=0, local_rank=0, gpu_uuids=uuids, pid=1, job=None, namespace=None, pod=None
    )
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.encode_request(big)
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode_reply(b"{" + b" " * protocol.MAX_MESSAGE_BYTES + b"}\n")
    with pytest.raises(ProtocolError, match="more than one"):
        protocol.decode_reply(b'{"ok":true}\n{"ok":true}\n')


def test_replies() -> None:
    line = protocol.encode_reply({"ok": True, "sm_clock_mhz": 1410}, "instruction_begin")
    assert protocol.decode_reply(line, "instruction_begin") == {"ok": True, "sm_clock_mhz": 1410}
    assert protocol.decode_reply(b'{"ok":true,"sm_clock_mhz":null}', "instruction_begin")
    assert protocol.decode_reply(b'{"ok":false,"error":"no"}') == {"ok": False, "error": "no"}
    for bad in (b'{"ok":1}', b'{"ok":false}', b"[]", b'{"ok":true,"sm_clock_mhz":"x"}'):
        with pytest.raises(ProtocolError):
            protocol.decode_reply(bad, "instruction_begin")
    long_error = protocol.error_reply("x" * 10_000)
    assert len(protocol.encode_reply(long_error)) <= protocol.MAX_MESSAGE_BYTES
