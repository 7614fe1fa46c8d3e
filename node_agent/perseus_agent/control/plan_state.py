"""What the plan applier knows of the GPUs of its plan and of the training processes calling in.

:class:`PlanState` is what the parts of :class:`~perseus_agent.control.applier.PlanApplier` share
(the plan, its GPUs, the connected processes), always under its lock. It also matches the
processes to the GPUs they drive (:meth:`PlanState.bind`): a GPU has one owner, the only
process whose requests move its clock and its place in the schedule.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

from perseus_agent.gpu.base import GpuInfo
from perseus_agent.profiling.profiler import StageProfiler
from perseus_api.node_plan import GpuAssignment, NodePlan, ProfilingSpec
from perseus_api.node_report import GpuStatus
from perseus_api.plan import Granularity, StagePlan

__all__ = ["GpuState", "PlanState", "TrainingProcess"]

log = logging.getLogger(__name__)


@dataclass
class GpuState:
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
    power_limit_w: float | None = None
    """The power limit the agent set on the GPU for the plan (watts; ``None``: none)."""
    power_limit_message: str = ""
    """Why the plan's power limit was not set as written."""

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

    def stop_sampling(self) -> None:
        if self.profiler is not None:
            self.profiler.sampler.stop()


@dataclass
class TrainingProcess:
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
class PlanState:
    """The plan being applied, its GPUs by index and the training processes by session.

    Not thread-safe by itself: every access holds ``lock`` (plans arrive on the agent loop,
    training processes call in on server threads).
    """

    node_name: str
    lock: threading.RLock = field(default_factory=threading.RLock)
    plan: NodePlan | None = None
    gpus: dict[int, GpuState] = field(default_factory=dict)
    sessions: dict[Hashable, TrainingProcess] = field(default_factory=dict)

    def bind(self, key: Hashable, s: TrainingProcess, *, takeover: bool) -> None:
        """Match session ``s`` to the GPUs of the plan: by UUID, else by global rank.

        A GPU has one owner, the only session whose requests move its clock and schedule
        position. ``takeover`` (a hello) displaces the previous owner: a restarted training
        process calls in before the dead one's connection is seen closed. Without it (a plan
        change re-matching every session) an owned GPU stays with its owner.
        """
        gpus = self.claimed(s)
        self.release_unclaimed(key, s, gpus)
        mine = []
        for i in gpus:
            g = self.gpus[i]
            owner = g.session
            if owner is not None and owner != key:
                previous = self.sessions.get(owner)
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

    def claimed(self, s: TrainingProcess) -> list[int]:
        """The GPUs of the plan session ``s`` claims: by UUID, else by global rank; never one
        its pod does not own."""
        mine = {
            i: g
            for i, g in self.gpus.items()
            if s.owned_uuids is None or g.info.uuid in s.owned_uuids
        }
        gpus = [i for i, g in mine.items() if g.info.uuid in s.gpu_uuids]
        if not gpus and s.rank is not None:
            gpus = [i for i, g in mine.items() if g.assignment.rank == s.rank]
        return gpus

    def release_unclaimed(self, key: Hashable, s: TrainingProcess, claimed: list[int]) -> None:
        for i in s.gpus:
            g = self.gpus.get(i)
            if i not in claimed and g is not None and g.session == key:
                g.session = None
        s.gpus = [i for i in s.gpus if i in claimed]

    def owned(self, key: Hashable, s: TrainingProcess | None) -> list[GpuState]:
        """The GPUs session ``key`` drives: bound to it and not taken over since."""
        if s is None:
            return []
        gpus = (self.gpus.get(i) for i in s.gpus)
        return [g for g in gpus if g is not None and g.session == key]
