"""Run ``examples/torch_pipeline.py`` (real torch processes) against a recording agent socket.

The socket is the agent's real :class:`LocalServer`; its handler records every request
with the event's time (the client's ``t_ns``, as the agent uses it) per connection, so a
test sees each rank's hook stream as the node agent would. :func:`recording_proxy` records
the requests on their way to a real agent process instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.serving.client_dispatch import ClientSession
from perseus_agent.serving.local_server import LocalServer
from perseus_client.protocol import (
    HelloRequest,
    InstructionBeginRequest,
    InstructionEndRequest,
    StepBeginRequest,
    StepEndRequest,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "torch_pipeline.py"
JOB_TIMEOUT_S = 300


def require_torch() -> None:
    """Skip (saying why) without torch; fail instead where CI requires it."""
    if importlib.util.find_spec("torch") is not None:
        return
    reason = "torch is not installed (pip install -e '.[torch]'; `make test` installs it)"
    for var in ("PERSEUS_REQUIRE_TORCH", "PERSEUS_REQUIRE_E2E"):
        if os.environ.get(var) == "1":
            pytest.fail(f"{reason}, and {var}=1 requires the real-torch tests")
    pytest.skip(reason)


@dataclass(frozen=True)
class Event:
    op: str
    msg: dict[str, Any]
    t_ns: int


@dataclass
class Recorder:
    """A LocalServer handler that answers like an unmanaged agent and records everything."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    events: dict[int, list[Event]] = field(default_factory=dict)  # by connection

    def _add(self, session: ClientSession, op: str, msg: Mapping[str, Any], t_ns: int) -> None:
        with self.lock:
            self.events.setdefault(session.connection_id, []).append(Event(op, dict(msg), t_ns))

    def hello(self, session: ClientSession, msg: HelloRequest, received_ns: int) -> None:
        self._add(session, "hello", msg, received_ns)

    def step_begin(self, session: ClientSession, msg: StepBeginRequest, t_ns: int) -> None:
        self._add(session, "step_begin", msg, t_ns)

    def step_end(self, session: ClientSession, msg: StepEndRequest, t_ns: int) -> None:
        self._add(session, "step_end", msg, t_ns)

    def instruction_begin(
        self, session: ClientSession, msg: InstructionBeginRequest, t_ns: int
    ) -> dict[str, Any]:
        self._add(session, "instruction_begin", msg, t_ns)
        return {"sm_clock_mhz": None}

    def instruction_end(
        self, session: ClientSession, msg: InstructionEndRequest, t_ns: int
    ) -> None:
        self._add(session, "instruction_end", msg, t_ns)

    def disconnected(self, session: ClientSession) -> None:
        pass

    def by_rank(self) -> dict[int, list[Event]]:
        """Each rank's events (the rank its hello named), hello first."""
        with self.lock:
            streams = [list(e) for e in self.events.values()]
        out: dict[int, list[Event]] = {}
        for stream in streams:
            assert stream[0].op == "hello", stream[:3]
            rank = stream[0].msg["rank"]
            assert rank not in out, f"rank {rank} connected twice"
            out[rank] = stream
        return out


@dataclass
class JobRun:
    stderr: str
    events: dict[int, list[Event]]


