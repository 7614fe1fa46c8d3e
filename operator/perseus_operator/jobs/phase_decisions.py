"""The decisions of a job's phases up to its plans: ``Pending`` (plan from a stored profile,
profile, or wait for one), ``Profiling`` (progress, call-ins, the gathered profile),
``Optimizing`` (the planning request, the frontier) and the node plans of a target.

Pure, as :mod:`perseus_operator.jobs.job_decisions`: what the step read and what it solved go in,
a :class:`~perseus_operator.jobs.job_decisions.Decision` (or one wrapped with what the next stage
needs) comes out; :mod:`perseus_operator.jobs.lifecycle` reads, solves and writes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from perseus_api.conventions import parse_rfc3339, rfc3339
from perseus_api.job import PerseusJobSpec
from perseus_api.job_status import ConditionType, FrontierSummary, Phase, PlanStatus
from perseus_api.job_status import PerseusJobStatus as Status
from perseus_api.plan import Granularity, PipelinePlan, placeholder_plan
from perseus_api.schedule import Schedule
from perseus_operator.jobs.job_decisions import (
    Decision,
    JobRef,
    PlanInEffect,
    ReleaseNodePlans,
    ReplaceNodePlans,
    StatusDraft,
    StoreProfile,
    TargetFor,
)
from perseus_operator.jobs.node_status import node_plan_status
from perseus_operator.jobs.planning import (
    RETARGETED_PLAN,
    TMIN_PLAN,
    GatheredProfile,
    PlanningError,
    PlanningInput,
    applies_clocks,
    expected_savings_ratio,
    gather_profile,
    get_node_plans,
    get_profiling_spec,
)
from perseus_operator.jobs.profile_source import (
    BLOCKING_POWER_KEY,
    PIPELINE_KEY,
    PROFILE_KEY,
    PROFILE_REQUIRED,
    StartAction,
    StoredProfile,
    decide_start,
    pipeline_key,
    profile_labels,
    profiling_note,
)
from perseus_operator.jobs.profiling_watch import (
    ProfilingState,
    decide_profiling,
    profiling_progress,
)
from perseus_operator.workloads.ranks import RankPlacement
from perseus_planner import Frontier

__all__ = [
    "PendingDecision",
    "PlanningRequest",
    "ProfilingRound",
    "decide_frontier",
    "decide_lookup",
    "decide_pending",
    "decide_plans",
    "decide_profile_stored",
    "decide_profiling_round",
    "decide_profiling_start",
    "planning_failed",
    "planning_request",
    "profile_config_map_name",
    "profiling_placeholder_plan",
    "request_key",
]

Plans = Sequence[dict[str, Any]]


def profile_config_map_name(job: str) -> str:
    return f"{job}-profile"


# -- Pending -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PendingDecision:
    """``profile``: measure a profile next (once no other job holds the GPUs), ``note`` for
    the status message."""

    decision: Decision
    profile: bool = False
    note: str = ""


def decide_lookup(
    spec: PerseusJobSpec, status: Status, generation: int, found: StoredProfile | None, error: str
) -> Decision:
    """A ``profileRef`` that cannot be read (``error``) fails the job; else the step goes on
    to :func:`decide_pending`."""
    d = StatusDraft(status, generation)
    if error:
        d.fail("ProfileNotFound", error)
    return d.decision(go_on=found is not None or spec.profiling.profile_ref is None)


def decide_pending(
    spec: PerseusJobSpec,
    status: Status,
    generation: int,
    found: StoredProfile | None,
    product: str | None,
) -> PendingDecision:
    """Plan from the stored profile ``found`` (``Optimizing``), profile, or wait for one.

    ``product``: the GPU product of the job's nodes, for jobs that name a model."""
    d = StatusDraft(status, generation)
    stages = spec.parallelism.pipeline_stages
    start = decide_start(spec, found, product=product, stages=stages)
    if start.action == StartAction.PLAN:
        d.status.phase = Phase.OPTIMIZING
        d.condition(ConditionType.PROFILED, True, "ProfileFound", start.message)
    elif start.action == StartAction.REQUIRE_PROFILE:
        if d.status.message != start.message:
            d.event("Warning", PROFILE_REQUIRED, start.message)
        d.status.message = start.message
        d.condition(ConditionType.PROFILED, False, PROFILE_REQUIRED, start.message)
    else:
        return PendingDecision(d.decision(), profile=True, note=start.message)
    return PendingDecision(d.decision())


