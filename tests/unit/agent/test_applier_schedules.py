"""Interleaved 1F1B and zero-bubble (ZB-H1) Instruction plans: the applier follows the
stream of a version-2 client by (name, microbatch, chunk), and the profiler measures each
chunk and each backward half, into the profile forms the planner takes for those schedules."""

from __future__ import annotations

from typing import Any

import pytest

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.profiling.profiler import StageProfiler
from perseus_agent.serving.client_dispatch import ClientSession
from perseus_api.node_plan import NodePlan
from perseus_api.profile import INSTRUCTIONS, parse_profile
from perseus_api.schedule import Step, gpu_computation_order
from perseus_operator.jobs.planning import gather_profile
from perseus_planner.model_stages import schedule_profile
from support.factories import pipeline_plan_fields, profiling_report
from support.fake_gpu import FakeBackend
from support.profiler_time import MS, SimTime, manual_sampler, ns

NODE = "node-1"
P, V, M = 2, 2, 4


def clock_at(position: int) -> int:
    """A supported clock of its own for each position of a stage's order."""
    return 1410 - 15 * position


def plan(schedule: str, virtual_stages: int = 1) -> NodePlan:
    fields = pipeline_plan_fields(num_stages=P, num_microbatches=M)
    fields["schedule"] = schedule
    fields["virtual_stages"] = virtual_stages
    for stage in fields["stages"]:
        order = gpu_computation_order(schedule, P, M, stage["stage"], virtual_stages)
        stage["instructions"] = [
            {
                "instruction": step.instruction,
                "microbatch": step.microbatch,
                "frequency_mhz": clock_at(k),
                **({"virtual_stage": step.virtual_stage} if virtual_stages > 1 else {}),
            }
            for k, step in enumerate(order)
        ]
    return NodePlan.model_validate(
        {
            "node": NODE,
            "job": "llm",
            "revision": 1,
            "granularity": "Instruction",
            "plans": {"main": fields},
            "assignments": [
                {"gpu_uuid": f"GPU-{s}", "plan": "main", "stage": s, "rank": s} for s in range(P)
            ],
        }
    )


def connect(applier: PlanApplier, stage: int) -> ClientSession:
    s = ClientSession(stage + 1, None, None, None, 0)
    hello: Any = {
        "op": "hello",
        "version": 2,
        "rank": stage,
        "local_rank": None,
        "gpu_uuids": [f"GPU-{stage}"],
        "pid": 42,
        "job": "llm",
        "namespace": "default",
        "pod": None,
    }
    applier.hello(s, hello, 0)
    return s


def chunk_of(step: Step, virtual_stages: int) -> int | None:
    return step.virtual_stage // P if virtual_stages > 1 else None


def run(applier: PlanApplier, s: ClientSession, name: str, mb: int, chunk: int | None) -> int:
    begin: Any = {"op": "instruction_begin", "name": name, "microbatch": mb}
    end: Any = {"op": "instruction_end", "name": name}
    if chunk is not None:
        begin["chunk"] = end["chunk"] = chunk
    clock = applier.instruction_begin(s, begin, 0)["sm_clock_mhz"]
    applier.instruction_end(s, end, 0)
    assert isinstance(clock, int)
    return clock


@pytest.fixture
def applier(tmp_path: Any) -> PlanApplier:
    return PlanApplier(FakeBackend(num_gpus=P), ResetState(tmp_path), NODE)


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("interleaved-1f1b", V), ("zb-h1", 1)])
def test_every_computation_gets_its_own_clock_without_a_mismatch(
    applier: PlanApplier, schedule: str, virtual_stages: int
) -> None:
    applier.apply(plan(schedule, virtual_stages))
    for stage in range(P):
        s = connect(applier, stage)
        order = gpu_computation_order(schedule, P, M, stage, virtual_stages)
        names = {step.instruction for step in order}
        if schedule == "zb-h1":
            assert names == {"forward", "backward_input", "backward_weight"}
        for _ in range(2):
            applier.step_begin(s, {"op": "step_begin", "step": 0}, 0)
            clocks = [
                run(applier, s, step.instruction, step.microbatch, chunk_of(step, virtual_stages))
                for step in order
            ]
            assert clocks == [clock_at(k) for k in range(len(order))], stage
            applier.step_end(s, {"op": "step_end", "step": 0}, 0)
    assert applier.metrics.error_count("schedule_mismatch") == 0


