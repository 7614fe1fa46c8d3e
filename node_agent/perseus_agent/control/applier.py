"""Applies a :class:`~perseus_api.NodePlan` to the GPUs of this node.

``Stage`` granularity locks every assigned GPU's SM clock to its stage's clock when the plan
arrives. ``Instruction`` granularity locks nothing until the training process on the GPU calls
in over the local socket (see :class:`PlanApplier` as the local server's handler): every
``instruction_begin`` locks the clock of the next computation of the stage, in schedule order
(:mod:`perseus_agent.control.instruction_clocks`). A plan with ``profiling`` set profiles instead
(:mod:`perseus_agent.control.profiling_session`).

A clock the GPU does not support is clamped to the nearest supported one and reported as
``Clamped``; a GPU error affects that GPU only (:mod:`perseus_agent.control.gpu_clocks`). GPUs that
leave the plan, and every GPU on :meth:`PlanApplier.clear`, get their clocks reset. Every GPU is
recorded in the :class:`~perseus_agent.clocks.reset_state.ResetState` before its clock is first
locked, so a killed agent's locks are undone when it restarts.

:class:`PlanApplier` composes the parts: the plan's state (:mod:`perseus_agent.control.plan_state`),
the clocks, the profiling, the iteration statistics (:mod:`perseus_agent.control.iteration_stats`)
and the answers to the training processes (:mod:`perseus_agent.control.training_requests`); what is
left here is taking a plan (resolving its GPUs, releasing the ones it drops) and reporting on it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.gpu_clocks import GpuClocks
from perseus_agent.control.gpu_power_limits import GpuPowerLimits
from perseus_agent.control.instruction_clocks import InstructionClocks
from perseus_agent.control.iteration_stats import IterationStats
from perseus_agent.control.plan_state import GpuState, PlanState
from perseus_agent.control.profiling_session import GpuProfiling, SamplerFactory, profiling_report
from perseus_agent.control.training_requests import TrainingRequests
from perseus_agent.errors import GpuError, PlanError
from perseus_agent.exporter import AgentMetrics, ManagedGpu
from perseus_agent.gpu.base import GpuBackend, GpuInfo
from perseus_api.node_plan import GpuAssignment, NodePlan

# The report models are perseus_api's (the operator reads them too); re-exported here, where
# the agent builds them.
from perseus_api.node_report import (
    GpuReport,
    GpuStatus,
    NodeReport,
)
from perseus_api.plan import Granularity, StagePlan

if TYPE_CHECKING:
    from perseus_agent.serving.client_dispatch import ClientSession
    from perseus_client.protocol import (
        HelloRequest,
        InstructionBeginRequest,
        InstructionEndRequest,
        StepBeginRequest,
        StepEndRequest,
    )

__all__ = ["PlanApplier", "SamplerFactory"]

log = logging.getLogger(__name__)


class PlanApplier:
    """Applies node plans to ``backend``'s GPUs; also the local server's request handler.

    Thread-safe: plans arrive on the agent loop, training processes call in on server threads.

    Args:
        backend: The GPUs of this node.
        reset_state: Where GPUs are recorded before their clocks are locked.
        node_name: This node; plans for another node are refused.
        metrics: Counters to update; a private set by default.
        sampler_factory: Makes the energy sampler of a profiled GPU (default: an
            :class:`~perseus_agent.profiling.energy_sampler.EnergySampler` sampling every 5 ms in a
            thread); the applier starts it and stops it once the GPU's profiling is over.

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
        self.node_name = node_name
        self.metrics = metrics if metrics is not None else AgentMetrics(node_name)
        self.devices: list[GpuInfo] = backend.devices()
        self._backend = backend
        self._by_uuid = {g.uuid: g for g in self.devices}
        self._by_index = {g.index: g for g in self.devices}
        self._state = PlanState(node_name)
        self._lock = self._state.lock
        self._unresolved: list[GpuReport] = []
        self._clocks = GpuClocks(backend, reset_state, self.metrics, self.devices)
        self._power = GpuPowerLimits(backend, reset_state, self.metrics, self.devices)
        self._instructions = InstructionClocks(self._clocks, self.metrics)
        self._profiling = GpuProfiling(backend, self._clocks, sampler_factory)
        self._iterations = IterationStats(self._state, self.metrics)
        self._requests = TrainingRequests(
            self._state, self._clocks, self._instructions, self._profiling, self._iterations
        )

    # -- plans ---------------------------------------------------------------------------------

    @property
    def plan(self) -> NodePlan | None:
        """The plan being applied, if any."""
        return self._state.plan

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
        state = self._state
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

            self._release(self._held() - set(wanted), "not in the new plan")

            for index, (gpu, a, stage_plan) in sorted(wanted.items()):
                old = state.gpus.get(index)
                if (
                    old is not None
                    and old.status != GpuStatus.FAILED
                    and old.same_plan(granularity, stage_plan, profiling, a.stage)
                ):
                    old.assignment = a
                    continue
                if old is not None:
                    old.stop_sampling()
                pipeline = node_plan.plans[a.plan]
                g = GpuState(
                    gpu,
                    a,
                    stage_plan,
                    granularity,
                    num_stages=pipeline.num_stages,
                    virtual_stages=pipeline.virtual_stages,
                    profiling=profiling,
                )
                state.gpus[index] = g
                if profiling is not None:
                    self._profiling.prepare(g, old, profiling)
                elif granularity == Granularity.STAGE:
                    if old is not None and old.session is not None:
                        g.session = old.session
                    self._clocks.lock_stage(g)
                else:
                    self._instructions.prepare(g, old)
            for index, (_, a, _) in sorted(wanted.items()):
                self._power.apply(state.gpus[index], a.power_limit_w)

            state.plan = node_plan
            self._unresolved = unresolved
            # Owners first let go of the GPUs they no longer claim; then newest first: a GPU
            # nobody owns goes to the latest hello that claims it, as it would have at that
            # hello, and a GPU with an owner keeps it.
            for key, session in state.sessions.items():
                state.release_unclaimed(key, session, state.claimed(session))
            for key, session in reversed(state.sessions.items()):
                state.bind(key, session, takeover=False)
            self._iterations.prune()
            report = self._report_locked()
        log.info(
            "applied plan %s revision %d: %s",
            _plan_name(node_plan),
            node_plan.revision,
            _summary(report),
        )
        return report

    def clear(self) -> None:
        """The plan is gone: reset every clock and power limit this agent changed."""
        state = self._state
        with self._lock:
            self._release(self._held(), "plan removed")
            for session in state.sessions.values():
                session.gpus = []
            if state.plan is not None:
                log.info("cleared plan %s; clocks reset", _plan_name(state.plan))
            state.plan = None
            self._unresolved = []
            self._iterations.prune()

    def report(self) -> NodeReport | None:
        """The current state of the plan, or ``None`` without a plan."""
        with self._lock:
            if self._state.plan is None:
                return None
            for g in self._state.gpus.values():
                self._profiling.poll(g)
            return self._report_locked()

    def locked_gpus(self) -> list[int]:
        """Indices of the GPUs whose clocks (or power limits) this agent changed and has not
        reset."""
        with self._lock:
            return sorted({*self._clocks.locked_gpus(), *self._power.limited()})

    def managed_gpus(self) -> dict[int, ManagedGpu]:
        """Labels and target clock of the GPUs under the plan, by index (for the exporter)."""
        with self._lock:
            plan = self._state.plan
            if plan is None:
                return {}
            return {
                i: ManagedGpu(labels=g.labels(plan), target_mhz=g.target_mhz)
                for i, g in self._state.gpus.items()
            }

    # -- local server handler (see TrainingRequests) -------------------------------------------

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
        return self._requests.hello(session, msg, received_ns, owned_uuids=owned_uuids)

    def step_begin(
        self, session: ClientSession, msg: StepBeginRequest, t_ns: int
    ) -> dict[str, Any]:
        """An iteration begins: back to the first computation of the stage, and its clock."""
        return self._requests.step_begin(session, msg, t_ns)

    def step_end(self, session: ClientSession, msg: StepEndRequest, t_ns: int) -> dict[str, Any]:
        """An iteration ends: record its time (``perseus_iteration_seconds``)."""
        return self._requests.step_end(session, msg, t_ns)

    def instruction_begin(
        self, session: ClientSession, msg: InstructionBeginRequest, t_ns: int
    ) -> dict[str, Any]:
        """A computation begins: lock the clock the plan gives it; reply with the clock in
        effect."""
        return self._requests.instruction_begin(session, msg, t_ns)

    def instruction_end(
        self, session: ClientSession, msg: InstructionEndRequest, t_ns: int
    ) -> dict[str, Any]:
        """A computation ends: lock the clock of the plan's next one already."""
        return self._requests.instruction_end(session, msg, t_ns)

    def disconnected(self, session: ClientSession) -> None:
        """The training process is gone: its instruction-level GPUs go back to default clocks."""
        self._requests.disconnected(session)

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

    def _held(self) -> set[int]:
        return {*self._state.gpus, *self._clocks.locked(), *self._power.limited()}

    def _release(self, indices: set[int], why: str) -> None:
        """Stop managing GPUs ``indices``, reset their clocks and restore their power limits."""
        for index in sorted(indices):
            g = self._state.gpus.pop(index, None)
            if g is not None:
                log.info("GPU %d (%s) released: %s", index, g.info.uuid, why)
                g.stop_sampling()
            self._clocks.reset_clock(index)
            self._power.restore(index)

    def _energy_j(self, index: int) -> float | None:
        """The GPU's energy counter for the report (the operator's power budgets derive the
        draw from it); None when the GPU cannot say (the report goes on without it)."""
        try:
            energy_j = self._backend.energy_j(index)
        except GpuError:
            return None
        return energy_j if energy_j >= 0 else None

    def _report_locked(self) -> NodeReport:
        plan = self._state.plan
        assert plan is not None
        gpus = sorted(self._state.gpus.items())
        return NodeReport(
            node=self.node_name,
            job=plan.job,
            namespace=plan.namespace,
            revision=plan.revision,
            granularity=plan.granularity,
            gpus=[
                *(_gpu_report(g, self._energy_j(g.info.index)) for _, g in gpus),
                *self._unresolved,
            ],
            ranks=self._iterations.rank_reports(),
            profiling=[profiling_report(g, g.profiler) for _, g in gpus if g.profiler is not None],
        )


def _gpu_report(g: GpuState, energy_j: float | None) -> GpuReport:
    return GpuReport(
        energy_j=energy_j,
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
        power_limit_w=g.power_limit_w,
        power_limit_message=g.power_limit_message,
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