def decide_profiling_start(
    spec: PerseusJobSpec,
    status: Status,
    ref: JobRef,
    ranks: Sequence[RankPlacement],
    now_s: float,
    note: str,
) -> Decision:
    """The profiling node plans (every GPU sweeps its clocks), and phase ``Profiling``."""
    d = StatusDraft(status, ref.generation)
    s = d.status
    s.revision += 1
    profiling = get_profiling_spec(spec.policy, spec.profiling)
    node_plans = get_node_plans(
        namespace=ref.namespace,
        job=ref.name,
        revision=s.revision,
        granularity=Granularity.INSTRUCTION,
        ranks=ranks,
        plans={TMIN_PLAN: profiling_placeholder_plan(spec)},
        plan_of_replica={},
        profiling=profiling,
    )
    d.do(ReplaceNodePlans(node_plans))
    s.phase = Phase.PROFILING
    s.profiling_started_at = s.profiling_progress_at = rfc3339(now_s)
    s.profiling_progress = 0
    s.message = f"profiling {len(profiling.frequencies_mhz)} SM clocks on {len(ranks)} GPUs"
    if note:
        s.message += f". {note}"
    d.condition(ConditionType.PROFILED, False, "Profiling", s.message)
    return d.decision()


# -- Profiling ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfilingRound:
    """``gathered``: every GPU finished; the profile to store next."""

    decision: Decision
    gathered: GatheredProfile | None = None


def decide_profiling_round(
    spec: PerseusJobSpec,
    status: Status,
    generation: int,
    plans: Plans,
    ranks: Sequence[RankPlacement],
    now_s: float,
) -> ProfilingRound:
    """One look at the profiling node plans: progress, waiting, a call-in missed (the job
    fails and its GPUs are released), or the gathered profile."""
    d = StatusDraft(status, generation)
    s = d.status
    if s.profiling_started_at is None:  # profiling began under an older operator
        s.profiling_started_at = rfc3339(now_s)
    progress = profiling_progress(plans)
    if progress != s.profiling_progress or s.profiling_progress_at is None:
        s.profiling_progress, s.profiling_progress_at = progress, rfc3339(now_s)
    verdict = decide_profiling(
        plans,
        ranks,
        spec.parallelism.pipeline_stages,
        started_s=_unix_s(s.profiling_started_at, now_s),
        progress_at_s=_unix_s(s.profiling_progress_at, now_s),
        now_s=now_s,
        timeout_s=spec.profiling.training_process_timeout_seconds,
        note=profiling_note(spec),
    )
    if verdict.state in (ProfilingState.NO_TRAINING_PROCESS, ProfilingState.STALLED):
        d.do(ReleaseNodePlans())
        d.fail(verdict.state.value, verdict.message)
        d.condition(ConditionType.PROFILED, False, verdict.state.value, verdict.message)
        return ProfilingRound(d.decision(go_on=False))
    if verdict.state == ProfilingState.WAITING:
        s.message = verdict.message
        return ProfilingRound(d.decision(go_on=False))
    reports = [r for p in plans for r in node_plan_status(p).profiling]
    try:
        gathered = gather_profile(reports, spec.parallelism.pipeline_stages)
    except PlanningError as exc:
        d.fail("ProfilingFailed", str(exc))
        return ProfilingRound(d.decision(go_on=False))
    return ProfilingRound(d.decision(), gathered)


def decide_profile_stored(
    spec: PerseusJobSpec,
    status: Status,
    ref: JobRef,
    gathered: GatheredProfile,
    product: str | None,
) -> Decision:
    """Store the gathered profile in the job's ConfigMap; phase ``Optimizing``."""
    d = StatusDraft(status, ref.generation)
    data = {PROFILE_KEY: gathered.csv_text, PIPELINE_KEY: pipeline_key(spec)}
    if gathered.blocking_power_w is not None:
        data[BLOCKING_POWER_KEY] = f"{gathered.blocking_power_w:.6g}"
    name = profile_config_map_name(ref.name)
    d.do(StoreProfile(name, data, profile_labels(spec, product)))
    d.status.phase = Phase.OPTIMIZING
    message = f"profile of {gathered.gpus} GPUs stored in ConfigMap {name}"
    d.condition(ConditionType.PROFILED, True, "Profiled", message)
    d.event("Normal", "Profiled", message)
    return d.decision()


# -- Optimizing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanningRequest:
    """``request``: what to solve the frontier for, from the profile in ``config_map``."""

    decision: Decision
    request: PlanningInput | None = None
    config_map: str = ""


def planning_request(
    spec: PerseusJobSpec,
    status: Status,
    ref: JobRef,
    found: StoredProfile | None,
    error: str,
) -> PlanningRequest:
    """The planning request of the stored profile ``found``. Without one the job goes back to
    ``Pending`` to measure again (or fails: ``error``, no blocking power)."""
    d = StatusDraft(status, ref.generation)
    if error:
        d.fail("ProfileNotFound", error)
    if found is None:
        if d.status.phase != Phase.FAILED:
            d.status.phase = Phase.PENDING  # the profile is gone: measure again
        return PlanningRequest(d.decision(go_on=False))
    blocking_w = spec.policy.blocking_power_watts or found.blocking_power_w
    if blocking_w is None:
        d.fail(
            "BlockingPowerUnknown",
            "the profile has no measured blocking power; set policy.blockingPowerWatts",
        )
        return PlanningRequest(d.decision(go_on=False))
    request = PlanningInput(
        profile_csv=found.csv_text,
        profile_source=f"ConfigMap {ref.namespace}/{found.config_map}",
        schedule=spec.parallelism.schedule,
        num_stages=spec.parallelism.pipeline_stages,
        num_microbatches=spec.parallelism.microbatches,
        virtual_stages=spec.parallelism.virtual_stages,
        blocking_power_w=blocking_w,
        frequency_mhz=spec.policy.frequency_mhz,
    )
    return PlanningRequest(d.decision(), request, found.config_map)


