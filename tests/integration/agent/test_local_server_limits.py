"""The socket's limits: floods of connections (silent, or saying hello and then nothing) from
one or several processes do not lock a real training process out."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from perseus_agent.serving.local_server import LocalServer
from perseus_agent.serving.socket_limits import Limits, make_room
from perseus_client import PerseusClient
from perseus_client.protocol import encode_reply
from support.fake_client_handler import Handler
from support.raw_protocol_client import HELLO, Raw

TIMEOUT_S = 20.0

FLOOD = r"""
import json, socket, sys
path, count, say_hello = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
hello = json.dumps({"op": "hello", "version": 1, "rank": 9, "local_rank": 0, "gpu_uuids": [],
                    "pid": 1, "job": "flood", "namespace": "x", "pod": "flood"}).encode() + b"\n"
socks = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    try:
        s.connect(path)
        if say_hello:
            s.sendall(hello)
            s.makefile("rb").readline()
    except OSError:
        pass
    socks.append(s)
print("ready", flush=True)
sys.stdin.read()  # hold every connection open until the test closes stdin
"""


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="pls-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def handler() -> Handler:
    return Handler()


class Flood:
    """Processes holding many connections to the socket open; stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, path: Path, count: int, *, say_hello: bool = False) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", FLOOD, os.fspath(path), str(count), "1" if say_hello else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=TIMEOUT_S)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        self.procs = []


@pytest.fixture
def flood() -> Iterator[Flood]:
    f = Flood()
    yield f
    f.stop()


def wait_until(condition: object, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


def served(path: Path) -> bool:
    """A real training process's client: hello, a step and an instruction, answered."""
    client = PerseusClient(
        path, rank=0, gpu_uuids=["GPU-0000"], connect_timeout_s=5.0, reply_timeout_s=5.0
    )
    try:
        client.on_step_begin(0)
        clock = client.on_instruction_begin("forward", 0)
        return client.connected and clock == 1410
    finally:
        client.close()


# -- floods ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 3])
def test_a_flood_of_silent_connections_does_not_lock_out_a_real_client(
    sock_dir: Path, handler: Handler, flood: Flood, processes: int
) -> None:
    with LocalServer(sock_dir / "a.sock", handler) as srv:
        for _ in range(processes):
            flood.start(srv.socket_path, 300)  # more than every slot, none says hello
        for _ in range(5):
            assert served(srv.socket_path)
        assert handler.ops().count("instruction_begin") == 5
        assert len(srv.sessions()) <= 64  # the default cap on connections without hello


ACTIVE_FLOOD = r"""
import collections, socket, sys
socks = collections.deque(maxlen=2000)  # keeps the newest open; the agent closes most
print("ready", flush=True)
while True:
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    try:
        s.connect(sys.argv[1])
    except OSError:
        pass
    socks.append(s)
"""


def test_a_real_client_is_served_while_a_flood_keeps_connecting(
    sock_dir: Path, handler: Handler
) -> None:
    with LocalServer(sock_dir / "a.sock", handler) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-c", ACTIVE_FLOOD, os.fspath(srv.socket_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            # Its newest connections without hello fill its per-peer share.
            wait_until(lambda: len(srv.sessions()) >= 16, "the flood to be under way")
            for _ in range(3):
                assert served(srv.socket_path)
        finally:
            proc.kill()
            proc.wait(timeout=TIMEOUT_S)
            if proc.stdout is not None:
                proc.stdout.close()


def test_a_flood_from_the_clients_own_process_does_not_lock_it_out(
    sock_dir: Path, handler: Handler
) -> None:
    with LocalServer(sock_dir / "a.sock", handler) as srv:
        silent = []
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX)
            silent.append(sock)
            with contextlib.suppress(BlockingIOError):  # the backlog is full for a moment
                sock.setblocking(False)
                sock.connect(os.fspath(srv.socket_path))
        try:
            assert served(srv.socket_path)
        finally:
            for sock in silent:
                sock.close()


def test_a_flood_of_idle_hellos_from_one_process_is_capped(
    sock_dir: Path, handler: Handler, flood: Flood
) -> None:
    with LocalServer(sock_dir / "a.sock", handler, max_connections_per_peer=16) as srv:
        flood.start(srv.socket_path, 100, say_hello=True)
        wait_until(lambda: handler.ops().count("hello") >= 16, "the flood's hellos")
        assert sum(s.hello is not None for s in srv.sessions()) == 16
        assert served(srv.socket_path)


def test_when_every_slot_is_taken_the_peer_holding_most_makes_room(
    sock_dir: Path, handler: Handler, flood: Flood
) -> None:
    with LocalServer(sock_dir / "a.sock", handler, max_connections=8) as srv:
        flood.start(srv.socket_path, 8, say_hello=True)
        wait_until(lambda: handler.ops().count("hello") == 8, "the flood's hellos")
        assert served(srv.socket_path)
        # One of the flood's made room: the longest idle, closed by its own thread.
        wait_until(lambda: 1 in handler.disconnects, "connection 1 to be closed")
        # Only it: the real client's own close (connection 9) may be counted by now too.
        assert set(handler.disconnects) <= {1, 9}


# -- timeouts ------------------------------------------------------------------------------------


