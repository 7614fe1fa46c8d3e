"""Per-GPU power limits of a node plan (a power budget's backstop): the applier sets them on
emulated GPUs, clamps them to what the GPU accepts, records the limit each replaced and puts it
back on every way a GPU leaves a plan; another owner's limit is respected; only the GPUs a plan
holds are limited (Kubernetes mode: ownership and arbitration decide that)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from perseus_agent.clocks.clock_owners import ClockOwnerGuard, ForeignClockPolicy
from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.errors import GpuLostError
from perseus_agent.exporter import GpuCollector
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.plans.job_plans import JobPlans
from perseus_api.node_plan import NodePlan
from perseus_api.profile import Profile, load_profile
from support.agent_process import PROFILE
from support.applier_calls import NODE, gpu, node_plan

BLOCKING_W = 83.64


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE)


@pytest.fixture
def gpus(profile: Profile) -> EmulatedBackend:
    return EmulatedBackend(4, profile, blocking_power_w=BLOCKING_W, node_name=NODE)


@pytest.fixture
def state(tmp_path: Path) -> ResetState:
    return ResetState(tmp_path)


def limits(gpus: EmulatedBackend) -> list[float]:
    return [gpus.power_limit_w(i) for i in range(gpus.num_gpus)]


def limited(*indices: int, limit_w: float) -> list[dict[str, object]]:
    return [gpu(i, i % 2, by_uuid=False, power_limit_w=limit_w) for i in indices]


def test_the_emulated_gpu_runs_each_computation_at_the_highest_clock_that_fits(
    gpus: EmulatedBackend, profile: Profile
) -> None:
    allowed = gpus.power_limit_range_w(0)
    assert (allowed.min_w, allowed.default_w) == (84.0, allowed.max_w)
    gpus.set_activity(0, 0, "forward")
    full_w = gpus.power_w(0)
    assert gpus.sm_clock_mhz(0) == max(profile.frequencies_mhz)

    assert gpus.set_power_limit(0, 300.0) is True
    assert gpus.set_power_limit(0, 300.0) is False  # no-op
    m = profile.measurements[(0, "forward")]
    fits = [f for f, t, e in zip(m.frequencies_mhz, m.times_s, m.energies_j, strict=True)
            if e / t <= 300.0]  # fmt: skip
    assert gpus.sm_clock_mhz(0) == max(fits)
    assert gpus.power_w(0) <= 300.0 < full_w
    assert gpus.clock_event_reasons(0) & 0x4  # sw_power_cap
    assert gpus.instruction_time_s(0, 0, "forward") > gpus.instruction_time_s(1, 0, "forward")
    gpus.set_activity(0, None, None)
    assert gpus.power_w(0) == BLOCKING_W  # idle: nothing to cap
    assert gpus.reset_power_limit(0) is True
    assert gpus.power_limit_w(0) == allowed.default_w


def test_a_plans_limits_are_set_recorded_first_and_reported(
    gpus: EmulatedBackend, state: ResetState
) -> None:
    applier = PlanApplier(gpus, state, NODE)
    default_w = gpus.power_limit_range_w(0).default_w

    report = applier.apply(node_plan([*limited(0, 1, limit_w=250.0), gpu(2, 0, by_uuid=False)]))

    assert limits(gpus) == [250.0, 250.0, default_w, default_w]
    assert [(g.index, g.power_limit_w, g.power_limit_message) for g in report.gpus] == [
        (0, 250.0, ""), (1, 250.0, ""), (2, None, ""),
    ]  # fmt: skip
    assert [(e.index, e.locked, e.power_limit_w) for e in state.entries()] == [
        (0, ("sm", "power_limit"), default_w),
        (1, ("sm", "power_limit"), default_w),
        (2, ("sm",), None),
    ]
    assert applier.locked_gpus() == [0, 1, 2]

    # A new revision with another limit keeps the original one recorded.
    applier.apply(node_plan(limited(0, 1, limit_w=200.0), revision=2))
    assert limits(gpus)[:2] == [200.0, 200.0]
    assert {e.power_limit_w for e in state.entries()} == {default_w}


def test_a_limit_outside_the_gpus_range_is_clamped_and_said(
    gpus: EmulatedBackend, state: ResetState
) -> None:
    allowed = gpus.power_limit_range_w(0)
    applier = PlanApplier(gpus, state, NODE)
    report = applier.apply(
        node_plan([gpu(0, 0, by_uuid=False, power_limit_w=5.0),
                   gpu(1, 1, by_uuid=False, power_limit_w=4000.0)])
    )  # fmt: skip
    assert limits(gpus)[:2] == [allowed.min_w, allowed.max_w]
    assert report.gpus[0].power_limit_w == allowed.min_w
    assert report.gpus[0].power_limit_message == (
        f"power limit 5 W is outside what GPU 0 accepts ({allowed.min_w:g}..{allowed.max_w:g} W);"
        f" clamped to {allowed.min_w:g} W"
    )


@pytest.mark.parametrize(
    "leave",
    ["plan without limits", "gpu leaves the plan", "plan cleared", "plan for no gpu"],
)
def test_every_way_out_of_a_plan_puts_the_original_limit_back(
    gpus: EmulatedBackend, state: ResetState, leave: str
) -> None:
    default_w = gpus.power_limit_range_w(0).default_w
    gpus.set_power_limit(3, 300.0)  # someone's before the plan: not this applier's
    applier = PlanApplier(gpus, state, NODE)
    applier.apply(node_plan(limited(0, 1, limit_w=250.0)))
    assert limits(gpus) == [250.0, 250.0, default_w, 300.0]

    if leave == "plan without limits":
        applier.apply(node_plan([gpu(0, 0, by_uuid=False), gpu(1, 1, by_uuid=False)], revision=2))
        expected = [default_w, default_w]
    elif leave == "gpu leaves the plan":
        applier.apply(node_plan(limited(0, limit_w=250.0), revision=2))
        expected = [250.0, default_w]
    elif leave == "plan cleared":
        applier.clear()
        expected = [default_w, default_w]
    else:
        applier.apply(node_plan([], revision=2))
        expected = [default_w, default_w]

    assert limits(gpus) == [*expected, default_w, 300.0]
    assert [e.index for e in state.entries() if "power_limit" in e.locked] == [
        i for i, w in enumerate(expected) if w != default_w
    ]


def test_a_gpu_error_reports_the_gpu_and_leaves_no_limit(
    gpus: EmulatedBackend, state: ResetState
) -> None:
    applier = PlanApplier(gpus, state, NODE)
    applier.apply(node_plan(limited(0, 1, limit_w=250.0)))
    gpus.inject_fault(1, GpuLostError("GPU 1 fell off the bus", gpu_index=1))

    report = applier.apply(node_plan(limited(0, 1, limit_w=200.0), revision=2))

    by_index = {g.index: g for g in report.gpus}
    assert by_index[0].power_limit_w == 200.0
    assert by_index[1].power_limit_w is None
    assert by_index[1].power_limit_message.startswith("gpu_lost: ")
    assert applier.metrics.error_count("gpu_lost") >= 1
    # Lost, it cannot be restored now: it stays recorded for the next start, never forgotten.
    assert 1 in applier.locked_gpus()
    assert [e.index for e in state.entries() if "power_limit" in e.locked] == [0, 1]
    gpus.inject_fault(1, None)
    applier.clear()
    assert limits(gpus)[:2] == [gpus.power_limit_range_w(0).default_w] * 2
    assert state.entries() == []


@pytest.mark.parametrize("policy", [ForeignClockPolicy.LEAVE, ForeignClockPolicy.OVERRIDE])
def test_an_administrators_limit_is_left_alone_or_overridden_and_given_back(
    gpus: EmulatedBackend, state: ResetState, policy: ForeignClockPolicy
) -> None:
    gpus.set_power_limit(1, 300.0)  # nvidia-smi -pl 300, before the agent started
    guard = ClockOwnerGuard(gpus, policy)
    guard.survey(gpus.devices())
    assert {i: f.limit_w for i, f in guard.foreign_power_limits().items()} == {1: 300.0}
    applier = PlanApplier(guard, state, NODE)

    report = applier.apply(node_plan(limited(0, 1, limit_w=250.0)))

    if policy == ForeignClockPolicy.LEAVE:
        assert limits(gpus)[:2] == [250.0, 300.0]
        assert report.gpus[1].power_limit_w is None
        assert report.gpus[1].power_limit_message.startswith("foreign_power_limit: GPU 1: ")
        assert applier.metrics.error_count("foreign_power_limit") == 1
    else:
        assert limits(gpus)[:2] == [250.0, 250.0]
        assert [e.power_limit_w for e in state.entries() if e.index == 1] == [300.0]
    applier.clear()
    assert limits(gpus)[:2] == [gpus.power_limit_range_w(0).default_w, 300.0]
    assert state.entries() == []


def test_a_profiling_plan_cannot_carry_power_limits() -> None:
    plan = node_plan(limited(0, limit_w=250.0)).model_dump(by_alias=True)
    plan["profiling"] = {"frequenciesMHz": [1410], "iterationsPerFrequency": 1,
                         "warmupIterations": 0}  # fmt: skip
    with pytest.raises(ValidationError, match="a profiling plan cannot set power limits"):
        NodePlan.model_validate(plan)


@pytest.mark.parametrize("limit_w", [0.0, -1.0, 0.5, 5000.5, float("nan")])
def test_a_plans_power_limit_is_bounded(limit_w: float) -> None:
    with pytest.raises(ValidationError, match=r"powerLimitWatts|power_limit_w"):
        node_plan(limited(0, limit_w=limit_w))


def test_only_the_gpus_a_plan_holds_are_limited(gpus: EmulatedBackend, state: ResetState) -> None:
    """Kubernetes mode: a plan of another namespace is refused whole, and a GPU an older plan
    holds is not the newer plan's: neither plan's limit reaches a GPU it does not hold."""
    default_w = gpus.power_limit_range_w(0).default_w
    jobs = JobPlans(gpus, state, NODE)
    older = node_plan(limited(0, 1, limit_w=250.0))
    jobs.set_plan(("ml", "older"), older)
    newer = node_plan(limited(1, 2, limit_w=150.0)).model_copy(update={"job": "newer"})
    jobs.set_plan(("ml", "newer"), newer)
    elsewhere = node_plan(limited(3, limit_w=120.0))  # spec.namespace ml, object in "other"
    jobs.set_plan(("other", "sneaky"), elsewhere)

    assert limits(gpus) == [250.0, 250.0, 150.0, default_w]
    status = jobs.status(("other", "sneaky"))
    assert status is not None and "namespace" in str(status)

    jobs.remove(("ml", "older"))  # GPU 1 goes to the newer plan, with its limit
    assert limits(gpus) == [default_w, 150.0, 150.0, default_w]
    jobs.clear()
    assert limits(gpus) == [default_w] * 4
    assert state.entries() == []


def test_every_gpus_power_limit_is_exported_and_a_foreign_one_is_flagged(
    gpus: EmulatedBackend, state: ResetState
) -> None:
    gpus.set_power_limit(3, 300.0)
    guard = ClockOwnerGuard(gpus)
    guard.survey(gpus.devices())
    applier = PlanApplier(guard, state, NODE)
    applier.apply(node_plan(limited(0, limit_w=250.0)))
    collector = GpuCollector(
        guard,
        gpus.devices(),
        applier.metrics,
        applier.managed_gpus,
        foreign=guard.foreign,
        foreign_power=guard.foreign_power_limits,
    )
    metrics = {m.name: m for m in collector.collect()}

    exported = {s.labels["gpu"]: s.value for s in metrics["perseus_gpu_power_limit_watts"].samples}
    default_w = gpus.power_limit_range_w(0).default_w
    assert exported == {"0": 250.0, "1": default_w, "2": default_w, "3": 300.0}
    foreign = {
        (s.labels["gpu"], s.labels.get("kind")): s.value
        for s in metrics["perseus_gpu_foreign_clocks"].samples
    }
    assert foreign == {("0", None): 0, ("1", None): 0, ("2", None): 0, ("3", "power_limit"): 1}
