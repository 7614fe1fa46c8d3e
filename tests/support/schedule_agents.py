"""Node agents for schedules beyond 1F1B, played by the agent's own parts in simulated time.

:class:`ScheduleAgents` follows a job's node plans on kmock like
:class:`operator_harness.SimulatedAgents`, but each node is the real agent's
:class:`~perseus_agent.control.applier.PlanApplier` (its profiler, its plan matching) on emulated
GPUs whose computations take the ``truth`` profile's time and power, and every training rank
is played through the applier's local-server handler with protocol-v2 requests
(:mod:`perseus_client.protocol`): the rank runs its stage's computations in ``order_of``'s
order (torch's, where the test has torch), naming each one's chunk with virtual stages. The
node plan's status is what the agent writes (:func:`perseus_agent.plans.plan_status.report_status`).

Time is simulated (the sampler is sampled by hand at every edge, as in the profiler's unit
tests), so a whole profiling sweep takes milliseconds and the measurements are exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.gpu.base import GpuInfo
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.ownership.gpu_ownership import LocalRankIndexOwnership
from perseus_agent.plans.plan_status import report_status
from perseus_agent.profiling.energy_sampler import EnergySampler
from perseus_agent.serving.client_dispatch import ClientSession
from perseus_api import resources
from perseus_api.node_plan import GpuAssignment, NodePlan
from perseus_api.profile import Profile
from perseus_api.schedule import Step
from perseus_client import protocol
from support.operator_harness import ReportLoop

MS = 1_000_000
BLOCKING_W = 80.0
OrderOf = Callable[[int], Sequence[Step]]
"""The computations pipeline stage ``p``'s training process runs in one iteration, in order."""


class _SimTime:
    def __init__(self) -> None:
        self.ns = 5_000 * 10**9

    def now_ns(self) -> int:
        return self.ns

    def now_s(self) -> float:
        return self.ns / 1e9