def test_a_connection_without_hello_is_closed_after_the_hello_timeout(
    sock_dir: Path, handler: Handler
) -> None:
    with LocalServer(sock_dir / "a.sock", handler, hello_timeout_s=0.2) as srv:
        silent = Raw(srv.socket_path)
        drip = Raw(srv.socket_path)
        assert silent.at_eof()  # the client's 5 s read timeout bounds the wait
        # A byte at a time does not extend the deadline.
        closed = False
        for byte in json.dumps(HELLO).encode()[:40]:
            try:
                drip.send(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
        assert closed or drip.at_eof()
        assert handler.calls == []
        silent.close()
        drip.close()
        wait_until(lambda: not srv.sessions(), "the connections to go")


def test_a_rejected_hello_does_not_restart_the_hello_timeout(
    sock_dir: Path, handler: Handler
) -> None:
    with LocalServer(sock_dir / "a.sock", handler, hello_timeout_s=0.3) as srv:
        client = Raw(srv.socket_path)
        assert client.ask({**HELLO, "version": 99})["ok"] is False
        assert client.at_eof()
        client.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout(
    sock_dir: Path, handler: Handler
) -> None:
    with LocalServer(sock_dir / "a.sock", handler, idle_timeout_s=0.2) as srv:
        client = Raw(srv.socket_path)
        assert client.ask(HELLO)["ok"] is True
        assert client.at_eof()
        assert handler.disconnected_event.wait(TIMEOUT_S)
        client.close()
        # The client's own reconnect is served as usual.
        assert served(srv.socket_path)


def test_limits_are_checked(sock_dir: Path, handler: Handler) -> None:
    with pytest.raises(ValueError, match="max_pending must be at least 1"):
        LocalServer(sock_dir / "a.sock", handler, max_pending=0)
    with pytest.raises(ValueError, match="must be positive"):
        LocalServer(sock_dir / "a.sock", handler, idle_timeout_s=0)


def test_the_client_retries_while_the_agents_backlog_is_full(sock_dir: Path) -> None:
    """A full backlog fails a connect at once (EAGAIN); the agent drains it in milliseconds."""
    path = sock_dir / "b.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.fspath(path))
    listener.listen(0)
    filler = []
    while True:  # fill the backlog
        sock = socket.socket(socket.AF_UNIX)
        sock.setblocking(False)
        filler.append(sock)
        try:
            sock.connect(os.fspath(path))
        except BlockingIOError:
            filler.pop().close()
            break
    hello_reply = encode_reply(
        {"ok": True, "version": 1, "connection_id": 1, "node": "n1", "managed": False,
         "granularity": None, "gpus": []},
        "hello",
    )  # fmt: skip

    def drain_then_serve() -> None:
        time.sleep(0.05)  # the client's first attempts find the backlog full
        listener.settimeout(TIMEOUT_S)
        for _ in range(len(filler)):
            listener.accept()[0].close()
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(TIMEOUT_S)
            conn.makefile("rb").readline()
            conn.sendall(hello_reply)
            conn.makefile("rb").readline()  # until the client closes

    agent = threading.Thread(target=drain_then_serve, daemon=True)
    agent.start()
    client = PerseusClient(path, rank=0, connect_timeout_s=TIMEOUT_S, reply_timeout_s=TIMEOUT_S)
    try:
        client.on_step_begin(0)
        assert client.connections == 1
    finally:
        client.close()
        agent.join(TIMEOUT_S)
        for sock in filler:
            sock.close()
        listener.close()


# -- the policy on its own ------------------------------------------------------------------------


@dataclass
class Slot:
    peer: str
    pending: bool = True
    last_request_ns: int = 0


LIMITS = Limits(max_connections=6, max_pending=3, max_pending_per_peer=2,
                max_connections_per_peer=4)  # fmt: skip


def test_make_room_closes_the_oldest_without_hello_of_the_peer_then_of_all() -> None:
    a1, a2, b1 = Slot("a"), Slot("a"), Slot("b")
    assert make_room([a1, a2, b1], "a", LIMITS) == ([a1], None)  # a's own first
    assert make_room([b1, a1, a2], "c", LIMITS) == ([b1], None)  # then the oldest of all
    assert make_room([a1, b1], "c", LIMITS) == ([], None)


def test_make_room_refuses_a_peer_over_its_own_budget() -> None:
    own = [Slot("a", pending=False) for _ in range(4)]
    assert make_room(own, "a", LIMITS) == ([], "too many connections from this process")
    assert make_room(own, "b", LIMITS) == ([], None)


def test_make_room_takes_the_idlest_connection_of_the_heaviest_peer_when_full() -> None:
    a = [Slot("a", pending=False, last_request_ns=t) for t in (5, 1, 7, 3)]
    b = [Slot("b", pending=False, last_request_ns=0) for _ in range(2)]
    assert make_room([*a, *b], "c", LIMITS) == ([a[1]], None)
    # A peer as heavy as the newcomer's would be keeps its connections.
    even = [Slot(p, pending=False) for p in "aabbcc"]
    assert make_room(even, "a", LIMITS) == ([], "too many connections")


def test_limits_under_one_are_refused() -> None:
    with pytest.raises(ValueError, match="max_pending_per_peer must be at least 1"):
        Limits(max_connections=1, max_pending=1, max_pending_per_peer=0,
               max_connections_per_peer=1)  # fmt: skip
