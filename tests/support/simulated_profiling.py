"""The plan applier profiling emulated GPUs in simulated time, with training ranks calling it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.gpu.base import GpuInfo
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.profiling.energy_sampler import EnergySampler
from perseus_agent.serving.client_dispatch import ClientSession
from perseus_api.node_plan import NodePlan
from perseus_api.profile import parse_profile
from support.applier_calls import NODE, STAGE0_SCHEDULE, hello, pipeline_fields, session
from support.profile_table import BLOCKING_W, PROFILE_CSV
from support.profiler_time import SimTime

EMU_NODE = NODE


class RecordingSampler(EnergySampler):
    """A manually driven sampler that remembers being stopped."""

    stopped = False

    def stop(self) -> None:
        self.stopped = True
        super().stop()


class Profiling:
    """An applier over emulated GPUs in simulated time, and training ranks calling it.

    Every sampler the applier makes samples on every ``period_ns`` of simulated time and, with
    ``at_power_changes``, whenever a GPU's power changes (closely enough to be exact).
    """

    def __init__(
        self,
        tmp_path: Path,
        num_gpus: int = 2,
        *,
        period_ns: int = 1_000_000,
        at_power_changes: bool = True,
    ) -> None:
        self.period_ns = period_ns
        self.at_power_changes = at_power_changes
        self.sim = SimTime()
        self.gpus = EmulatedBackend(
            num_gpus,
            parse_profile(PROFILE_CSV, "test-profile"),
            blocking_power_w=BLOCKING_W,
            node_name=EMU_NODE,
            clock=self.sim.now_s,
        )
        self.state = ResetState(tmp_path / "state")
        self.samplers: dict[int, RecordingSampler] = {}
        self.applier = PlanApplier(self.gpus, self.state, NODE, sampler_factory=self._sampler)
        self.next_sample_ns = self.sim.ns
        self.locks: list[tuple[int, int, bool]] = []  # (gpu, clock, recorded before)
        lock = self.gpus.lock_sm_clock

        def recorded_lock(index: int, clock_mhz: int) -> bool:
            recorded = self.state.is_recorded(self.gpus.devices()[index], "sm")
            self.locks.append((index, clock_mhz, recorded))
            return lock(index, clock_mhz)

        self.gpus.lock_sm_clock = recorded_lock  # type: ignore[method-assign]

    def _sampler(self, gpu: GpuInfo, read: Callable[[], float]) -> EnergySampler:
        sampler = RecordingSampler(read, interval_s=None, time_ns=self.sim.now_ns)
        self.samplers[gpu.index] = sampler
        return sampler

    def uuid(self, index: int) -> str:
        return self.gpus.devices()[index].uuid

    def plan(
        self,
        assignments: list[tuple[int, int]],
        frequencies_mhz: list[int],
        *,
        iterations: int = 2,
        warmup: int = 1,
        revision: int = 1,
    ) -> NodePlan:
        return NodePlan.model_validate(
            {
                "node": NODE,
                "namespace": "ml",
                "job": "gpt3",
                "revision": revision,
                "granularity": "Instruction",
                "plans": {"tmin": pipeline_fields()},
                "assignments": [
                    {"gpu_uuid": self.uuid(i), "plan": "tmin", "stage": stage, "rank": i}
                    for i, stage in assignments
                ],
                "profiling": {
                    "frequencies_mhz": frequencies_mhz,
                    "iterations_per_frequency": iterations,
                    "warmup_iterations": warmup,
                },
            }
        )

    def connect(self, index: int, connection_id: int | None = None) -> ClientSession:
        s = session(index + 1 if connection_id is None else connection_id)
        hello(self.applier, s, uuids=[self.uuid(index)], rank=index)
        return s

    def advance(self, duration_ns: int) -> None:
        end = self.sim.ns + duration_ns
        while self.next_sample_ns <= end:
            self.sim.ns = max(self.sim.ns, self.next_sample_ns)
            self.sample()
            self.next_sample_ns += self.period_ns
        self.sim.ns = end

    def sample(self) -> None:
        for sampler in self.samplers.values():
            sampler.sample()

    def iteration(self, s: ClientSession, index: int, stage: int) -> list[int | None]:
        """One iteration of the rank on GPU ``index``; the clocks the agent replied."""
        a = self.applier
        a.step_begin(s, {"op": "step_begin", "step": 0}, self.sim.ns)
        self.advance(3_000_000)
        clocks = []
        for name, mb, _ in STAGE0_SCHEDULE:
            reply = a.instruction_begin(
                s,
                {"op": "instruction_begin", "name": name, "microbatch": mb},  # type: ignore[typeddict-item]
                self.sim.ns,
            )
            clocks.append(reply["sm_clock_mhz"])
            self.gpus.set_activity(index, stage, name)
            if self.at_power_changes:
                self.sample()
            self.advance(round(self.gpus.instruction_time_s(index, stage, name) * 1e9))
            self.gpus.set_activity(index, None, None)
            if self.at_power_changes:
                self.sample()
            a.instruction_end(s, {"op": "instruction_end", "name": name}, self.sim.ns)  # type: ignore[typeddict-item]
            self.advance(2_000_000)
        a.step_end(s, {"op": "step_end", "step": 0}, self.sim.ns)
        return clocks