class _Node:
    """One node's agent: a PlanApplier on ``gpus`` emulated GPUs, in simulated time."""

    def __init__(self, name: str, gpus: int, truth: Profile, state_dir: Path) -> None:
        self.sim = _SimTime()
        self.backend = EmulatedBackend(
            gpus, truth, blocking_power_w=BLOCKING_W, node_name=name, clock=self.sim.now_s
        )
        self.samplers: dict[int, EnergySampler] = {}
        state_dir.mkdir(parents=True, exist_ok=True)
        self.applier = PlanApplier(
            self.backend, ResetState(state_dir), name, sampler_factory=self._sampler
        )
        self.revision: int | None = None
        self.sessions: dict[int, ClientSession] = {}
        self.clocks: dict[int, list[int | None]] = {}
        """Per global rank: the clocks the agent gave the last iteration's computations."""

    def _sampler(self, gpu: GpuInfo, read_energy_j: Callable[[], float]) -> EnergySampler:
        sampler = EnergySampler(read_energy_j, interval_s=None, time_ns=self.sim.now_ns)
        self.samplers[gpu.index] = sampler
        return sampler

    def _sample(self) -> None:
        for sampler in self.samplers.values():
            sampler.sample()

    def _session(self, plan: NodePlan, a: GpuAssignment) -> ClientSession:
        assert a.rank is not None and a.local_rank is not None
        session = self.sessions.get(a.rank)
        if session is None:
            session = self.sessions[a.rank] = ClientSession(a.rank + 1, None, None, None, 0)
            uuid = self.backend.devices()[a.local_rank].uuid
            hello = protocol.hello_request(
                rank=a.rank,
                local_rank=a.local_rank,
                gpu_uuids=[uuid],
                pid=1000 + a.rank,
                job=plan.job,
                namespace=plan.namespace,
                pod=a.pod,
            )
            reply = self.applier.hello(session, hello, self.sim.ns)
            assert reply.get("managed"), reply
        return session

    def iteration(self, plan: NodePlan, a: GpuAssignment, order: Sequence[Step], step: int) -> None:
        """One training iteration of ``a``'s rank: every computation of ``order``, each taking
        its model stage's time at the clock the agent locked (the GPU waits in between)."""
        session = self._session(plan, a)
        assert a.rank is not None and a.local_rank is not None
        index = a.local_rank
        virtual = plan.plans[a.plan].virtual_stages > 1
        num_stages = plan.plans[a.plan].num_stages
        clocks: list[int | None] = []
        self.applier.step_begin(session, protocol.step_begin_request(step), self.sim.ns)
        for s in order:
            chunk = s.virtual_stage // num_stages if virtual else None
            self.sim.ns += 3 * MS  # waiting on the neighbours
            self._sample()
            begin = protocol.instruction_begin_request(s.instruction, s.microbatch, chunk)
            reply = self.applier.instruction_begin(session, begin, self.sim.ns)
            clocks.append(reply.get("sm_clock_mhz"))
            self.backend.set_activity(index, s.virtual_stage, s.instruction)
            self._sample()
            self.sim.ns += round(
                self.backend.instruction_time_s(index, s.virtual_stage, s.instruction) * 1e9
            )
            self.backend.set_activity(index, None, None)
            self._sample()
            end = protocol.instruction_end_request(s.instruction, chunk)
            self.applier.instruction_end(session, end, self.sim.ns)
        self.sim.ns += 3 * MS
        self._sample()
        self.applier.step_end(session, protocol.step_end_request(step), self.sim.ns)
        self.clocks[a.rank] = clocks

    def follow(self, plan: NodePlan, order_of: OrderOf) -> dict[str, Any]:
        """Apply ``plan`` (once per revision) and run its ranks: through the whole profiling
        sweep when it profiles, else two iterations; the node plan's status."""
        if plan.revision != self.revision:
            bound = LocalRankIndexOwnership().bind(plan, self.backend.devices()).plan
            self.applier.apply(bound)
            self.revision = plan.revision
            for a in plan.assignments:
                order = order_of(a.stage)
                if plan.profiling is not None:
                    for step in range(10_000):
                        if self._profiled(a):
                            break
                        self.iteration(plan, a, order, step)
                else:
                    for step in range(2):
                        self.iteration(plan, a, order, step)
        report = self.applier.report()
        assert report is not None
        return report_status(report)

    def _profiled(self, a: GpuAssignment) -> bool:
        report = self.applier.report()
        assert report is not None
        return any(p.done for p in report.profiling if p.rank == a.rank)


class ScheduleAgents(ReportLoop):
    """The agents of every node of ``job`` in ``namespace``, in a thread (see the module).

    ``truth``: the emulated GPUs' profile, in the schedule's form (``P * V`` model stages for
    interleaved 1F1B, split backwards for ZB-H1); ``gpus_per_node``: emulated GPUs a node has.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        job: str,
        truth: Profile,
        order_of: OrderOf,
        state_dir: Path,
        *,
        gpus_per_node: int,
        period_s: float = 0.2,
    ) -> None:
        self.api, self.namespace, self.job = api, namespace, job
        self.truth, self.order_of, self.state_dir = truth, order_of, state_dir
        self.gpus_per_node, self.period_s = gpus_per_node, period_s
        self.nodes: dict[str, _Node] = {}
        super().__init__()

    def _report_all(self) -> None:
        objects = self.api.list_namespaced_custom_object(
            resources.GROUP, resources.VERSION, self.namespace, resources.NODE_PLAN_PLURAL
        )["items"]
        for obj in objects:
            plan = resources.parse_node_plan_object(obj)
            if plan.job != self.job:
                continue
            node = self.nodes.get(plan.node)
            if node is None:
                node = self.nodes[plan.node] = _Node(
                    plan.node, self.gpus_per_node, self.truth, self.state_dir / plan.node
                )
            status = node.follow(plan, self.order_of)
            self.api.patch_namespaced_custom_object_status(
                resources.GROUP,
                resources.VERSION,
                self.namespace,
                resources.NODE_PLAN_PLURAL,
                obj["metadata"]["name"],
                {"status": status},
            )
