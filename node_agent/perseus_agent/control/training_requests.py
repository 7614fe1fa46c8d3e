"""The plan applier's answers to the requests of the training processes on its GPUs.

:class:`TrainingRequests` is the local server's handler half of
:class:`~perseus_agent.control.applier.PlanApplier`
(:class:`~perseus_agent.serving.client_dispatch.ClientHandler`): a hello binds the process to the
GPUs of the plan it claims, each step and computation moves their clocks (``Instruction``
granularity, :mod:`perseus_agent.control.instruction_clocks`) or their profiling
(:mod:`perseus_agent.control.profiling_session`), each step end is an iteration time
(:mod:`perseus_agent.control.iteration_stats`), and a disconnect resets the clocks the process
drove.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final

from perseus_agent.control.gpu_clocks import GpuClocks, wait
from perseus_agent.control.instruction_clocks import InstructionClocks
from perseus_agent.control.iteration_stats import IterationStats
from perseus_agent.control.plan_state import PlanState, TrainingProcess
from perseus_agent.control.profiling_session import GpuProfiling
from perseus_agent.log_limit import RateLimitedLog
from perseus_api.node_report import GpuStatus
from perseus_api.plan import Granularity

if TYPE_CHECKING:
    from perseus_agent.serving.client_dispatch import ClientSession
    from perseus_client.protocol import (
        HelloRequest,
        InstructionBeginRequest,
        InstructionEndRequest,
        StepBeginRequest,
        StepEndRequest,
    )

__all__ = ["TrainingRequests"]

log = logging.getLogger(__name__)

_SESSION_LOG_BURST: Final = 64
"""Hello and disconnect lines per minute before they are summarised (a node runs a few dozen
training processes; a flood of hellos must not become a flood of log lines)."""


class TrainingRequests:
    """Handles the training processes' requests against ``state``'s plan.

    Thread-safe (every request holds the state's lock): processes call in on server threads.
    """

    def __init__(
        self,
        state: PlanState,
        clocks: GpuClocks,
        instructions: InstructionClocks,
        profiling: GpuProfiling,
        iterations: IterationStats,
    ) -> None:
        self._state = state
        self._clocks = clocks
        self._instructions = instructions
        self._profiling = profiling
        self._iterations = iterations
        self._session_log = RateLimitedLog(log, burst=_SESSION_LOG_BURST)

    def hello(
        self,
        session: ClientSession,
        msg: HelloRequest,
        received_ns: int = 0,
        *,
        owned_uuids: frozenset[str] | None = None,
    ) -> dict[str, Any]:
        """A training process called in: find its GPUs (by UUID, else by rank), among
        ``owned_uuids`` only when given (the GPUs the kubelet allocated to its pod)."""
        rank = msg.get("rank")
        uuids = msg.get("gpu_uuids") or ()
        pod = msg.get("pod")
        state = self._state
        with state.lock:
            s = TrainingProcess(
                rank=rank if isinstance(rank, int) else None,
                gpu_uuids=tuple(u for u in uuids if isinstance(u, str)),
                pod=pod if isinstance(pod, str) else None,
                owned_uuids=owned_uuids,
            )
            state.sessions[session] = s
            state.bind(session, s, takeover=True)
            gpus = [state.gpus[i] for i in s.gpus]
            plan = state.plan
            reply: dict[str, Any] = {
                "ok": True,
                "node": state.node_name,
                "managed": bool(gpus),
                "granularity": str(plan.granularity) if plan is not None and gpus else None,
                "gpus": [
                    {
                        "index": g.info.index,
                        "uuid": g.info.uuid,
                        "stage": g.assignment.stage,
                        "dp_rank": g.assignment.dp_rank,
                    }
                    for g in gpus
                ],
            }
        self._session_log.log(
            logging.INFO,
            "hello",
            "training process rank %s (pid %s, GPUs %s) called in; managing GPU(s) %s",
            s.rank,
            msg.get("pid"),
            ", ".join(s.gpu_uuids) or "unknown",
            ", ".join(str(i) for i in s.gpus) or "none",
        )
        return reply

    def step_begin(
        self, session: ClientSession, msg: StepBeginRequest, t_ns: int
    ) -> dict[str, Any]:
        """An iteration begins: back to the first computation of the stage, and its clock."""
        state = self._state
        with state.lock:
            s = state.sessions.get(session)
            if s is None:
                return {"ok": True}
            s.step_begin_ns = t_ns
            s.step_revision = None if state.plan is None else state.plan.revision
            for g in state.owned(session, s):
                g.position, g.aligned = 0, True
                if g.profiler is not None:
                    self._profiling.step_begin(g, g.profiler, t_ns)
                elif g.granularity == Granularity.INSTRUCTION:
                    if g.status == GpuStatus.FAILED:
                        g.status = GpuStatus.WAITING  # retry once per iteration
                    self._instructions.prepare_next(g)
        return {"ok": True}

    def step_end(self, session: ClientSession, msg: StepEndRequest, t_ns: int) -> dict[str, Any]:
        """An iteration ends: record its time (``perseus_iteration_seconds``)."""
        state = self._state
        with state.lock:
            s = state.sessions.get(session)
            if s is None:
                return {"ok": True}
            owned = state.owned(session, s)
            for g in owned:
                if g.profiler is not None:
                    self._profiling.step_end(g, g.profiler, t_ns)
            if s.step_begin_ns is None:
                return {"ok": True}
            seconds = (t_ns - s.step_begin_ns) / 1e9
            s.step_begin_ns = None
            if seconds < 0 or not owned or state.plan is None:
                # Only the process driving a GPU of the plan is measured, under the plan's
                # labels: what a client claims in hello never names a series or a rank.
                return {"ok": True}
            self._iterations.record(owned[0], s, seconds)
        return {"ok": True}

    def instruction_begin(
        self, session: ClientSession, msg: InstructionBeginRequest, t_ns: int
    ) -> dict[str, Any]:
        """A computation begins: lock the clock the plan gives it; reply with the clock in effect.

        The computation is checked against the plan's next one; on a mismatch the position is
        resynchronised by (name, microbatch, chunk) and ``schedule_mismatch`` is counted.
        """
        name = msg["name"]
        microbatch = msg.get("microbatch")
        chunk = msg.get("chunk")
        clock_mhz: int | None = None
        state = self._state
        with state.lock:
            s = state.sessions.get(session)
            for g in state.owned(session, s):
                if g.profiler is not None:
                    self._profiling.instruction_begin(g, g.profiler, name, t_ns, chunk)
                elif g.granularity == Granularity.INSTRUCTION and g.status != GpuStatus.FAILED:
                    self._instructions.switch(g, name, microbatch, chunk)
                if g.status != GpuStatus.FAILED and clock_mhz is None:
                    clock_mhz = g.applied_mhz
        return {"ok": True, "sm_clock_mhz": clock_mhz}

    def instruction_end(
        self, session: ClientSession, msg: InstructionEndRequest, t_ns: int
    ) -> dict[str, Any]:
        """A computation ends: lock the clock of the plan's next one already.

        The GPU idles until the next computation's inputs arrive (or the next iteration), and a
        clock change takes effect some time after it is asked for; set now, it is in place when
        that computation starts, and its own hook finds nothing to change.
        """
        state = self._state
        with state.lock:
            s = state.sessions.get(session)
            for g in state.owned(session, s):
                if g.profiler is not None:
                    self._profiling.instruction_end(
                        g, g.profiler, msg["name"], t_ns, msg.get("chunk")
                    )
                elif g.granularity == Granularity.INSTRUCTION and g.status != GpuStatus.FAILED:
                    self._instructions.prepare_next(g)
        return {"ok": True}

    def disconnected(self, session: ClientSession) -> None:
        """The training process is gone: its instruction-level GPUs go back to default clocks."""
        state = self._state
        with state.lock:
            s = state.sessions.pop(session, None)
            if s is None:
                return
            for index in s.gpus:
                g = state.gpus.get(index)
                if g is None or g.session != session:
                    continue
                g.session = None
                if g.profiler is not None:
                    self._profiling.disconnected(g, g.profiler)
                elif g.granularity == Granularity.INSTRUCTION:
                    self._clocks.reset_clock(index)
                    wait(g, "the training process disconnected")
        self._session_log.log(
            logging.INFO, "disconnected", "training process rank %s disconnected", s.rank
        )
