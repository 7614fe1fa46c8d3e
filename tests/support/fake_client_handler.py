"""The agent's :class:`~perseus_agent.serving.client_dispatch.ClientHandler` for the socket servers'
and the client's tests: it records every request and answers with fixed clocks."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from perseus_agent.serving.client_dispatch import ClientSession
from perseus_client.protocol import (
    HelloRequest,
    InstructionBeginRequest,
    InstructionEndRequest,
    StepBeginRequest,
    StepEndRequest,
)


class Handler:
    """Records every call ``(op, connection id, request, event time)``; forward runs at
    1410 MHz, backward at 1200 MHz. ``fail`` maps an op to the exception it raises."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int, dict[str, Any], int]] = []
        self.disconnects: list[int] = []
        self.disconnected_event = threading.Event()
        self.fail: dict[str, BaseException] = {}
        self.barrier: threading.Barrier | None = None
        self.gate: threading.Event | None = None  # instruction_begin waits for it
        self.entered = threading.Event()  # instruction_begin was called
        self.clock_reply: Any = None

    def _record(self, op: str, session: ClientSession, msg: Mapping[str, Any], ns: int) -> None:
        with self.lock:
            self.calls.append((op, session.connection_id, dict(msg), ns))
        if op in self.fail:
            raise self.fail[op]

    def ops(self) -> list[str]:
        with self.lock:
            return [c[0] for c in self.calls]

    def hellos(self) -> list[dict[str, Any]]:
        with self.lock:
            return [c[2] for c in self.calls if c[0] == "hello"]

    def hello(self, session: ClientSession, msg: HelloRequest, received_ns: int) -> None:
        self._record("hello", session, msg, received_ns)

    def step_begin(self, session: ClientSession, msg: StepBeginRequest, received_ns: int) -> None:
        self._record("step_begin", session, msg, received_ns)

    def step_end(self, session: ClientSession, msg: StepEndRequest, received_ns: int) -> None:
        self._record("step_end", session, msg, received_ns)

    def instruction_begin(
        self, session: ClientSession, msg: InstructionBeginRequest, received_ns: int
    ) -> dict[str, Any]:
        self._record("instruction_begin", session, msg, received_ns)
        self.entered.set()
        if self.barrier is not None:
            self.barrier.wait()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.clock_reply is not None:
            return {"sm_clock_mhz": self.clock_reply}
        return {"sm_clock_mhz": 1410 if msg["name"] == "forward" else 1200}

    def instruction_end(
        self, session: ClientSession, msg: InstructionEndRequest, received_ns: int
    ) -> None:
        self._record("instruction_end", session, msg, received_ns)

    def disconnected(self, session: ClientSession) -> None:
        with self.lock:
            self.disconnects.append(session.connection_id)
        self.disconnected_event.set()