def test_a_computation_of_the_wrong_chunk_is_a_mismatch(applier: PlanApplier) -> None:
    """Rank 0 of interleaved 1F1B runs forward 0 on chunk 0 and later on chunk 1: the same
    (name, microbatch), told apart only by the chunk."""
    applier.apply(plan("interleaved-1f1b", V))
    s = connect(applier, 0)
    order = gpu_computation_order("interleaved-1f1b", P, M, 0, V)
    assert [(o.instruction, o.microbatch, o.virtual_stage) for o in order[:4]] == [
        ("forward", 0, 0),
        ("forward", 1, 0),
        ("forward", 0, 2),
        ("forward", 1, 2),
    ]
    assert run(applier, s, "forward", 0, 0) == clock_at(0)
    # Forward 1 of chunk 1 where the plan has forward 1 of chunk 0: resynchronised onto
    # chunk 1's (position 3), counted.
    assert run(applier, s, "forward", 1, 1) == clock_at(3)
    assert applier.metrics.error_count("schedule_mismatch") == 1
    assert run(applier, s, "forward", 2, 0) == clock_at(4)  # back in step
    assert applier.metrics.error_count("schedule_mismatch") == 1
    # A chunk the plan does not have: counted; the clock stays the one the last end set
    # for the plan's next computation.
    assert run(applier, s, "backward", 0, 5) == clock_at(5)
    assert applier.metrics.error_count("schedule_mismatch") == 2


def test_a_whole_backward_in_a_zero_bubble_plan_is_a_mismatch(applier: PlanApplier) -> None:
    applier.apply(plan("zb-h1"))
    s = connect(applier, P - 1)  # the last stage: F0 then I0 first
    assert run(applier, s, "forward", 0, None) == clock_at(0)
    run(applier, s, "backward", 0, None)  # a client that does not split its backward
    assert applier.metrics.error_count("schedule_mismatch") == 1


# -- profiling ---------------------------------------------------------------------------------

CLOCKS = (1410, 1005)
BLOCKING_W = 80.0


def emulated_profile_csv() -> str:
    """4 model stages (P=2 x V=2), every instruction, times and powers of their own."""
    lines = ["stage,instruction,frequency,time,energy"]
    for stage in range(P * V):
        for k, name in enumerate(INSTRUCTIONS):
            for clock in CLOCKS:
                time_s = (0.010 + 0.002 * stage + 0.004 * k) * (1410 / clock)
                power_w = 200.0 + 30 * stage + 10 * k - (1410 - clock) / 10
                lines.append(f"{stage},{name},{clock},{time_s},{time_s * power_w}")
    return "\n".join(lines) + "\n"