@contextmanager
def recording_socket() -> Iterator[tuple[Path, Recorder]]:
    # Short: a pytest tmp_path can exceed the 108-byte AF_UNIX limit.
    directory = Path(tempfile.mkdtemp(prefix="ptj", dir="/tmp"))
    recorder = Recorder()
    try:
        with LocalServer(directory / "agent.sock", recorder):
            yield directory / "agent.sock", recorder
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_script(
    script: Path,
    args: list[str],
    *,
    socket_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = JOB_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` to completion (it stops its own processes), with the project's source
    on its path, ``env`` on top of ours and its hooks pointed at ``socket_path``; raise on
    failure."""
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT / "node_agent"), str(REPO_ROOT / "operator"), environ.get("PYTHONPATH", "")]
    )
    environ.update(env or {})
    environ.pop("PERSEUS_AGENT_SOCKET", None)
    if socket_path is not None:
        environ["PERSEUS_AGENT_SOCKET"] = str(socket_path)
    result = subprocess.run(
        [sys.executable, str(script), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, f"{script.name} failed:\n{result.stderr[-6000:]}"
    return result


def run_example(
    args: list[str], *, socket_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/torch_pipeline.py`` (see :func:`run_script`)."""
    return run_script(EXAMPLE, args, socket_path=socket_path)


def run_recorded(
    args: list[str],
    *,
    script: Path = EXAMPLE,
    env: Mapping[str, str] | None = None,
    timeout_s: float = JOB_TIMEOUT_S,
) -> JobRun:
    """Run ``script`` (default the torch example) against a :func:`recording_socket`."""
    with recording_socket() as (path, recorder):
        result = run_script(script, args, socket_path=path, env=env, timeout_s=timeout_s)
    return JobRun(result.stderr, recorder.by_rank())


def steps_of(events: list[Event]) -> list[list[Event]]:
    """The events of each step, ``step_begin`` .. ``step_end``; nothing may fall outside."""
    steps: list[list[Event]] = []
    current: list[Event] | None = None
    for event in events[1:]:  # after the hello
        if event.op == "step_begin":
            assert current is None, f"step_begin inside a step: {event}"
            current = [event]
        elif event.op == "step_end":
            assert current is not None, f"step_end outside a step: {event}"
            current.append(event)
            steps.append(current)
            current = None
        else:
            assert current is not None, f"{event.op} outside a step (eval?): {event}"
            current.append(event)
    assert current is None, "a step never ended"
    return steps


def computations(step: list[Event]) -> list[tuple[str, int, int | None]]:
    """``(name, microbatch, chunk)`` of each computation of a step; every begin is followed by
    its own end (same name and chunk, not earlier)."""
    out: list[tuple[str, int, int | None]] = []
    body = step[1:-1]
    assert len(body) % 2 == 0, body
    for begin, end in zip(body[::2], body[1::2], strict=True):
        assert begin.op == "instruction_begin" and end.op == "instruction_end", (begin, end)
        assert (end.msg["name"], end.msg.get("chunk")) == (
            begin.msg["name"],
            begin.msg.get("chunk"),
        )
        assert begin.t_ns <= end.t_ns
        out.append((begin.msg["name"], begin.msg["microbatch"], begin.msg.get("chunk")))
    return out


def unchunked(order: list[tuple[str, int]]) -> list[tuple[str, int, int | None]]:
    """``(instruction, microbatch)`` pairs as :func:`computations` reports them when no chunk
    is named (one stage per rank)."""
    return [(name, microbatch, None) for name, microbatch in order]


def iteration_times_s(events: list[Event]) -> list[float]:
    """Each step's time from its begin to its end, in seconds."""
    return [(s[-1].t_ns - s[0].t_ns) / 1e9 for s in steps_of(events)]


@dataclass
class WireLog:
    """The requests each connection sent through a :func:`recording_proxy`, decoded."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, connection: int, line: bytes) -> None:
        with self.lock:
            self.requests.setdefault(connection, []).append(json.loads(line))

    def by_rank(self) -> dict[int, list[dict[str, Any]]]:
        """Each rank's requests (the rank its accepted hello named), that hello first."""
        with self.lock:
            streams = [list(r) for r in self.requests.values()]
        out: dict[int, list[dict[str, Any]]] = {}
        for stream in streams:
            hellos = [i for i, r in enumerate(stream) if r["op"] == "hello"]
            # A refused hello (an older agent's) may come before the accepted one.
            stream = stream[hellos[-1] :]
            rank = stream[0]["rank"]
            assert rank not in out, f"rank {rank} connected twice"
            out[rank] = stream
        return out


@contextmanager
def recording_proxy(target: Path) -> Iterator[tuple[Path, WireLog]]:
    """A socket that passes every connection through to the agent's socket ``target``,
    recording the requests: what a real agent process received, line for line."""
    directory = Path(tempfile.mkdtemp(prefix="ptp", dir="/tmp"))
    path = directory / "proxy.sock"
    log = WireLog()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    threads: list[threading.Thread] = []
    sockets: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket, connection: int | None) -> None:
        buffer = b""
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if connection is not None:
                    buffer += data
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        log.add(connection, line)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        connection = 0
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: stop
            agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            agent.connect(str(target))
            sockets.extend((client, agent))
            for args in ((client, agent, connection), (agent, client, None)):
                thread = threading.Thread(target=pump, args=args, daemon=True)
                thread.start()
                threads.append(thread)
            connection += 1

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield path, log
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        acceptor.join(timeout=5)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=5)
        for sock in sockets:
            sock.close()
        shutil.rmtree(directory, ignore_errors=True)
