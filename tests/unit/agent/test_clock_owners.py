"""Clocks the agent did not set (issue 17, item 3): an administrator's lock is found at start,
left alone by plans and their release unless the agent is told to override it (then put back),
and the GPUs' clock event reasons are exported. Against emulated GPUs and the plan applier;
the NVML side through the real bindings is in ``test_clock_owners_nvml.py``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client.samples import Sample

from perseus_agent.clocks.clock_owners import (
    ClockOwnerGuard,
    ForeignClockPolicy,
    ForeignClocks,
    classify,
)
from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.errors import GpuForeignClocksError
from perseus_agent.exporter import AgentMetrics, GpuCollector
from perseus_agent.gpu.base import CLOCK_EVENT_REASONS
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.serving.client_dispatch import ClientSession
from perseus_api.node_plan import NodePlan
from perseus_api.node_report import GpuStatus
from perseus_api.profile import load_profile
from support.factories import pipeline_plan_fields

REPO = Path(__file__).resolve().parents[3]
PROFILE = REPO / "operator" / "perseus_planner" / "profiles" / "gpt3-175b+a100_sxm_bf16.csv"
NODE = "node-1"
ADMIN_MHZ = 1110  # an administrator's nvidia-smi -lgc 1110,1110 on GPU 1
USER_DEFINED = CLOCK_EVENT_REASONS["user_defined_clocks"]
POWER_CAP = CLOCK_EVENT_REASONS["sw_power_cap"]


def _plan(stage_mhz: int = 900, granularity: str = "Stage") -> NodePlan:
    fields = pipeline_plan_fields(num_stages=2, num_microbatches=2)
    for stage in fields["stages"]:
        stage["frequency_mhz"] = stage_mhz
    return NodePlan.model_validate(
        {
            "node": NODE,
            "namespace": "ml",
            "job": "gpt3",
            "revision": 1,
            "granularity": granularity,
            "plans": {"tmin": fields},
            "assignments": [
                {"gpu_index": 0, "plan": "tmin", "stage": 0},
                {"gpu_index": 1, "plan": "tmin", "stage": 1},
            ],
        }
    )


@pytest.fixture
def gpus() -> EmulatedBackend:
    return EmulatedBackend(2, load_profile(PROFILE), blocking_power_w=83.64, node_name=NODE)


def _agent(
    gpus: EmulatedBackend, tmp_path: Path, policy: ForeignClockPolicy
) -> tuple[ClockOwnerGuard, PlanApplier]:
    """What the agent's start does: recover its own record, survey, then apply through the
    guard."""
    state = ResetState(tmp_path)
    state.recover(gpus)
    guard = ClockOwnerGuard(gpus, policy)
    guard.survey(gpus.devices())
    return guard, PlanApplier(guard, state, NODE)


# -- the decision --------------------------------------------------------------------------------


def test_classify_tells_locked_from_application_clocks_from_defaults() -> None:
    idle = CLOCK_EVENT_REASONS["gpu_idle"]
    assert classify(idle, 210, (1410, 1410)) is None
    assert classify(POWER_CAP, 1200, (1410, 1410)) is None  # a power cap is nobody's lock
    assert classify(USER_DEFINED | POWER_CAP, 1110, (1410, 1410)) == ForeignClocks("locked", 1110)
    assert classify(USER_DEFINED, 1110, None) == ForeignClocks("locked", 1110)
    assert classify(0, 1200, (1200, 1410)) == ForeignClocks("applications", 1200, 1200)
    assert classify(USER_DEFINED, 1200, (1200, 1410)) == ForeignClocks("applications", 1200, 1200)


# -- leave (the default) ---------------------------------------------------------------------------


def test_an_administrators_lock_is_left_alone_and_survives_the_plan(
    gpus: EmulatedBackend, tmp_path: Path
) -> None:
    gpus.lock_sm_clock(1, ADMIN_MHZ)  # before the agent starts: not in its record
    guard, applier = _agent(gpus, tmp_path, ForeignClockPolicy.LEAVE)
    assert guard.foreign() == {1: ForeignClocks("locked", ADMIN_MHZ)}

    report = applier.apply(_plan())
    by_index = {g.index: g for g in report.gpus}
    assert (by_index[0].status, by_index[0].applied_mhz) == (GpuStatus.APPLIED, 900)
    assert by_index[1].status == GpuStatus.FAILED
    assert by_index[1].message.startswith("foreign_clocks: GPU 1: clocks are locked")
    assert "--foreign-clocks=override" in by_index[1].message
    assert applier.metrics.error_count("foreign_clocks") == 1
    assert gpus.locked_sm_clock_mhz(1) == ADMIN_MHZ

    applier.clear()  # releasing the plan resets Perseus's lock only
    assert gpus.locked_sm_clock_mhz(0) is None
    assert gpus.locked_sm_clock_mhz(1) == ADMIN_MHZ
    assert applier.locked_gpus() == []
    with pytest.raises(GpuForeignClocksError):
        guard.lock_sm_clock(1, 900)


def test_the_agents_own_leftover_lock_is_not_taken_for_an_administrators(
    gpus: EmulatedBackend, tmp_path: Path
) -> None:
    state = ResetState(tmp_path)
    state.record(gpus.devices()[1], "sm")  # a killed agent's lock, in its record
    gpus.lock_sm_clock(1, 855)
    guard, applier = _agent(gpus, tmp_path, ForeignClockPolicy.LEAVE)
    assert guard.foreign() == {}
    assert {g.index: g.status for g in applier.apply(_plan()).gpus} == {
        0: GpuStatus.APPLIED,
        1: GpuStatus.APPLIED,
    }


# -- override --------------------------------------------------------------------------------------


def test_override_locks_and_puts_the_administrators_lock_back(
    gpus: EmulatedBackend, tmp_path: Path
) -> None:
    gpus.lock_sm_clock(1, ADMIN_MHZ)
    guard, applier = _agent(gpus, tmp_path, ForeignClockPolicy.OVERRIDE)
    report = applier.apply(_plan())
    assert {g.index: (g.status, g.applied_mhz) for g in report.gpus} == {
        0: (GpuStatus.APPLIED, 900),
        1: (GpuStatus.APPLIED, 900),
    }
    assert gpus.locked_sm_clock_mhz(1) == 900
    applier.clear()
    assert gpus.locked_sm_clock_mhz(0) is None  # the driver's default
    assert gpus.locked_sm_clock_mhz(1) == ADMIN_MHZ  # the administrator's, not the default
    assert not ResetState(tmp_path).entries()  # nothing for a successor to reset
    assert not guard.reset_sm_clock(1)  # put back once: no longer Perseus's


# -- metrics ---------------------------------------------------------------------------------------


def _samples(metrics: AgentMetrics, name: str) -> list[Sample]:
    return [s for family in metrics.registry.collect() for s in family.samples if s.name == name]


def test_clock_event_reasons_and_foreign_clocks_are_exported_per_gpu(
    gpus: EmulatedBackend, tmp_path: Path
) -> None:
    gpus.lock_sm_clock(1, ADMIN_MHZ)
    guard, applier = _agent(gpus, tmp_path, ForeignClockPolicy.LEAVE)
    applier.apply(_plan())
    gpus.set_clock_event_reasons(0, POWER_CAP)
    gpus.set_activity(0, 0, "forward")
    metrics = applier.metrics
    metrics.registry.register(
        GpuCollector(guard, applier.devices, metrics, applier.managed_gpus, foreign=guard.foreign)
    )

    reasons = {
        (s.labels["gpu"], s.labels["reason"]): s.value
        for s in _samples(metrics, "perseus_gpu_clock_event_reasons")
    }
    assert len(reasons) == 2 * len(CLOCK_EVENT_REASONS)  # every reason of every GPU
    active = sorted(key for key, value in reasons.items() if value == 1.0)
    # GPU 0 runs under Perseus's lock and a power cap; GPU 1 idles under the admin's lock.
    assert active == [
        ("0", "sw_power_cap"),
        ("0", "user_defined_clocks"),
        ("1", "gpu_idle"),
        ("1", "user_defined_clocks"),
    ]
    [gpu0] = [
        s
        for s in _samples(metrics, "perseus_gpu_clock_event_reasons")
        if s.labels["gpu"] == "0" and s.labels["reason"] == "sw_power_cap"
    ]
    # The plan's labels, as on every other GPU series.
    assert (gpu0.labels["job_namespace"], gpu0.labels["job_name"], gpu0.labels["pp_rank"]) == (
        "ml",
        "gpt3",
        "0",
    )
    foreign = {
        (s.labels["gpu"], s.labels.get("kind")): s.value
        for s in _samples(metrics, "perseus_gpu_foreign_clocks")
    }
    assert foreign == {("0", None): 0.0, ("1", "locked"): 1.0}


def test_injected_reasons_are_shared_through_the_state_file_and_checked(tmp_path: Path) -> None:
    profile = load_profile(PROFILE)
    state_file = tmp_path / "gpus"
    agent = EmulatedBackend(2, profile, blocking_power_w=83.64, state_file=state_file)
    harness = EmulatedBackend(2, profile, blocking_power_w=83.64, state_file=state_file)
    harness.set_clock_event_reasons(1, CLOCK_EVENT_REASONS["hw_slowdown"])
    assert agent.clock_event_reasons(1) & CLOCK_EVENT_REASONS["hw_slowdown"]
    assert not agent.clock_event_reasons(0) & CLOCK_EVENT_REASONS["hw_slowdown"]
    with pytest.raises(ValueError, match="bit mask"):
        harness.set_clock_event_reasons(0, 0x10000)


def test_instruction_granularity_retries_each_iteration_but_logs_a_few_lines(
    gpus: EmulatedBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus.lock_sm_clock(1, ADMIN_MHZ)
    _, applier = _agent(gpus, tmp_path, ForeignClockPolicy.LEAVE)
    applier.apply(_plan(granularity="Instruction"))
    session = ClientSession(1, None, None, None, 0)
    hello = {"op": "hello", "version": 1, "rank": 1, "gpu_uuids": [f"GPU-emu-{NODE}-1"]}
    assert applier.hello(session, hello, 0)["managed"] is True  # type: ignore[arg-type]
    iterations = 50
    with caplog.at_level(logging.ERROR, logger="perseus_agent.control.gpu_clocks"):
        for _ in range(iterations):
            applier.step_begin(session, {"op": "step_begin", "step": 1}, 0)
    assert applier.metrics.error_count("foreign_clocks") >= iterations  # every one counted
    errors = [r for r in caplog.records if "foreign" in r.getMessage()]
    assert 1 <= len(errors) <= 11  # the first ten, then a summary per minute
    assert gpus.locked_sm_clock_mhz(1) == ADMIN_MHZ