def request_key(request: PlanningInput) -> str:
    """Tells apart the requests a solved frontier is kept for."""
    return hashlib.sha256(repr(request).encode()).hexdigest()[:16]


def planning_failed(status: Status, generation: int, message: str) -> Decision:
    d = StatusDraft(status, generation)
    d.fail("PlanningFailed", message)
    return d.decision(go_on=False)


def decide_frontier(
    status: Status, generation: int, frontier: Frontier, config_map: str
) -> Decision:
    """The frontier's summary in the status; plans for T_min (no straggler target) next."""
    d = StatusDraft(status, generation)
    d.status.frontier = FrontierSummary(
        tMinSeconds=float(frontier.times_s[frontier.t_min_index]),
        tStarSeconds=float(frontier.times_s[frontier.t_star_index]),
        tMaxSeconds=float(frontier.times_s[0]),
        points=len(frontier),
        profileConfigMap=config_map,
    )
    d.condition(ConditionType.OPTIMIZED, True, "Optimized", f"frontier of {len(frontier)} points")
    d.do(TargetFor(None))
    return d.decision()


def decide_plans(
    spec: PerseusJobSpec,
    status: Status,
    ref: JobRef,
    ranks: Sequence[RankPlacement],
    tmin: PipelinePlan,
    retargeted: PipelinePlan | None,
    stragglers: Collection[int],
    power_limits_w: Mapping[str, float] | None = None,
) -> Decision:
    """A new plan revision: ``tmin`` (T_min or the slowdown budget) for every replica, or
    ``retargeted`` (the straggler target) for all but the ``stragglers``; phase ``Running``.
    In mode Observe no node plan is written (the plans are only reported). ``power_limits_w``:
    a power budget's per-GPU limits, by node (:mod:`perseus_operator.jobs.power_limits`)."""
    d = StatusDraft(status, ref.generation)
    s = d.status
    plans = {TMIN_PLAN: tmin}
    plan_of_replica: dict[int, str] = {}
    current = tmin
    if retargeted is not None:
        plans[RETARGETED_PLAN] = retargeted
        dp = spec.parallelism.data_parallel
        plan_of_replica = {r: RETARGETED_PLAN for r in range(dp) if r not in stragglers}
        current = retargeted
    s.revision += 1
    d.do(PlanInEffect(current))
    estimate = current.estimate
    s.plan = PlanStatus(
        targetIterationSeconds=estimate.iteration_time_s,
        expectedSavingsRatio=expected_savings_ratio(current),
        revision=s.revision,
    )
    if not applies_clocks(spec.policy):
        d.do(ReleaseNodePlans())
        s.message = "Observe mode: plans computed, no clock changed"
        d.condition(ConditionType.PLAN_APPLIED, False, "Observe", s.message)
    else:
        node_plans = get_node_plans(
            namespace=ref.namespace,
            job=ref.name,
            revision=s.revision,
            granularity=spec.policy.granularity,
            ranks=ranks,
            plans=plans,
            plan_of_replica=plan_of_replica,
            power_limits_w=power_limits_w,
        )
        d.do(ReplaceNodePlans(node_plans))
        s.message = (
            f"plan revision {s.revision}: target {estimate.iteration_time_s:.4g} s, "
            f"expected savings {expected_savings_ratio(current):.1%}"
        )
        d.event("Normal", "PlanWritten", s.message)
    s.phase = Phase.RUNNING
    return d.decision()


def profiling_placeholder_plan(spec: PerseusJobSpec) -> PipelinePlan:
    """A plan that only says which computations each stage runs, for profiling node plans
    (the agents measure instead of applying it)."""
    p = spec.parallelism
    schedule = Schedule.parse(p.schedule.value).value
    clock = get_profiling_spec(spec.policy, spec.profiling).frequencies_mhz[0]
    return placeholder_plan(schedule, p.pipeline_stages, p.microbatches, p.virtual_stages, clock)


def _unix_s(stamp: str, default_s: float) -> float:
    """Unix seconds of an RFC 3339 time (``default_s`` when it cannot be read)."""
    when = parse_rfc3339(stamp)
    return default_s if when is None else when.timestamp()
