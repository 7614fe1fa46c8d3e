"""Applies a :class:`~perseus_api.NodePlan` to the GPUs of this node.

``Stage`` granularity locks every assigned GPU's SM clock to its stage's clock when the plan
arrives. ``Instruction`` granularity locks nothing until the training process on the GPU calls
in over the local socket (see :class:`PlanApplier` as the local server's handler): every
``instruction_begin`` locks the clock of the next computation of the stage, in schedule order.
A computation is the plan's entry of the same (name, microbatch, chunk): with virtual stages
(interleaved 1F1B) an entry's chunk is its ``virtual_stage // num_stages``, the rank-local
index the client names (protocol version 2); a client that names no chunk (version 1)
matches any, and a zero-bubble plan's ``backward_input``/``backward_weight`` are matched by
name like ``forward`` and ``backward``.

A clock the GPU does not support is clamped to the nearest supported one and reported as
``Clamped``. A GPU error affects that GPU only: it is reported ``Failed`` with the error's
reason, counted in ``perseus_agent_apply_errors_total{reason}``, and the other GPUs go on.
GPUs that leave the plan, and every GPU on :meth:`PlanApplier.clear`, get their clocks reset.

Every GPU is recorded in the :class:`~perseus_agent.reset_state.ResetState` before its clock is
first locked, so a killed agent's locks are undone when it restarts.

A plan with ``profiling`` set profiles instead (see :mod:`perseus_agent.profiler`): each assigned
GPU samples its energy counter in the background and, once its training process calls in, runs
the clocks of the profiling schedule one after the other (locked at ``step_begin``, clamped and
reported like any other clock), measuring every forward and backward from the process's
requests. When the last clock is measured the GPU's clock is reset (status ``Applied`` with no
clock: nothing is locked any more) and :attr:`NodeReport.profiling` carries the GPU's profile
rows and blocking power. A GPU error fails that GPU's profiling only.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from perseus_agent.errors import GpuError, PlanError
from perseus_agent.exporter import AgentMetrics, ManagedGpu
from perseus_agent.gpu.base import GpuBackend, GpuInfo
from perseus_agent.log_limit import RateLimitedLog
from perseus_agent.profiler import EnergySampler, StageProfiler
from perseus_agent.reset_state import ResetState
from perseus_api.node_plan import GpuAssignment, NodePlan, ProfilingSpec
from perseus_api.node_report import ITERATION_WINDOW as _ITERATION_WINDOW

# The report models are perseus_api's (the operator reads them too); re-exported here, where
# the agent builds them.
from perseus_api.node_report import (
    GpuProfilingReport,
    GpuReport,
    GpuStatus,
    NodeReport,
    RankReport,
)
from perseus_api.plan import Granularity, StagePlan

if TYPE_CHECKING:
    from perseus_agent.local_server import ClientSession
    from perseus_client.protocol import (
        HelloRequest,
        InstructionBeginRequest,
        InstructionEndRequest,
        StepBeginRequest,
        StepEndRequest,
    )

__all__ = [
    "GpuProfilingReport",
    "GpuReport",
    "GpuStatus",
    "NodeReport",
    "PlanApplier",
    "RankReport",
    "SamplerFactory",
]

log = logging.getLogger(__name__)

_SESSION_LOG_BURST: Final = 64
"""Hello and disconnect lines per minute before they are summarised (a node runs a few dozen
training processes; a flood of hellos must not become a flood of log lines)."""

SamplerFactory = Callable[[GpuInfo, Callable[[], float]], EnergySampler]
"""Makes the energy sampler of a profiled GPU from the GPU and a reader of its counter."""


@dataclass
class _Gpu:
    """A GPU of the current plan."""

    info: GpuInfo
    assignment: GpuAssignment
    stage_plan: StagePlan
    granularity: Granularity
    status: GpuStatus = GpuStatus.WAITING
    target_mhz: int | None = None
    applied_mhz: int | None = None
    message: str = ""
    num_stages: int = 1
    """GPUs in the pipeline: an instruction's chunk is its ``virtual_stage // num_stages``."""
    virtual_stages: int = 1
    position: int = 0
    """Instruction granularity: index of the next computation of the stage."""
    aligned: bool = True
    """Whether ``position`` follows the training process: not when an Instruction plan takes
    over mid-iteration from a plan that kept no place in the schedule (profiling, Stage)."""
    session: Hashable | None = None
    """Instruction granularity: the training process driving this GPU."""
    profiling: ProfilingSpec | None = None
    profiler: StageProfiler | None = None
    """Profiling: the measurements (created with the GPU's state, ``None`` otherwise)."""
    profile_reported: bool = False

    def same_plan(
        self,
        granularity: Granularity,
        stage_plan: StagePlan,
        profiling: ProfilingSpec | None,
        stage: int,
    ) -> bool:
        if self.profiling is not None or profiling is not None:
            return self.profiling == profiling and self.assignment.stage == stage
        return self.granularity == granularity and self.stage_plan == stage_plan

    @property
    def profiling_active(self) -> bool:
        """Profiling and still measuring or computing, without a failure."""
        return (
            self.profiler is not None and not self.profiler.done and self.status != GpuStatus.FAILED
        )

    def labels(self, plan: NodePlan) -> dict[str, str]:
        a = self.assignment
        return {
            "namespace": plan.namespace,
            "job": plan.job,
            "pod": a.pod or "",
            "dp_rank": str(a.dp_rank),
            "pp_rank": str(a.stage),
        }


