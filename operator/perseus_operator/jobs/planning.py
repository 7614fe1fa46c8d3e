"""From measured profiles to per-node plans: the operator's pure planning steps.

* :func:`profiling_clocks_mhz`: the SM clocks a profiling run sweeps.
* :func:`gather_profile`: the agents' per-GPU profiling reports, merged into one profile
  (the planner's CSV) and a blocking power.
* :func:`solve_frontier`: the planner, run in a worker process (its input and its
  :class:`~perseus_planner.Frontier` result both pickle).
* :func:`choose_plan`: the plan for the policy and, with a straggler, its target time, taken
  from a frontier already solved (re-targeting never re-solves).
* :func:`get_node_plans`: the :class:`~perseus_api.NodePlan` of every node of the job.

Nothing here talks to Kubernetes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from perseus_api.job import FrequencyRange, Mode, Policy, ScheduleName
from perseus_api.job_profiling import Profiling
from perseus_api.node_plan import GpuAssignment, NodePlan, ProfilingSpec
from perseus_api.node_report import GpuProfilingReport
from perseus_api.plan import Granularity, PipelinePlan
from perseus_api.profile import Profile, parse_profile
from perseus_operator.workloads.ranks import RankPlacement
from perseus_planner import (
    Frontier,
    build_plan,
    choose_point,
    compute_frontier,
    max_frequency_baseline,
    prepare_problem,
)

DEFAULT_MAX_MHZ: Final = 2100
"""Top of the default profiling sweep: above every datacenter GPU's SM clock today. Agents
measure an unsupported clock at the nearest supported one and skip repeats."""
DEFAULT_MIN_RATIO: Final = 0.5
"""Bottom of the default sweep, as a fraction of its top: slower clocks never pay off."""
UNIT_STEPS_PER_COMPUTATION: Final = 1000
"""The planner's time unit is about this fraction of the shortest computation. At 1/100 the
predicted savings moved from 5.47 % to 5.91 % with a 0.1 % change of the measured times (the
e2e's profile); at 1/1000 they stay within 5.63-5.67 %, and GPT-3 8x24 still plans in ~1 s."""

TMIN_PLAN: Final = "tmin"
RETARGETED_PLAN: Final = "retargeted"


class PlanningError(ValueError):
    """The profile or the reports cannot give a plan; the message says what to fix."""


# -- profiling ---------------------------------------------------------------------------------


def profiling_clocks_mhz(policy: Policy, profiling: Profiling) -> list[int]:
    """SM clocks to profile, highest first: the policy's clamp (or a wide default range) in
    steps of ``frequencyStepMHz``, its bottom included."""
    clamp = policy.frequency_mhz or FrequencyRange(
        min_mhz=math.ceil(DEFAULT_MAX_MHZ * DEFAULT_MIN_RATIO), max_mhz=DEFAULT_MAX_MHZ
    )
    step = profiling.frequency_step_mhz
    clocks = list(range(clamp.max_mhz, clamp.min_mhz - 1, -step))
    if clocks[-1] != clamp.min_mhz:
        clocks.append(clamp.min_mhz)
    return clocks


def get_profiling_spec(policy: Policy, profiling: Profiling) -> ProfilingSpec:
    return ProfilingSpec(
        frequencies_mhz=profiling_clocks_mhz(policy, profiling),
        iterations_per_frequency=profiling.iterations_per_frequency,
        warmup_iterations=profiling.warmup_iterations,
    )


@dataclass(frozen=True)
class GatheredProfile:
    """The merged profiling results of a job."""

    csv_text: str
    """The planner's CSV (``stage,instruction,frequency,time,energy``)."""
    blocking_power_w: float | None
    """Blocking power weighted by each GPU's blocking time; ``None`` if no GPU measured it."""
    gpus: int
    """GPUs whose results were merged."""


def gather_profile(reports: Sequence[GpuProfilingReport], num_stages: int) -> GatheredProfile:
    """Merge the agents' per-GPU profiling reports (``status.profiling`` entries of the node
    plans) into one profile: per (stage, instruction, clock) the mean over the GPUs of that
    stage, weighted by samples.

    A report is for the GPU of pipeline stage ``stage`` (``0..num_stages-1``); its rows name
    their model stage, which is the same one, or ``v * num_stages + stage`` for its chunk
    ``v`` when the GPU runs several (interleaved 1F1B: the ``P * V``-stage profile). (Rows of
    an older agent that name no stage are the report's: :class:`GpuProfilingReport` reads
    them so.)

    Raises:
        PlanningError: a stage has no finished report, or a row's model stage does not run on
            its report's pipeline stage.
    """
    sums: dict[tuple[int, str, int], list[float]] = {}  # time_s*n, energy_j*n, n
    blocking_j = blocking_s = 0.0
    stages_done: set[int] = set()
    gpus = 0
    for report in reports:
        if not report.done:
            continue
        stage = report.stage
        for row in report.rows:
            n = float(row.samples)
            if row.stage % num_stages != stage % num_stages:
                raise PlanningError(
                    f"malformed profiling report of GPU {report.uuid}: a row of model stage "
                    f"{row.stage} does not run on pipeline stage {stage} of {num_stages}"
                )
            key = (row.stage, row.instruction, row.frequency_mhz)
            acc = sums.setdefault(key, [0.0, 0.0, 0.0])
            acc[0] += row.time_s * n
            acc[1] += row.energy_j * n
            acc[2] += n
        if report.blocking_power_w is not None and report.blocking_s > 0:
            blocking_j += report.blocking_power_w * report.blocking_s
            blocking_s += report.blocking_s
        stages_done.add(stage)
        gpus += 1
    missing = sorted(set(range(num_stages)) - stages_done)
    if missing:
        raise PlanningError(
            f"no finished profile for pipeline stage(s) {', '.join(map(str, missing))}"
        )
    lines = ["stage,instruction,frequency,time,energy"]
    for (stage, instruction, clock), (time_n, energy_n, n) in sorted(
        sums.items(), key=lambda item: (item[0][0], item[0][1] != "forward", -item[0][2])
    ):
        lines.append(f"{stage},{instruction},{clock},{time_n / n!r},{energy_n / n!r}")
    return GatheredProfile(
        csv_text="\n".join(lines) + "\n",
        blocking_power_w=blocking_j / blocking_s if blocking_s > 0 else None,
        gpus=gpus,
    )


# -- solving -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanningInput:
    """What the planner worker needs; plain data, so it pickles to a worker process."""

    profile_csv: str
    profile_source: str = field(compare=False)
    """Names the profile in error messages only: jobs with the same profile share a solve."""
    schedule: ScheduleName
    num_stages: int
    num_microbatches: int
    blocking_power_w: float
    frequency_mhz: FrequencyRange | None = None
    virtual_stages: int = 1
    """Model stages per GPU (Interleaved1F1B); the profile then has ``num_stages * V``."""


def choose_unit_time_s(profile: Profile) -> float:
    """A time unit of about 1/:data:`UNIT_STEPS_PER_COMPUTATION` of the shortest computation,
    on a 1-2-5 grid: fine enough that quantization costs little, coarse enough that the
    frontier has few points."""
    shortest_s = min(float(m.times_s.min()) for m in profile.measurements.values())
    raw = shortest_s / UNIT_STEPS_PER_COMPUTATION
    exponent = math.floor(math.log10(raw))
    for mantissa in (5, 2, 1):
        unit = mantissa * 10.0**exponent
        if unit <= raw:
            return unit
    return 10.0**exponent  # pragma: no cover - mantissa 1 always fits


def clamp_profile(profile_csv: str, frequency_mhz: FrequencyRange | None) -> str:
    """The profile's rows within the clamp (header kept)."""
    if frequency_mhz is None:
        return profile_csv
    lines = profile_csv.strip().splitlines()
    header, rows = lines[0], lines[1:]
    column = [c.strip().lower() for c in header.split(",")].index("frequency")
    kept = [
        row
        for row in rows
        if frequency_mhz.min_mhz <= int(float(row.split(",")[column])) <= frequency_mhz.max_mhz
    ]
    return "\n".join([header, *kept]) + "\n"


def solve_frontier(request: PlanningInput) -> Frontier:
    """The whole iteration time–energy frontier (runs in a worker process).

    Raises:
        PlanningError: the profile does not fit the pipeline or cannot be planned.
    """
    try:
        profile = parse_profile(
            clamp_profile(request.profile_csv, request.frequency_mhz), request.profile_source
        )
        # The planner's limits (perseus_planner.limits) refuse input its arithmetic or memory
        # cannot hold with a LimitError, which becomes the job's condition message below.
        problem = prepare_problem(
            profile,
            request.schedule.value.lower(),
            request.num_stages,
            request.num_microbatches,
            choose_unit_time_s(profile),
            request.blocking_power_w,
            virtual_stages=request.virtual_stages,
        )
        return compute_frontier(problem)
    except ValueError as exc:  # ProfileError, SolverError, ... are ValueErrors
        raise PlanningError(str(exc)) from exc


def choose_plan(
    frontier: Frontier,
    policy: Policy,
    *,
    straggler_target_s: float | None = None,
) -> PipelinePlan:
    """The plan for ``policy``; with a straggler, the minimum energy (waiting included) at
    iteration time <= ``straggler_target_s``: the slowest frontier point that ends by then
    (``T_max`` when the target is past it), even beyond ``T*``: computation energy falls all
    along the frontier, and a replica that finishes early only waits at blocking power."""
    if straggler_target_s is not None:
        choice = choose_point(frontier, target_s=straggler_target_s)
    elif policy.max_slowdown > 0:
        choice = choose_point(frontier, max_slowdown=policy.max_slowdown)
    else:
        choice = choose_point(frontier)
    baseline = max_frequency_baseline(frontier.problem)
    return build_plan(frontier, baseline, choice, policy.granularity)


def expected_savings_ratio(plan: PipelinePlan) -> float:
    """Energy saved vs. all GPUs at max clock at the same throughput, for the granularity."""
    return plan.estimate.savings_ratio


def applies_clocks(policy: Policy) -> bool:
    """Whether plans are applied at all (``Observe`` only reports)."""
    return policy.mode != Mode.OBSERVE


# -- node plans --------------------------------------------------------------------------------


def get_node_plans(
    *,
    namespace: str,
    job: str,
    revision: int,
    granularity: Granularity,
    ranks: Sequence[RankPlacement],
    plans: Mapping[str, PipelinePlan],
    plan_of_replica: Mapping[int, str],
    profiling: ProfilingSpec | None = None,
    power_limits_w: Mapping[str, float] | None = None,
) -> dict[str, NodePlan]:
    """One :class:`NodePlan` per node running ``ranks``: every GPU follows the plan of its
    data-parallel replica (``plan_of_replica``, default :data:`TMIN_PLAN`), at its pipeline
    stage. With ``profiling`` the agents measure instead (the plans still say which GPU runs
    which stage). ``power_limits_w``: a power budget's limit for each GPU, by node."""
    limits_w = power_limits_w or {}
    by_node: dict[str, list[GpuAssignment]] = {}
    for r in ranks:
        name = plan_of_replica.get(r.dp_rank, TMIN_PLAN)
        if name not in plans:
            raise PlanningError(f"replica {r.dp_rank} refers to unknown plan {name!r}")
        by_node.setdefault(r.node, []).append(
            GpuAssignment(
                pod_uid=r.pod_uid,
                container=r.container,
                local_rank=r.local_rank,
                plan=name,
                stage=r.pp_rank,
                dp_rank=r.dp_rank,
                tp_rank=r.tp_rank,
                rank=r.rank,
                pod=r.pod,
                power_limit_w=limits_w.get(r.node),
            )
        )
    result = {}
    for node, assignments in sorted(by_node.items()):
        used = {a.plan for a in assignments}
        result[node] = NodePlan(
            node=node,
            namespace=namespace,
            job=job,
            revision=revision,
            granularity=granularity,
            plans={k: v for k, v in plans.items() if k in used},
            assignments=assignments,
            profiling=profiling,
        )
    return result