def profile_gpu(stage: int, order: list[Step], virtual_stages: int) -> StageProfiler:
    """Profile GPU ``stage`` through ``order`` on an emulated GPU whose computations of model
    stage ``step.virtual_stage`` take that stage's profiled time and power."""
    sim = SimTime()
    truth = parse_profile(emulated_profile_csv(), "emulated")
    gpus = EmulatedBackend(1, truth, blocking_power_w=BLOCKING_W, clock=sim.now_s)
    sampler = manual_sampler(gpus, sim)
    p = StageProfiler(
        stage,
        CLOCKS,
        iterations_per_frequency=2,
        warmup_iterations=1,
        sampler=sampler,
        num_stages=P,
        virtual_stages=virtual_stages,
    )
    while p.measuring:
        clock = p.step_begin(sim.ns)
        assert clock is not None
        gpus.lock_sm_clock(0, clock)
        p.clock_applied(clock)
        for step in order:
            sim.ns += 3 * MS
            sampler.sample()
            chunk = chunk_of(step, virtual_stages)
            p.instruction_begin(step.instruction, sim.ns, chunk)
            gpus.set_activity(0, step.virtual_stage, step.instruction)
            sampler.sample()
            sim.ns += ns(gpus.instruction_time_s(0, step.virtual_stage, step.instruction))
            gpus.set_activity(0, None, None)
            sampler.sample()
            p.instruction_end(step.instruction, sim.ns, chunk)
        sim.ns += 3 * MS
        sampler.sample()
        p.step_end(sim.ns)
    assert p.done and p.dropped_iterations == 0
    return p


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("interleaved-1f1b", V), ("zb-h1", 1)])
def test_profiling_gives_the_profile_form_the_schedule_plans_from(
    schedule: str, virtual_stages: int
) -> None:
    truth = parse_profile(emulated_profile_csv(), "emulated")
    reports = []
    for stage in range(P):
        order = gpu_computation_order(schedule, P, M, stage, virtual_stages)
        p = profile_gpu(stage, order, virtual_stages)
        rows = p.rows()
        want = {(step.virtual_stage, step.instruction) for step in order}
        assert {(r.stage, r.instruction) for r in rows} == want
        assert len(rows) == len(want) * len(CLOCKS)
        for r in rows:  # each chunk's own time, not its neighbour's
            m = truth.get(r.stage, r.instruction)
            k = list(m.frequencies_mhz).index(r.frequency_mhz)
            assert r.time_s == pytest.approx(m.times_s[k], rel=1e-6), r
            assert r.energy_j == pytest.approx(m.energies_j[k], rel=1e-6), r
        reports.append(
            profiling_report(
                stage,
                [r.model_dump() for r in rows],
                blocking_power_w=p.blocking_power_w,
                blocking_s=p.blocking_s,
            )
        )
    gathered = gather_profile(reports, P)
    measured = parse_profile(gathered.csv_text, "gathered")
    assert measured.num_stages == P * virtual_stages
    # The planner takes it as the schedule's own form (no --derive-profile needed).
    used = schedule_profile(measured, schedule, P, M, virtual_stages)
    assert used.num_stages == P * virtual_stages
    if schedule == "zb-h1":
        assert {i for _, i in used.measurements} == {
            "forward",
            "backward_input",
            "backward_weight",
        }
    assert gathered.blocking_power_w == pytest.approx(BLOCKING_W, rel=1e-6)


def test_an_interleaved_computation_without_a_chunk_is_not_measured() -> None:
    """With two chunks a computation that names none could be either model stage: its
    iteration is dropped instead of mixing the two."""
    order = gpu_computation_order("interleaved-1f1b", P, M, 0, V)
    sim = SimTime()
    truth = parse_profile(emulated_profile_csv(), "emulated")
    gpus = EmulatedBackend(1, truth, blocking_power_w=BLOCKING_W, clock=sim.now_s)
    p = StageProfiler(
        0,
        (1410,),
        iterations_per_frequency=1,
        warmup_iterations=0,
        sampler=manual_sampler(gpus, sim),
        num_stages=P,
        virtual_stages=V,
    )
    p.step_begin(sim.ns)
    p.clock_applied(1410)
    for step in order:
        p.instruction_begin(step.instruction, sim.ns)  # no chunk
        sim.ns += MS
        p.instruction_end(step.instruction, sim.ns)
    p.step_end(sim.ns)
    assert p.dropped_iterations == 1 and p.rows() == []


def test_gather_refuses_a_row_of_another_gpus_model_stage() -> None:
    row = {"stage": 1, "instruction": "forward", "frequency_mhz": 1410, "time_s": 1.0,
           "energy_j": 1.0, "samples": 1}  # fmt: skip
    with pytest.raises(ValueError, match="model stage 1 does not run on pipeline stage 0 of 2"):
        gather_profile([profiling_report(0, [row])], 2)