@dataclass
class _Session:
    """A training process connected over the local socket."""

    rank: int | None
    gpu_uuids: tuple[str, ...]
    pod: str | None
    owned_uuids: frozenset[str] | None = None
    """The GPUs the process's pod owns (kubelet); ``None``: not checked (standalone)."""
    gpus: list[int] = field(default_factory=list)
    step_begin_ns: int | None = None
    step_revision: int | None = None


@dataclass
class _RankTimes:
    dp_rank: int | None
    pp_rank: int | None
    count: int = 0
    revision: int | None = None
    recent_s: deque[float] = field(default_factory=lambda: deque(maxlen=_ITERATION_WINDOW))


class PlanApplier:
    """Applies node plans to ``backend``'s GPUs; also the local server's request handler.

    Thread-safe: plans arrive on the agent loop, training processes call in on server threads.

    Args:
        backend: The GPUs of this node.
        reset_state: Where GPUs are recorded before their clocks are locked.
        node_name: This node; plans for another node are refused.
        metrics: Counters to update; a private set by default.
        sampler_factory: Makes the energy sampler of a profiled GPU (default: an
            :class:`~perseus_agent.profiler.EnergySampler` sampling every 5 ms in a thread);
            the applier starts it and stops it once the GPU's profiling is over.

    Raises:
        GpuError: The backend cannot list its GPUs.
    """

    def __init__(
        self,
        backend: GpuBackend,
        reset_state: ResetState,
        node_name: str,
        metrics: AgentMetrics | None = None,
        sampler_factory: SamplerFactory | None = None,
    ) -> None:
        self._backend = backend
        self._sampler_factory = sampler_factory or _default_sampler
        self._reset_state = reset_state
        self.node_name = node_name
        self.metrics = metrics if metrics is not None else AgentMetrics(node_name)
        self._lock = threading.RLock()
        self.devices: list[GpuInfo] = backend.devices()
        self._by_uuid = {g.uuid: g for g in self.devices}
        self._by_index = {g.index: g for g in self.devices}
        self._plan: NodePlan | None = None
        self._gpus: dict[int, _Gpu] = {}
        self._unresolved: list[GpuReport] = []
        self._locked: dict[int, int] = {}  # index -> SM clock this agent locked
        self._nearest: dict[tuple[int, int], int] = {}  # (index, planned) -> supported clock
        self._sessions: dict[Hashable, _Session] = {}
        self._ranks: dict[int, _RankTimes] = {}
        self._series: set[tuple[str, ...]] = set()  # perseus_iteration_seconds label values
        # A client controls how often these happen: the counter counts each, the log samples.
        self._mismatch_log = RateLimitedLog(log)
        self._session_log = RateLimitedLog(log, burst=_SESSION_LOG_BURST)
        # Instruction granularity retries a failed GPU every iteration (a GPU whose clocks
        # another owner holds fails every time).
        self._fail_log = RateLimitedLog(log)

    # -- plans ---------------------------------------------------------------------------------

    @property
    def plan(self) -> NodePlan | None:
        """The plan being applied, if any."""
        return self._plan

    def apply(self, node_plan: NodePlan) -> NodeReport:
        """Apply ``node_plan`` (a new one or a new revision) and report per GPU.

        Re-applying what is already in effect makes no GPU calls. GPUs of the previous plan
        that this one does not assign are reset.

        Raises:
            PlanError: The plan is for another node (nothing is changed).
        """
        if node_plan.node != self.node_name:
            raise PlanError(
                f"the plan is for node {node_plan.node!r} but this agent runs on {self.node_name!r}"
            )
        granularity = node_plan.granularity
        profiling = node_plan.profiling
        with self._lock:
            wanted: dict[int, tuple[GpuInfo, GpuAssignment, StagePlan]] = {}
            unresolved: list[GpuReport] = []
            for a in node_plan.assignments:
                gpu, problem = self._resolve(a, wanted)
                stage_plan = node_plan.plans[a.plan].stages[a.stage]
                if gpu is None:
                    log.error("plan %s: %s", _plan_name(node_plan), problem)
                    self.metrics.count_error("unknown_gpu")
                    unresolved.append(unresolved_gpu_report(node_plan, a, problem))
                    continue
                wanted[gpu.index] = (gpu, a, stage_plan)

            self._release({*self._gpus, *self._locked} - set(wanted), "not in the new plan")

            for index, (gpu, a, stage_plan) in sorted(wanted.items()):
                old = self._gpus.get(index)
                if (
                    old is not None
                    and old.status != GpuStatus.FAILED
                    and old.same_plan(granularity, stage_plan, profiling, a.stage)
                ):
                    old.assignment = a
                    continue
                if old is not None:
                    _stop_sampling(old)
                pipeline = node_plan.plans[a.plan]
                state = _Gpu(
                    gpu,
                    a,
                    stage_plan,
                    granularity,
                    num_stages=pipeline.num_stages,
                    virtual_stages=pipeline.virtual_stages,
                    profiling=profiling,
                )
                self._gpus[index] = state
                if profiling is not None:
                    self._prepare_profiling(state, old, profiling)
                elif granularity == Granularity.STAGE:
                    if old is not None and old.session is not None:
                        state.session = old.session
                    self._lock_stage(state)
                else:
                    self._prepare_instructions(state, old)

            self._plan = node_plan
            self._unresolved = unresolved
            # Owners first let go of the GPUs they no longer claim; then newest first: a GPU
            # nobody owns goes to the latest hello that claims it, as it would have at that
            # hello, and a GPU with an owner keeps it.
            for key, session in self._sessions.items():
                self._release_unclaimed(key, session, self._claimed(session))
            for key, session in reversed(self._sessions.items()):
                self._bind(key, session, takeover=False)
            self._prune_metrics()
            report = self._report_locked()
        log.info(
            "applied plan %s revision %d: %s",
            _plan_name(node_plan),
            node_plan.revision,
            _summary(report),
        )
        return report

    def clear(self) -> None:
        """The plan is gone: reset every clock this agent changed."""
        with self._lock:
            self._release({*self._gpus, *self._locked}, "plan removed")
            for session in self._sessions.values():
                session.gpus = []
            if self._plan is not None:
                log.info("cleared plan %s; clocks reset", _plan_name(self._plan))
            self._plan = None
            self._unresolved = []
            self._prune_metrics()

    def report(self) -> NodeReport | None:
        """The current state of the plan, or ``None`` without a plan."""
        with self._lock:
            if self._plan is None:
                return None
            for g in self._gpus.values():
                self._poll_profiler(g)
            return self._report_locked()

    def locked_gpus(self) -> list[int]:
        """Indices of the GPUs whose clocks this agent locked and has not reset."""
        with self._lock:
            recorded = {e.index for e in self._reset_state.entries()}
            return sorted(set(self._locked) | recorded)

    def managed_gpus(self) -> dict[int, ManagedGpu]:
        """Labels and target clock of the GPUs under the plan, by index (for the exporter)."""
        with self._lock:
            plan = self._plan
            if plan is None:
                return {}
            return {
                i: ManagedGpu(labels=g.labels(plan), target_mhz=g.target_mhz)
                for i, g in self._gpus.items()
            }

    # -- local server handler ------------------------------------------------------------------

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
        with self._lock:
            s = _Session(
                rank=rank if isinstance(rank, int) else None,
                gpu_uuids=tuple(u for u in uuids if isinstance(u, str)),
                pod=pod if isinstance(pod, str) else None,
                owned_uuids=owned_uuids,
            )
            self._sessions[session] = s
            self._bind(session, s, takeover=True)
            gpus = [self._gpus[i] for i in s.gpus]
            plan = self._plan
            reply: dict[str, Any] = {
                "ok": True,
                "node": self.node_name,
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
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                return {"ok": True}
            s.step_begin_ns = t_ns
            s.step_revision = None if self._plan is None else self._plan.revision
            for g in self._owned(session, s):
                g.position, g.aligned = 0, True
                if g.profiler is not None:
                    self._profile_step_begin(g, g.profiler, t_ns)
                elif g.granularity == Granularity.INSTRUCTION:
                    if g.status == GpuStatus.FAILED:
                        g.status = GpuStatus.WAITING  # retry once per iteration
                    self._prepare_next(g)
        return {"ok": True}

    def step_end(self, session: ClientSession, msg: StepEndRequest, t_ns: int) -> dict[str, Any]:
        """An iteration ends: record its time (``perseus_iteration_seconds``)."""
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                return {"ok": True}
            owned = self._owned(session, s)
            for g in owned:
                if g.profiler is not None and self._profiling_ok(g):
                    if g.profiler.step_end(t_ns):
                        self._finish_measuring(g)
                    self._poll_profiler(g)
            if s.step_begin_ns is None:
                return {"ok": True}
            seconds = (t_ns - s.step_begin_ns) / 1e9
            s.step_begin_ns = None
            if seconds < 0 or not owned or self._plan is None:
                # Only the process driving a GPU of the plan is measured, under the plan's
                # labels: what a client claims in hello never names a series or a rank.
                return {"ok": True}
            g = owned[0]
            self._series.add(self.metrics.observe_iteration(self._iteration_labels(g), seconds))
            dp_rank, pp_rank = g.assignment.dp_rank, g.assignment.stage
            rank = g.assignment.rank if g.assignment.rank is not None else s.rank
            if rank is not None:
                times = self._ranks.get(rank)
                if times is None or (times.dp_rank, times.pp_rank) != (dp_rank, pp_rank):
                    times = self._ranks[rank] = _RankTimes(dp_rank, pp_rank)
                    self._prune_ranks()
                times.count += 1
                revision = None if self._plan is None else self._plan.revision
                if revision != times.revision:
                    # A new plan changes the pace on purpose (e.g. re-targeted to a straggler):
                    # the operator compares means under one plan, so start a new one.
                    times.revision = revision
                    times.recent_s.clear()
                if s.step_revision == revision:  # not an iteration the change cut in two
                    times.recent_s.append(seconds)
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
        with self._lock:
            s = self._sessions.get(session)
            for g in self._owned(session, s):
                if g.profiler is not None:
                    if self._profiling_ok(g):
                        # A counter point at each edge, not only every 5 ms: interpolated
                        # across an edge, the counter put part of each computation's energy
                        # in the idle time beside it (blocking power came out +11 %).
                        g.profiler.sampler.sample()
                        g.profiler.instruction_begin(name, t_ns, chunk)
                elif g.granularity == Granularity.INSTRUCTION and g.status != GpuStatus.FAILED:
                    self._switch(g, name, microbatch, chunk)
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
        with self._lock:
            s = self._sessions.get(session)
            for g in self._owned(session, s):
                if g.profiler is not None:
                    if self._profiling_ok(g):
                        g.profiler.sampler.sample()  # a point at the edge, as at its begin
                        g.profiler.instruction_end(msg["name"], t_ns, msg.get("chunk"))
                elif g.granularity == Granularity.INSTRUCTION and g.status != GpuStatus.FAILED:
                    self._prepare_next(g)
        return {"ok": True}

    def disconnected(self, session: ClientSession) -> None:
        """The training process is gone: its instruction-level GPUs go back to default clocks."""
        with self._lock:
            s = self._sessions.pop(session, None)
            if s is None:
                return
            for index in s.gpus:
                g = self._gpus.get(index)
                if g is None or g.session != session:
                    continue
                g.session = None
                if g.profiler is not None:
                    self._poll_profiler(g)
                    if g.profiler.measuring and g.status != GpuStatus.FAILED:
                        g.profiler.interrupt()
                        self._reset_clock(index)
                        self._wait(g, "profiling: the training process disconnected")
                elif g.granularity == Granularity.INSTRUCTION:
                    self._reset_clock(index)
                    self._wait(g, "the training process disconnected")
        self._session_log.log(
            logging.INFO, "disconnected", "training process rank %s disconnected", s.rank
        )

    # -- internals -----------------------------------------------------------------------------

    def _resolve(
        self, a: GpuAssignment, taken: Mapping[int, tuple[GpuInfo, GpuAssignment, StagePlan]]
    ) -> tuple[GpuInfo | None, str]:
        if a.gpu_uuid is not None:
            gpu = self._by_uuid.get(a.gpu_uuid)
            if gpu is None:
                return None, f"no GPU with UUID {a.gpu_uuid} on node {self.node_name}"
            if a.gpu_index is not None and a.gpu_index != gpu.index:
                log.warning(
                    "GPU %s is index %d on this node, not %d as the plan says; using the UUID",
                    a.gpu_uuid,
                    gpu.index,
                    a.gpu_index,
                )
        elif a.gpu_index is None:
            return None, (
                f"GPU {a.gpu_label} is named by its process only; only a Kubernetes-mode agent "
                "can tell its GPU (from the kubelet): name GPUs by gpu_uuid or gpu_index here"
            )
        else:
            found = self._by_index.get(a.gpu_index)
            if found is None:
                return None, (
                    f"no GPU with index {a.gpu_index} on node {self.node_name} "
                    f"({len(self.devices)} GPUs)"
                )
            gpu = found
        if gpu.index in taken:
            other = taken[gpu.index][1]
            return None, (
                f"GPU {a.gpu_label} is GPU index {gpu.index}, already assigned as {other.gpu_label}"
            )
        return gpu, ""

    def _nearest_clock(self, index: int, clock_mhz: int) -> int:
        key = (index, clock_mhz)
        nearest = self._nearest.get(key)
        if nearest is None:
            nearest = self._backend.nearest_supported_sm_clock_mhz(index, clock_mhz)
            self._nearest[key] = nearest
        return nearest

    def _lock_clock(self, gpu: GpuInfo, clock_mhz: int) -> None:
        """Record (first), then lock. Raises GpuError, or OSError if the record fails."""
        self._reset_state.record(gpu, "sm")
        changed = self._backend.lock_sm_clock(gpu.index, clock_mhz)
        self._locked[gpu.index] = clock_mhz
        if changed:
            self.metrics.count_clock_change(gpu.index)

    def _set_clock(self, g: _Gpu, target_mhz: int) -> None:
        """Lock ``g`` at ``target_mhz`` (clamped) and update its status; errors fail ``g``."""
        try:
            applied = self._nearest_clock(g.info.index, target_mhz)
            self._lock_clock(g.info, applied)
        except GpuError as exc:
            self._fail(g, exc.reason, str(exc), target_mhz)
            return
        except OSError as exc:
            self._fail(g, "reset_state", f"cannot record the GPU before locking it: {exc}", None)
            return
        g.target_mhz, g.applied_mhz = target_mhz, applied
        if applied == target_mhz:
            g.status, g.message = GpuStatus.APPLIED, ""
        else:
            g.status = GpuStatus.CLAMPED
            g.message = (
                f"{target_mhz} MHz is not supported by GPU {g.info.index}; clamped to {applied} MHz"
            )

    def _lock_stage(self, g: _Gpu) -> None:
        self._set_clock(g, g.stage_plan.frequency_mhz)
        if g.status == GpuStatus.CLAMPED:
            log.warning("GPU %d: %s", g.info.index, g.message)

    def _prepare_instructions(self, g: _Gpu, old: _Gpu | None) -> None:
        """Instruction granularity: nothing is locked until the training process calls in."""
        try:  # learn the supported clocks now, not on the training process's critical path
            for clock in sorted({i.frequency_mhz for i in g.stage_plan.instructions}):
                self._nearest_clock(g.info.index, clock)
        except GpuError as exc:
            self._fail(g, exc.reason, str(exc), None)
            return
        if old is not None and old.session is not None and old.status != GpuStatus.FAILED:
            # The training process is already in: keep the clock in effect and its place in
            # the schedule; its next computation gets the new plan's clock.
            g.session = old.session
            g.status, g.target_mhz, g.applied_mhz = old.status, old.target_mhz, old.applied_mhz
            g.message = old.message
            # Profiling locks clocks per iteration and keeps no place in the schedule.
            if (
                old.granularity == Granularity.INSTRUCTION
                and old.profiler is None
                and len(old.stage_plan.instructions) == len(g.stage_plan.instructions)
            ):
                g.position, g.aligned = old.position, old.aligned
            else:  # its place is found from its next computation, not counted as a mismatch
                g.aligned = False
            return
        if old is not None:
            g.session = old.session
        self._reset_clock(g.info.index)
        self._wait(g, "waiting for the training process to call in")

    def _switch(self, g: _Gpu, name: str, microbatch: int | None, chunk: int | None) -> None:
        instructions = g.stage_plan.instructions
        pos = g.position

        def matches(i: int) -> bool:
            entry = instructions[i]
            return (
                entry.instruction == name
                and (microbatch is None or entry.microbatch == microbatch)
                and (chunk is None or _chunk(entry.virtual_stage, g.num_stages) == chunk)
            )

        found: int | None = pos if pos < len(instructions) and matches(pos) else None
        if found is None and not g.aligned:
            found = next((i for i in range(len(instructions)) if matches(i)), None)
            if found is None:
                return
        if found is None:
            expected = (
                _describe(
                    instructions[pos].instruction,
                    instructions[pos].microbatch,
                    _chunk(instructions[pos].virtual_stage, g.num_stages)
                    if g.virtual_stages > 1
                    else None,
                )
                if pos < len(instructions)
                else "the end of the iteration"
            )
            order = [*range(pos, len(instructions)), *range(pos)]
            found = next((i for i in order if matches(i)), None)
            self.metrics.count_error("schedule_mismatch")
            self._mismatch_log.warning(
                ("schedule_mismatch", g.info.index),
                "GPU %d: the training process runs %s where the plan expects %s; %s",
                g.info.index,
                _describe(name, microbatch, chunk),
                expected,
                f"resynchronised at position {found}" if found is not None else "not in the plan",
            )
            if found is None:
                return
        g.position, g.aligned = found + 1, True
        self._set_clock(g, instructions[found].frequency_mhz)

    def _prepare_next(self, g: _Gpu) -> None:
        instructions = g.stage_plan.instructions
        if g.position < len(instructions):
            self._set_clock(g, instructions[g.position].frequency_mhz)

    def _fail(self, g: _Gpu, reason: str, message: str, target_mhz: int | None) -> None:
        self._fail_log.log(
            logging.ERROR,
            (reason, g.info.index),
            "GPU %d (%s): %s",
            g.info.index,
            g.info.uuid,
            message,
        )
        self.metrics.count_error(reason)
        _stop_sampling(g)
        g.status = GpuStatus.FAILED
        g.message = f"{reason}: {message}"
        g.target_mhz = target_mhz
        g.applied_mhz = None
        # Do not leave the GPU at a clock of an older plan.
        self._reset_clock(g.info.index)

    def _wait(self, g: _Gpu, message: str) -> None:
        g.status, g.message = GpuStatus.WAITING, message
        g.target_mhz = g.applied_mhz = None
        g.position = 0

    def _reset_clock(self, index: int) -> bool:
        """Undo this agent's lock on GPU ``index``, if any; ``False`` if the reset failed."""
        gpu = self._by_index[index]
        if index not in self._locked and not self._reset_state.is_recorded(gpu, "sm"):
            return True
        try:
            changed = self._backend.reset_sm_clock(index)
        except GpuError as exc:
            log.error("cannot reset the SM clock of GPU %d (%s): %s", index, gpu.uuid, exc)
            self.metrics.count_error(exc.reason)
            return False  # stays recorded: the next start retries
        self._locked.pop(index, None)
        if changed:
            self.metrics.count_clock_change(index)
        self._reset_state.forget(gpu, "sm")
        return True

    def _release(self, indices: set[int], why: str) -> None:
        """Stop managing GPUs ``indices`` and reset their clocks."""
        for index in sorted(indices):
            g = self._gpus.pop(index, None)
            if g is not None:
                log.info("GPU %d (%s) released: %s", index, g.info.uuid, why)
                _stop_sampling(g)
            self._reset_clock(index)

    def _bind(self, key: Hashable, s: _Session, *, takeover: bool) -> None:
        """Match session ``s`` to the GPUs of the plan: by UUID, else by global rank.

        A GPU has one owner, the only session whose requests move its clock and schedule
        position. ``takeover`` (a hello) displaces the previous owner: a restarted training
        process calls in before the dead one's connection is seen closed. Without it (a plan
        change re-matching every session) an owned GPU stays with its owner.
        """
        gpus = self._claimed(s)
        self._release_unclaimed(key, s, gpus)
        mine = []
        for i in gpus:
            g = self._gpus[i]
            owner = g.session
            if owner is not None and owner != key:
                previous = self._sessions.get(owner)
                if previous is None:  # a session this applier no longer knows: stale
                    pass
                elif not takeover:
                    continue
                else:
                    log.warning("GPU %d: a new training process replaces the previous one", i)
                    previous.gpus = [j for j in previous.gpus if j != i]
            g.session = key
            mine.append(i)
        s.gpus = sorted(mine)

    def _claimed(self, s: _Session) -> list[int]:
        """The GPUs of the plan session ``s`` claims: by UUID, else by global rank; never one
        its pod does not own."""
        mine = {
            i: g
            for i, g in self._gpus.items()
            if s.owned_uuids is None or g.info.uuid in s.owned_uuids
        }
        gpus = [i for i, g in mine.items() if g.info.uuid in s.gpu_uuids]
        if not gpus and s.rank is not None:
            gpus = [i for i, g in mine.items() if g.assignment.rank == s.rank]
        return gpus

    def _release_unclaimed(self, key: Hashable, s: _Session, claimed: list[int]) -> None:
        for i in s.gpus:
            g = self._gpus.get(i)
            if i not in claimed and g is not None and g.session == key:
                g.session = None
        s.gpus = [i for i in s.gpus if i in claimed]

    def _owned(self, key: Hashable, s: _Session | None) -> list[_Gpu]:
        """The GPUs session ``key`` drives: bound to it and not taken over since."""
        if s is None:
            return []
        gpus = (self._gpus.get(i) for i in s.gpus)
        return [g for g in gpus if g is not None and g.session == key]

    def _iteration_labels(self, g: _Gpu) -> dict[str, str]:
        """Labels of ``g``'s ``perseus_iteration_seconds`` series, all from the plan."""
        assert self._plan is not None
        a = g.assignment
        return {
            **g.labels(self._plan),
            "gpu": str(g.info.index),
            "uuid": g.info.uuid,
            "rank": "" if a.rank is None else str(a.rank),
        }

    def _prune_metrics(self) -> None:
        """Remove the iteration series of GPUs that left the plan (or whose labels changed),
        and the iteration times of ranks it no longer has."""
        live = (
            {self.metrics.iteration_values(self._iteration_labels(g)) for g in self._gpus.values()}
            if self._plan is not None
            else set()
        )
        for values in self._series - live:
            self.metrics.remove_iteration(values)
        self._series &= live
        self._prune_ranks()

    def _prune_ranks(self) -> None:
        if self._plan is None:
            self._ranks.clear()
            return
        live = {a.rank for a in self._plan.assignments if a.rank is not None}
        for key, s in self._sessions.items():
            if s.rank is not None and self._owned(key, s):
                live.add(s.rank)
        for rank in set(self._ranks) - live:
            del self._ranks[rank]

    def _report_locked(self) -> NodeReport:
        plan = self._plan
        assert plan is not None
        gpus = [
            GpuReport(
                uuid=g.info.uuid,
                index=g.info.index,
                plan=g.assignment.plan,
                stage=g.assignment.stage,
                dp_rank=g.assignment.dp_rank,
                rank=g.assignment.rank,
                target_mhz=g.target_mhz,
                applied_mhz=g.applied_mhz,
                status=g.status,
                message=g.message,
            )
            for _, g in sorted(self._gpus.items())
        ]
        ranks = [
            RankReport(
                rank=rank,
                dp_rank=t.dp_rank,
                pp_rank=t.pp_rank,
                iterations=t.count,
                last_iteration_s=t.recent_s[-1],
                mean_iteration_s=statistics.fmean(t.recent_s),
                revision=t.revision,
            )
            for rank, t in sorted(self._ranks.items())
            if t.recent_s
        ]
        profiling = [
            _profiling_report(g, g.profiler)
            for _, g in sorted(self._gpus.items())
            if g.profiler is not None
        ]
        return NodeReport(
            node=self.node_name,
            job=plan.job,
            namespace=plan.namespace,
            revision=plan.revision,
            granularity=plan.granularity,
            gpus=[*gpus, *self._unresolved],
            ranks=ranks,
            profiling=profiling,
        )

    # -- profiling -----------------------------------------------------------------------------

    def _prepare_profiling(self, g: _Gpu, old: _Gpu | None, spec: ProfilingSpec) -> None:
        """Profiling: sample the energy counter from now on; lock nothing until the training
        process begins an iteration."""
        index = g.info.index
        sampler = self._sampler_factory(g.info, lambda: self._backend.energy_j(index))
        clocks = list(spec.frequencies_mhz)
        error: GpuError | None = None
        try:  # learn the supported clocks now, not on the training process's critical path
            clocks = _distinct_nearest(clocks, lambda clock: self._nearest_clock(index, clock))
        except GpuError as exc:
            error = exc
        if len(clocks) < len(spec.frequencies_mhz):
            log.info(
                "GPU %d: profiling %d of %d scheduled clocks; the others are measured already "
                "at the same nearest supported clock",
                index,
                len(clocks),
                len(spec.frequencies_mhz),
            )
        g.profiler = StageProfiler(
            g.assignment.stage,
            clocks,
            num_stages=g.num_stages,
            virtual_stages=g.virtual_stages,
            iterations_per_frequency=spec.iterations_per_frequency,
            warmup_iterations=spec.warmup_iterations,
            sampler=sampler,
        )
        if old is not None:
            g.session = old.session
        if error is not None:
            self._fail(g, error.reason, str(error), None)
            return
        # No clock of an earlier plan may leak into the measurements.
        self._reset_clock(index)
        self._wait(g, "profiling: waiting for the training process to begin an iteration")
        sampler.start()

    def _profiling_ok(self, g: _Gpu) -> bool:
        """Whether ``g``'s profiling goes on; a failed energy counter fails the GPU."""
        if not g.profiling_active:
            return False
        assert g.profiler is not None
        error = g.profiler.sampler.error
        if error is None:
            return True
        reason = error.reason if isinstance(error, GpuError) else "profiling"
        self._fail(g, reason, f"cannot read the energy counter: {error}", g.target_mhz)
        return False

    def _profile_step_begin(self, g: _Gpu, profiler: StageProfiler, t_ns: int) -> None:
        if not self._profiling_ok(g):
            return
        target = profiler.step_begin(t_ns)
        if target is None:
            self._poll_profiler(g)
            return
        if g.target_mhz != target or g.applied_mhz is None:
            self._set_clock(g, target)
            if g.status == GpuStatus.FAILED or g.applied_mhz is None:
                return
            if g.status == GpuStatus.CLAMPED:
                log.warning("GPU %d: profiling: %s", g.info.index, g.message)
            log.info(
                "GPU %d: profiling stage %d at %d MHz (clock %d of %d)",
                g.info.index,
                profiler.stage,
                g.applied_mhz,
                profiler.frequency_index + 1,
                len(profiler.frequencies_mhz),
            )
        assert g.applied_mhz is not None
        profiler.clock_applied(g.applied_mhz)

    def _finish_measuring(self, g: _Gpu) -> None:
        """The last clock is measured: back to the default clock."""
        assert g.profiler is not None
        # A point after the last iteration, so that it can be computed now unless the counter
        # has not been updated since (then at a later request or report).
        g.profiler.sampler.sample()
        reset = self._reset_clock(g.info.index)
        g.target_mhz = g.applied_mhz = None
        g.status = GpuStatus.APPLIED
        g.message = (
            "profiling: every clock measured; SM clock reset"
            if reset
            else "profiling: every clock measured; the SM clock could not be reset"
        )
        log.info("GPU %d: %s", g.info.index, g.message)

    def _poll_profiler(self, g: _Gpu) -> None:
        """Compute what the energy samples now allow; stop sampling once done."""
        p = g.profiler
        if p is None or g.status == GpuStatus.FAILED or g.profile_reported:
            return
        if not p.done:
            if not self._profiling_ok(g):
                return
            p.poll()
            if not p.done:
                return
        p.sampler.stop()
        g.profile_reported = True
        blocking = p.blocking_power_w
        log.info(
            "GPU %d (%s): profiling of stage %d done: %d iterations measured, %d dropped, "
            "blocking power %s; profile:\n%s",
            g.info.index,
            g.info.uuid,
            p.stage,
            p.measured_iterations,
            p.dropped_iterations,
            "unknown" if blocking is None else f"{blocking:.3f} W",
            p.to_csv().rstrip("\n"),
        )


def _default_sampler(gpu: GpuInfo, read_energy_j: Callable[[], float]) -> EnergySampler:
    return EnergySampler(read_energy_j, name=f"perseus-energy-gpu{gpu.index}")


def _chunk(virtual_stage: int | None, num_stages: int) -> int:
    """The rank-local chunk of a plan entry: model stage ``v * P + p`` is chunk ``v``."""
    return 0 if virtual_stage is None else virtual_stage // num_stages


def _describe(name: str, microbatch: int | None, chunk: int | None) -> str:
    where = "" if chunk is None else f" on chunk {chunk}"
    return f"{name} of microbatch {'?' if microbatch is None else microbatch}{where}"


def _stop_sampling(g: _Gpu) -> None:
    if g.profiler is not None:
        g.profiler.sampler.stop()


def _distinct_nearest(clocks: Sequence[int], nearest: Callable[[int], int]) -> list[int]:
    """The scheduled clocks whose nearest supported clock differs from every earlier one's: a
    sweep wider than the GPU's range would otherwise measure its top clock again and again."""
    seen: set[int] = set()
    kept = []
    for clock in clocks:
        supported = nearest(clock)
        if supported not in seen:
            seen.add(supported)
            kept.append(clock)
    return kept


def _profiling_report(g: _Gpu, p: StageProfiler) -> GpuProfilingReport:
    done = p.done and g.status != GpuStatus.FAILED
    return GpuProfilingReport(
        uuid=g.info.uuid,
        index=g.info.index,
        stage=p.stage,
        rank=g.assignment.rank,
        frequencies_mhz=list(p.frequencies_mhz),
        applied_mhz=list(p.applied_mhz),
        frequency_index=p.frequency_index,
        measured_iterations=p.measured_iterations,
        dropped_iterations=p.dropped_iterations,
        done=done,
        rows=p.rows() if done else [],
        blocking_power_w=p.blocking_power_w if done else None,
        blocking_s=p.blocking_s if done else 0.0,
    )


def unresolved_gpu_report(plan: NodePlan, a: GpuAssignment, message: str) -> GpuReport:
    """The report of an assignment no GPU of this node could take (``message`` says why)."""
    stage_plan = plan.plans[a.plan].stages[a.stage]
    return GpuReport(
        uuid=a.gpu_uuid,
        index=a.gpu_index,
        plan=a.plan,
        stage=a.stage,
        dp_rank=a.dp_rank,
        rank=a.rank,
        target_mhz=(
            None if plan.profiling is not None else _planned_target(plan.granularity, stage_plan)
        ),
        applied_mhz=None,
        status=GpuStatus.FAILED,
        message=message,
    )


def _planned_target(granularity: Granularity, stage_plan: StagePlan) -> int | None:
    return stage_plan.frequency_mhz if granularity == Granularity.STAGE else None


def _plan_name(plan: NodePlan) -> str:
    return f"{plan.namespace}/{plan.job}"


def _summary(report: NodeReport) -> str:
    counts: dict[str, int] = {}
    for g in report.gpus:
        counts[g.status] = counts.get(g.status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no GPUs"
