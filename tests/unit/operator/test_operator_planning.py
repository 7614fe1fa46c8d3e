"""The operator's planning steps: profiling sweep, merged profiles, frontier, plans per node."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from perseus_api.job import FrequencyRange, Mode, Policy, ScheduleName
from perseus_api.job_profiling import Profiling
from perseus_api.node_report import GpuProfilingReport
from perseus_api.plan import Granularity, PlanObjective
from perseus_api.profile import load_profile, parse_profile
from perseus_operator.jobs.node_status import node_plan_status
from perseus_operator.jobs.planning import (
    RETARGETED_PLAN,
    TMIN_PLAN,
    UNIT_STEPS_PER_COMPUTATION,
    PlanningError,
    PlanningInput,
    applies_clocks,
    choose_plan,
    choose_unit_time_s,
    clamp_profile,
    expected_savings_ratio,
    gather_profile,
    get_node_plans,
    profiling_clocks_mhz,
    solve_frontier,
)
from perseus_operator.workloads.ranks import RankPlacement
from perseus_planner import DEFAULT_PROFILE, bundled_profile
from support.factories import profiling_report

STAGES, MICROBATCHES = 4, 8


@pytest.fixture(scope="module")
def profile_csv() -> str:
    """The bundled GPT-3 / A100 profile cut to its first four stages."""
    text = bundled_profile(DEFAULT_PROFILE).path.read_text()
    lines = text.strip().splitlines()
    stage = lines[0].split(",").index("stage")
    kept = [line for line in lines[1:] if int(line.split(",")[stage]) < STAGES]
    return "\n".join([lines[0], *kept]) + "\n"


@pytest.fixture(scope="module")
def request_(profile_csv: str) -> PlanningInput:
    return PlanningInput(
        profile_csv=profile_csv,
        profile_source="gpt3-4-stages",
        schedule=ScheduleName.ONE_F_ONE_B,
        num_stages=STAGES,
        num_microbatches=MICROBATCHES,
        blocking_power_w=bundled_profile(DEFAULT_PROFILE).blocking_power_w,
    )


def test_profiling_sweep_covers_the_clamp_in_steps_with_its_bottom() -> None:
    policy = Policy(frequencyMHz=FrequencyRange(minMHz=1000, maxMHz=1410))
    assert profiling_clocks_mhz(policy, Profiling(frequencyStepMHz=100)) == [
        1410,
        1310,
        1210,
        1110,
        1010,
        1000,
    ]
    wide = profiling_clocks_mhz(Policy(), Profiling())
    assert wide[0] == 2100 and wide[-1] == 1050 and wide == sorted(wide, reverse=True)


def report(
    stage: int, rows: list[tuple[str, int, float, float, int]], **extra: Any
) -> GpuProfilingReport:
    fields = ("instruction", "frequency_mhz", "time_s", "energy_j", "samples")
    return profiling_report(
        stage, [dict(zip(fields, r, strict=True), stage=stage) for r in rows], **extra
    )


def test_gathered_profile_averages_gpus_of_a_stage_by_samples() -> None:
    rows0 = [("forward", 1410, 0.010, 3.0, 2), ("backward", 1410, 0.020, 6.0, 2)]
    rows0 += [("forward", 1200, 0.012, 2.8, 2), ("backward", 1200, 0.024, 5.5, 2)]
    other = [("forward", 1410, 0.013, 3.3, 1), ("backward", 1410, 0.020, 6.0, 1)]
    other += [("forward", 1200, 0.012, 2.8, 1), ("backward", 1200, 0.024, 5.5, 1)]
    stage1 = [(n, c, t * 2, e * 2, s) for n, c, t, e, s in rows0]
    gathered = gather_profile(
        [
            report(0, rows0, blocking_power_w=80.0, blocking_s=3.0),
            report(0, other, blocking_power_w=90.0, blocking_s=1.0),
            report(1, stage1, blocking_power_w=None, blocking_s=0.0),
            profiling_report(1, done=False),  # still running on another GPU: ignored
        ],
        num_stages=2,
    )
    assert gathered.gpus == 3
    assert gathered.blocking_power_w == pytest.approx((80 * 3 + 90) / 4)
    profile = parse_profile(gathered.csv_text, "gathered")
    forward0 = profile.get(0, "forward")
    assert list(forward0.frequencies_mhz) == [1410, 1200]
    assert forward0.times_s[0] == pytest.approx((0.010 * 2 + 0.013) / 3)
    assert forward0.energies_j[0] == pytest.approx((3.0 * 2 + 3.3) / 3)
    assert profile.get(1, "backward").times_s[1] == pytest.approx(0.048)


def test_gathered_profile_needs_every_stage_and_well_formed_reports() -> None:
    rows = [("forward", 1410, 0.01, 3.0, 1), ("backward", 1410, 0.02, 6.0, 1)]
    with pytest.raises(PlanningError, match=r"no finished profile for pipeline stage\(s\) 1, 2"):
        gather_profile([report(0, rows)], num_stages=3)
    # A malformed report is refused where the status is read: its stage has no profile.
    malformed = {"stage": 0, "done": True, "rows": [{"instruction": "forward"}]}
    plan = {"metadata": {"name": "p"}, "status": {"profiling": [malformed]}}
    with pytest.raises(PlanningError, match=r"no finished profile for pipeline stage\(s\) 0"):
        gather_profile(node_plan_status(plan).profiling, 1)


def test_unit_time_is_a_fixed_fraction_of_the_shortest_computation_on_a_1_2_5_grid(
    profile_csv: str,
) -> None:
    profile = parse_profile(profile_csv, "p")
    shortest = min(float(m.times_s.min()) for m in profile.measurements.values())
    unit = choose_unit_time_s(profile)
    assert unit <= shortest / UNIT_STEPS_PER_COMPUTATION < 2.5 * unit
    assert f"{unit:.0e}"[0] in "125"


def test_clamp_keeps_only_rows_within_the_range(profile_csv: str) -> None:
    clamped = parse_profile(
        clamp_profile(profile_csv, FrequencyRange(minMHz=1005, maxMHz=1305)), "clamped"
    )
    clocks = set(clamped.frequencies_mhz.tolist())
    assert clocks and min(clocks) >= 1005 and max(clocks) <= 1305


def test_frontier_pickles_for_worker_processes_and_plans_each_objective(
    request_: PlanningInput,
) -> None:
    frontier = pickle.loads(pickle.dumps(solve_frontier(request_)))
    t_min = float(frontier.times_s[frontier.t_min_index])
    t_star = float(frontier.times_s[frontier.t_star_index])
    assert t_star > t_min

    tmin = choose_plan(frontier, Policy())
    assert tmin.objective == PlanObjective.MIN_TIME
    assert tmin.granularity == Granularity.INSTRUCTION
    assert tmin.instruction_estimate.iteration_time_s == pytest.approx(t_min)
    assert 0 < expected_savings_ratio(tmin) < 0.5

    # A straggler at 1.1 x T_min: slower, and more savings than at T_min.
    slow = choose_plan(frontier, Policy(), straggler_target_s=1.1 * t_min)
    assert slow.objective == PlanObjective.STRAGGLER
    assert t_min < slow.instruction_estimate.iteration_time_s <= 1.1 * t_min
    assert expected_savings_ratio(slow) > expected_savings_ratio(tmin)
    # Far beyond T*: past it, up to T_max (computation energy falls all along the frontier;
    # finishing early would only wait at blocking power until the target).
    far = choose_plan(frontier, Policy(), straggler_target_s=10 * t_star)
    far_s = far.instruction_estimate.iteration_time_s
    assert t_star <= far_s <= float(frontier.times_s[0])

    budget = choose_plan(frontier, Policy(maxSlowdown=0.05, granularity=Granularity.STAGE))
    assert budget.objective == PlanObjective.MAX_SLOWDOWN
    assert budget.granularity == Granularity.STAGE
    assert budget.stage_estimate.iteration_time_s <= 1.05 * t_min * 1.001
    assert not applies_clocks(Policy(mode=Mode.OBSERVE)) and applies_clocks(Policy())


def test_a_profile_that_does_not_fit_the_pipeline_is_a_planning_error(
    request_: PlanningInput,
) -> None:
    wrong = PlanningInput(**{**request_.__dict__, "num_stages": STAGES + 2})
    with pytest.raises(PlanningError, match="has 4 stages but the pipeline has 6"):
        solve_frontier(wrong)
    garbage = PlanningInput(**{**request_.__dict__, "profile_csv": "stage,oops\n1,2\n"})
    with pytest.raises(PlanningError):
        solve_frontier(garbage)


def placements(dp: int, pp: int, gpus_per_node: int) -> list[RankPlacement]:
    out = []
    for rank in range(dp * pp):
        dp_rank, pp_rank = rank % dp, rank // dp
        out.append(
            RankPlacement(
                rank=rank,
                dp_rank=dp_rank,
                pp_rank=pp_rank,
                tp_rank=0,
                pod=f"worker-{rank // gpus_per_node}",
                node=f"node-{rank // gpus_per_node}",
                local_rank=rank % gpus_per_node,
                container="pytorch",
                pod_uid=f"uid-{rank // gpus_per_node}",
            )
        )
    return out


def test_node_plans_give_each_gpu_its_replicas_plan_and_stage(request_: PlanningInput) -> None:
    frontier = solve_frontier(request_)
    t_min = float(frontier.times_s[frontier.t_min_index])
    plans = {
        TMIN_PLAN: choose_plan(frontier, Policy()),
        RETARGETED_PLAN: choose_plan(frontier, Policy(), straggler_target_s=1.2 * t_min),
    }
    ranks = placements(dp=2, pp=STAGES, gpus_per_node=4)
    node_plans = get_node_plans(
        namespace="ml",
        job="gpt3",
        revision=7,
        granularity=Granularity.INSTRUCTION,
        ranks=ranks,
        plans=plans,
        plan_of_replica={0: RETARGETED_PLAN},  # replica 1 straggles: it keeps T_min
    )
    assert sorted(node_plans) == ["node-0", "node-1"]
    for node, plan in node_plans.items():
        assert (plan.node, plan.namespace, plan.job, plan.revision) == (node, "ml", "gpt3", 7)
        for a in plan.assignments:
            rank = ranks[a.rank or 0]
            # The GPU is named by its process; the node's agent asks the kubelet which it is.
            assert (a.gpu_index, a.gpu_uuid) == (None, None)
            assert (a.pod, a.pod_uid, a.container, a.local_rank, a.stage, a.dp_rank) == (
                rank.pod,
                rank.pod_uid,
                "pytorch",
                rank.local_rank,
                rank.pp_rank,
                rank.dp_rank,
            )
            assert a.plan == (RETARGETED_PLAN if a.dp_rank == 0 else TMIN_PLAN)
        assert set(plan.plans) == {a.plan for a in plan.assignments}
    with pytest.raises(PlanningError, match="unknown plan 'nope'"):
        get_node_plans(
            namespace="ml",
            job="gpt3",
            revision=1,
            granularity=Granularity.STAGE,
            ranks=ranks,
            plans=plans,
            plan_of_replica={1: "nope"},
        )


def test_bundled_profile_loads(profile_csv: str) -> None:
    assert load_profile(bundled_profile(DEFAULT_PROFILE).path).num_stages == 8
    assert parse_profile(profile_csv, "cut").num_stages == STAGES


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"blocking_power_w": 1e12},
            r"energy bound is .* above the planner's limit of 7\.04e\+07 J",
        ),
        ({"num_microbatches": 100_000}, r"make 800,000 forwards and backwards .* limit of 500,000"),
    ],
)
def test_input_beyond_the_planners_limits_is_a_planning_error_with_the_limit(
    request_: PlanningInput, change: dict[str, Any], message: str
) -> None:
    """The operator reports these as the job's PlanningFailed condition, not a crash."""
    with pytest.raises(PlanningError, match=message):
        solve_frontier(PlanningInput(**{**request_.__dict__, **change}))


def test_an_outlier_energy_in_reports_is_a_planning_error(
    profile_csv: str, request_: PlanningInput
) -> None:
    lines = profile_csv.splitlines()
    fields = lines[1].split(",")
    fields[-1] = "1e9"
    lines[1] = ",".join(fields)
    outlier = PlanningInput(**{**request_.__dict__, "profile_csv": "\n".join(lines) + "\n"})
    with pytest.raises(PlanningError, match="line 2: energy 1e9 J is above"):
        solve_frontier(outlier)
