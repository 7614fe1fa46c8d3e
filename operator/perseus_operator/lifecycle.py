"""One reconcile step of a PerseusJob: observe, decide, write, report.

The kopf handlers call :func:`reconcile` on every change of the job and on a timer. Each call
reads what it needs (pods, node plans and their agent reports, the stored profile), moves the
job along ``Pending → Profiling → Optimizing → Running → Completed/Failed`` as far as it can,
writes node plans and ConfigMaps, and returns the new status plus the events to emit. All the
state that must survive an operator restart is in the cluster: the phase and plan revision in
the status, the profile in a ConfigMap owned by the job, the plans in PerseusNodePlans. What
is kept in memory (:class:`JobMemo`: the solved frontier, the straggler detector) is rebuilt
from those when missing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from pydantic import ValidationError

from perseus_api import resources
from perseus_api.conventions import now_rfc3339, parse_rfc3339, rfc3339, transition_time
from perseus_api.errors import validation_summary
from perseus_api.job import (
    Condition,
    ConditionType,
    FrontierSummary,
    Mode,
    PerseusJobSpec,
    PerseusJobStatus,
    Phase,
    PlanStatus,
    StragglerStatus,
    WorkloadKind,
    with_default_policy,
)
from perseus_api.node_plan import NodePlan
from perseus_api.node_report import NodePlanStatus
from perseus_api.plan import (
    Granularity,
    InstructionClock,
    PipelinePlan,
    PlanEstimate,
    PlanObjective,
    StagePlan,
)
from perseus_api.schedule import Schedule, gpu_computation_order
from perseus_operator.gpu_conflicts import (
    CONFLICT_REASON,
    GpuClaim,
    claims_of_node_plans,
    decide_gpu_conflict,
    planned_gpus,
)
from perseus_operator.metrics import max_iterations
from perseus_operator.node_status import node_plan_status
from perseus_operator.objects import labels_of
from perseus_operator.planning import (
    RETARGETED_PLAN,
    TMIN_PLAN,
    PlanningError,
    PlanningInput,
    applies_clocks,
    choose_plan,
    expected_savings_ratio,
    gather_profile,
    get_node_plans,
    get_profiling_spec,
)
from perseus_operator.profile_source import (
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
from perseus_operator.profile_store import GpuProducts, find_profile
from perseus_operator.profiling_watch import ProfilingState, decide_profiling, profiling_progress
from perseus_operator.stragglers import RankSample, StragglerDetector, StragglerVerdict
from perseus_operator.workloads import (
    RankPlacement,
    WorkloadEnd,
    WorkloadError,
    matches,
    pod_selector,
    resolve_ranks,
    workload_end,
    workload_failed,
    workload_finished,
)
from perseus_planner import Frontier

STRAGGLER_STATE_ANNOTATION: Final = f"{resources.GROUP}/straggler-state"
# The Degraded reason while a pod of a workload object failed and its controller has not said
# whether it runs the pod again or ends the workload.
POD_FAILED_REASON: Final = "PodFailed"
"""The straggler detector's memory, so a restarted operator neither forgets nor re-detects."""


class JobIO(Protocol):
    """The cluster as the reconcile step sees it (:class:`~perseus_operator.kube.KubeClient`)."""

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    async def get_workload(
        self, namespace: str, kind: WorkloadKind, name: str
    ) -> dict[str, Any] | None: ...

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def list_config_maps(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    async def put_config_map(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        owner: Mapping[str, Any],
        annotations: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None: ...

    async def get_node(self, name: str) -> dict[str, Any] | None: ...

    async def list_node_plans(self, namespace: str, job: str) -> list[dict[str, Any]]: ...

    async def list_namespace_node_plans(self, namespace: str) -> list[dict[str, Any]]: ...

    async def list_jobs(
        self, namespace: str | None, selector: str = ""
    ) -> list[dict[str, Any]]: ...

    async def put_node_plan(self, body: Mapping[str, Any], owner: Mapping[str, Any]) -> None: ...

    async def delete_node_plan(self, namespace: str, name: str) -> None: ...


class Planner(Protocol):
    """Solves frontiers off the event loop (a process pool with a time limit)."""

    async def solve(self, request: PlanningInput) -> Frontier: ...


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to emit on the job."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class JobMemo:
    """In-memory state of one job; everything here can be rebuilt from the cluster."""

    frontier: Frontier | None = None
    frontier_key: str = ""
    frontier_generation: int | None = None
    """The job generation the frontier was checked against its stored profile for."""
    detector: StragglerDetector | None = None
    detector_key: str = ""
    retarget_s: float | None = None
    """The straggler target the current plans were written for (None: T_min for all)."""
    plan: PipelinePlan | None = None
    """The plan of the healthy replicas now (for the savings metrics)."""
    gpu_products: GpuProducts = field(default_factory=GpuProducts)


@dataclass
class Outcome:
    status: PerseusJobStatus
    events: list[Event] = field(default_factory=list)
    plan: PipelinePlan | None = None
    """The plan now in effect (for metrics)."""
    iterations: int = 0
    """Most iterations a rank of the job has reported."""
    new_stragglers: int = 0
    detector_state: str | None = None
    """JSON for :data:`STRAGGLER_STATE_ANNOTATION` (None: leave it as it is)."""


@dataclass(frozen=True)
class JobRef:
    namespace: str
    name: str
    uid: str
    generation: int
    owner: Mapping[str, Any]
    created: str = ""
    """``metadata.creationTimestamp``: the older of two jobs on the same GPUs keeps them."""


def profile_config_map_name(job: str) -> str:
    return f"{job}-profile"


# -- entry point -------------------------------------------------------------------------------


async def reconcile(
    body: Mapping[str, Any],
    io: JobIO,
    planner: Planner,
    memo: JobMemo,
    *,
    now_s: float | None = None,
    default_policy: Mapping[str, Any] | None = None,
) -> Outcome:
    """Advance the job as far as the cluster allows; never raises for the job's own problems
    (they become the status' message, conditions and events).

    ``now_s``: Unix time (the agents' reports carry wall-clock times); default now.
    ``default_policy``: values of the ``spec.policy`` fields the job leaves unset.
    """
    from perseus_operator.kube import owner_reference

    metadata = body.get("metadata") or {}
    ref = JobRef(
        namespace=str(metadata.get("namespace") or "default"),
        name=str(metadata.get("name") or ""),
        uid=str(metadata.get("uid") or ""),
        generation=int(metadata.get("generation") or 0),
        owner=owner_reference(body),
        created=str(metadata.get("creationTimestamp") or ""),
    )
    try:
        status = PerseusJobStatus.model_validate(body.get("status") or {})
    except ValidationError:
        status = PerseusJobStatus()  # an unreadable status is rebuilt, not trusted
    step = _Step(ref, status, io, planner, memo, time.time() if now_s is None else now_s)
    step.saved_detector = (metadata.get("annotations") or {}).get(STRAGGLER_STATE_ANNOTATION)
    try:
        raw_spec = body.get("spec") or {}
        spec = PerseusJobSpec.model_validate(with_default_policy(raw_spec, default_policy))
    except ValidationError as exc:
        step.fail("InvalidSpec", f"invalid spec: {validation_summary(exc)}")
        return step.outcome()
    step.status.mode = spec.policy.mode
    step.status.granularity = spec.policy.granularity
    await step.run(spec)
    return step.outcome()


# -- the step ----------------------------------------------------------------------------------


class _Step:
    def __init__(
        self,
        ref: JobRef,
        status: PerseusJobStatus,
        io: JobIO,
        planner: Planner,
        memo: JobMemo,
        now_s: float,
    ) -> None:
        self.ref = ref
        self.status = status.model_copy(deep=True)
        self.before = status
        self.io = io
        self.planner = planner
        self.memo = memo
        self.now_s = now_s
        self.events: list[Event] = []
        self.iterations = 0
        self.new_stragglers = 0
        self.saved_detector: str | None = None

    def outcome(self) -> Outcome:
        if self.status.phase != self.before.phase:
            self.event("Normal", "Phase", f"{self.before.phase.value} → {self.status.phase.value}")
        plan = self.memo.plan if self.status.phase == Phase.RUNNING else None
        state = None
        if self.memo.detector is not None and self.status.phase == Phase.RUNNING:
            new = self.memo.detector.to_state()
            # Written only when what decides stragglers changed, not at every report.
            if self.saved_detector is None or _decisive(new) != _decisive_json(self.saved_detector):
                state = json.dumps(new, separators=(",", ":"))
        return Outcome(self.status, self.events, plan, self.iterations, self.new_stragglers, state)

    # -- status helpers --

    def event(self, kind: str, reason: str, message: str) -> None:
        self.events.append(Event(kind, reason, message))

    def condition(self, kind: ConditionType, ok: bool, reason: str, message: str = "") -> None:
        value: Literal["True", "False"] = "True" if ok else "False"
        for c in self.status.conditions:
            if c.type == kind:
                c.last_transition_time = transition_time(
                    value, c.status, c.last_transition_time, now_rfc3339()
                )
                c.status, c.reason, c.message = value, reason, message
                c.observed_generation = self.ref.generation
                return
        self.status.conditions.append(
            Condition(
                type=kind,
                status=value,
                reason=reason,
                message=message,
                lastTransitionTime=now_rfc3339(),
                observedGeneration=self.ref.generation,
            )
        )

    def fail(self, reason: str, message: str) -> None:
        if self.status.phase != Phase.FAILED or self.status.message != message:
            self.event("Warning", reason, message)
        self.status.phase = Phase.FAILED
        self.status.message = message
        self.status.observed_generation = self.ref.generation
        self.condition(ConditionType.DEGRADED, True, reason, message)

    # -- phases --

    async def run(self, spec: PerseusJobSpec) -> None:
        status = self.status
        if status.observed_generation != self.ref.generation:
            self._spec_changed(spec)
        if status.phase in (Phase.COMPLETED, Phase.FAILED):
            return
        pods, ranks, ended = await self._resolve(spec)
        if ended is not None:  # by the workload object's own status, pods or not
            finished, failure = ended.failure is None, ended.failure
        elif ranks is None:
            return
        elif spec.workload.kind == WorkloadKind.PODS:
            finished, failure = workload_finished(pods), workload_failed(pods)
        elif (failed := workload_failed(pods)) is not None:
            # A workload object ends by its controller's word: under restartPolicy
            # OnFailure/ExitCode or a backoffLimit the failed pod is run again, so the job
            # keeps its plans and waits for the retry or for the object's Failed condition.
            kind = spec.workload.kind.value
            self.condition(
                ConditionType.DEGRADED,
                True,
                POD_FAILED_REASON,
                f"{failed}; waiting for the {kind} to run it again or to end",
            )
            return
        else:
            finished, failure = False, None
        if finished or failure is not None:
            await self._release_plans()
            if failure is not None:
                self.fail("WorkloadFailed", failure)
            else:
                status.phase = Phase.COMPLETED
                status.message = "the workload finished; every GPU clock was reset"
            return
        assert ranks is not None  # an ended workload returned above
        self._clear_pod_trouble()
        # Checked where node plans exist (here) or are about to be written (_start, _optimize):
        # a job that fails for its own reasons says those, whoever holds its GPUs.
        if status.phase in (
            Phase.PROFILING,
            Phase.RUNNING,
        ) and await self._gpus_held_by_an_older_job(ranks):
            return
        if status.phase == Phase.PENDING:
            await self._start(spec, ranks)
        if status.phase == Phase.PROFILING:
            await self._profile(spec, ranks)
        if status.phase == Phase.OPTIMIZING:
            await self._optimize(spec, ranks)
        if status.phase == Phase.RUNNING:
            await self._run(spec, ranks)

    def _spec_changed(self, spec: PerseusJobSpec) -> None:
        """A new generation: plan again (the profile is reused when it still fits)."""
        status = self.status
        if status.phase == Phase.COMPLETED:
            return
        if status.observed_generation is not None:
            self.event("Normal", "SpecChanged", "spec changed; planning again")
        status.phase = Phase.PENDING
        status.observed_generation = self.ref.generation
        status.message = ""
        status.conditions = [
            c for c in status.conditions if c.type != ConditionType.DEGRADED or c.status != "True"
        ]
        self.memo.detector = None

    async def _resolve(
        self, spec: PerseusJobSpec
    ) -> tuple[list[dict[str, Any]], tuple[RankPlacement, ...] | None, WorkloadEnd | None]:
        workload = spec.workload
        if workload.kind != WorkloadKind.PODS:
            assert workload.name is not None
            found = await self.io.get_workload(self.ref.namespace, workload.kind, workload.name)
            if found is None:
                self._wait(
                    "WorkloadNotFound",
                    f"{workload.kind.value} {self.ref.namespace}/{workload.name} does not exist "
                    "(yet); waiting for it",
                )
                return [], None, None
            ended = workload_end(workload.kind, found)
            if ended is not None:
                return [], None, ended
        pods = await self.io.list_pods(self.ref.namespace, pod_selector(workload))
        if workload.pod_selector is not None:  # the API's filtering is trusted, and checked
            selector = workload.pod_selector
            pods = [p for p in pods if matches(selector, labels_of(p))]
        try:
            resolution = resolve_ranks(pods, workload, spec.parallelism, spec.rank_mapping)
        except WorkloadError as exc:
            self.fail("InvalidWorkload", str(exc))
            return pods, None, None
        if resolution.waiting is not None:
            if self.status.phase in (Phase.PENDING,):
                self._wait("WaitingForPods", resolution.waiting)
                return pods, None, None
            # Running jobs whose pods are rescheduled keep their plans until they come back.
            self.condition(ConditionType.DEGRADED, True, "WaitingForPods", resolution.waiting)
            return pods, None, None
        self.status.nodes = sorted({r.node for r in resolution.ranks})
        return pods, resolution.ranks, None

    async def _gpus_held_by_an_older_job(self, ranks: Sequence[RankPlacement]) -> bool:
        """Whether another, older job's node plans hold some of this job's GPUs; if so this
        job withdraws its own node plans and waits (condition ``GpuConflict``)."""
        ns = self.ref.namespace
        mine = frozenset((r.node, r.gpu_key) for r in ranks)
        others = [
            p
            for p in await self.io.list_namespace_node_plans(ns)
            if (p.get("spec") or {}).get("job") != self.ref.name
        ]
        conflict = None
        # The jobs (for their ages) are read only when some plan is on one of our GPUs.
        if planned_gpus(others) & mine:
            me = GpuClaim(ns, self.ref.name, self.ref.created, mine)
            claims = claims_of_node_plans(others, await self.io.list_jobs(ns))
            conflict = decide_gpu_conflict(me, claims)
        held = any(
            c.type == ConditionType.DEGRADED and c.reason == CONFLICT_REASON and c.status == "True"
            for c in self.status.conditions
        )
        if conflict is None:
            if held:
                self.condition(ConditionType.DEGRADED, False, "GpuConflictResolved")
                self.status.message = ""
            return False
        await self._release_plans()
        if not held or self.status.message != conflict.message:
            self.event("Warning", CONFLICT_REASON, conflict.message)
        self.status.phase = Phase.PENDING
        self.status.message = conflict.message
        self.condition(ConditionType.DEGRADED, True, CONFLICT_REASON, conflict.message)
        return True

    def _clear_pod_trouble(self) -> None:
        """Every pod is back (retried, rescheduled): a Degraded condition that said otherwise
        turns False."""
        for c in self.status.conditions:
            if (
                c.type == ConditionType.DEGRADED
                and c.status == "True"
                and c.reason in (POD_FAILED_REASON, "WaitingForPods")
            ):
                self.condition(ConditionType.DEGRADED, False, "PodsRunning", "every pod runs")

    def _wait(self, reason: str, message: str) -> None:
        self.status.message = message
        self.condition(ConditionType.DEGRADED, False, reason, message)

    async def _start(self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]) -> None:
        found = await self._stored_profile(spec, ranks)
        if found is None and spec.profiling.profile_ref is not None:
            return  # _stored_profile failed the job with the reason
        product = await self._gpu_product(ranks) if spec.profiling.model else None
        stages = spec.parallelism.pipeline_stages
        decision = decide_start(spec, found, product=product, stages=stages)
        if decision.action == StartAction.PLAN:
            self.status.phase = Phase.OPTIMIZING
            self.condition(ConditionType.PROFILED, True, "ProfileFound", decision.message)
            return
        if decision.action == StartAction.REQUIRE_PROFILE:
            if self.status.message != decision.message:
                self.event("Warning", PROFILE_REQUIRED, decision.message)
            self.status.message = decision.message
            self.condition(ConditionType.PROFILED, False, PROFILE_REQUIRED, decision.message)
            return
        if await self._gpus_held_by_an_older_job(ranks):
            return
        self.status.revision += 1
        plans = {TMIN_PLAN: profiling_placeholder_plan(spec)}
        node_plans = get_node_plans(
            namespace=self.ref.namespace,
            job=self.ref.name,
            revision=self.status.revision,
            granularity=Granularity.INSTRUCTION,
            ranks=ranks,
            plans=plans,
            plan_of_replica={},
            profiling=get_profiling_spec(spec.policy, spec.profiling),
        )
        await self._write_node_plans(node_plans)
        clocks = len(get_profiling_spec(spec.policy, spec.profiling).frequencies_mhz)
        self.status.phase = Phase.PROFILING
        self.status.profiling_started_at = self.status.profiling_progress_at = rfc3339(self.now_s)
        self.status.profiling_progress = 0
        self.status.message = f"profiling {clocks} SM clocks on {len(ranks)} GPUs"
        if decision.message:
            self.status.message += f". {decision.message}"
        self.condition(ConditionType.PROFILED, False, "Profiling", self.status.message)

    async def _stored_profile(
        self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]
    ) -> StoredProfile | None:
        """A profile to plan from, if one fits (:func:`~perseus_operator.profile_store.
        find_profile`); a ``profileRef`` that cannot be read fails the job."""
        found = await find_profile(
            self.io,
            self.ref.namespace,
            profile_config_map_name(self.ref.name),
            spec,
            [r.node for r in ranks],
            self.memo.gpu_products,
        )
        if found.error:
            self.fail("ProfileNotFound", found.error)
        return found.profile

    async def _gpu_product(self, ranks: Sequence[RankPlacement]) -> str | None:
        return await self.memo.gpu_products.of(self.io, [r.node for r in ranks])

    async def _profile(self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]) -> None:
        plans = await self.io.list_node_plans(self.ref.namespace, self.ref.name)
        status = self.status
        if status.profiling_started_at is None:  # profiling began under an older operator
            status.profiling_started_at = rfc3339(self.now_s)
        progress = profiling_progress(plans)
        if progress != status.profiling_progress or status.profiling_progress_at is None:
            status.profiling_progress, status.profiling_progress_at = progress, rfc3339(self.now_s)
        verdict = decide_profiling(
            plans,
            ranks,
            spec.parallelism.pipeline_stages,
            started_s=_parse_rfc3339(status.profiling_started_at, self.now_s),
            progress_at_s=_parse_rfc3339(status.profiling_progress_at, self.now_s),
            now_s=self.now_s,
            timeout_s=spec.profiling.training_process_timeout_seconds,
            note=profiling_note(spec),
        )
        if verdict.state in (ProfilingState.NO_TRAINING_PROCESS, ProfilingState.STALLED):
            await self._release_plans()
            self.fail(verdict.state.value, verdict.message)
            self.condition(ConditionType.PROFILED, False, verdict.state.value, verdict.message)
            return
        if verdict.state == ProfilingState.WAITING:
            self.status.message = verdict.message
            return
        reports = [r for p in plans for r in node_plan_status(p).profiling]
        stages = spec.parallelism.pipeline_stages
        try:
            gathered = gather_profile(reports, stages)
        except PlanningError as exc:
            self.fail("ProfilingFailed", str(exc))
            return
        data = {PROFILE_KEY: gathered.csv_text, PIPELINE_KEY: pipeline_key(spec)}
        if gathered.blocking_power_w is not None:
            data[BLOCKING_POWER_KEY] = f"{gathered.blocking_power_w:.6g}"
        name = profile_config_map_name(self.ref.name)
        product = await self._gpu_product(ranks) if spec.profiling.model else None
        await self.io.put_config_map(
            self.ref.namespace,
            name,
            data,
            self.ref.owner,
            labels=profile_labels(spec, product),
        )
        self.status.phase = Phase.OPTIMIZING
        message = f"profile of {gathered.gpus} GPUs stored in ConfigMap {name}"
        self.condition(ConditionType.PROFILED, True, "Profiled", message)
        self.event("Normal", "Profiled", message)

    async def _frontier(
        self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]
    ) -> tuple[Frontier, str] | None:
        frontier_status = self.status.frontier
        if (
            self.memo.frontier is not None
            and self.memo.frontier_generation == self.ref.generation
            and frontier_status is not None
        ):
            # Solved for this spec already: no need to read the profile again every tick.
            return self.memo.frontier, frontier_status.profile_config_map
        profile = await self._stored_profile(spec, ranks)
        if profile is None:
            if self.status.phase != Phase.FAILED:
                self.status.phase = Phase.PENDING  # the profile is gone: measure again
            return None
        csv_text, measured_w, cm_name = (
            profile.csv_text,
            profile.blocking_power_w,
            profile.config_map,
        )
        blocking_w = spec.policy.blocking_power_watts or measured_w
        if blocking_w is None:
            self.fail(
                "BlockingPowerUnknown",
                "the profile has no measured blocking power; set policy.blockingPowerWatts",
            )
            return None
        request = PlanningInput(
            profile_csv=csv_text,
            profile_source=f"ConfigMap {self.ref.namespace}/{cm_name}",
            schedule=spec.parallelism.schedule,
            num_stages=spec.parallelism.pipeline_stages,
            num_microbatches=spec.parallelism.microbatches,
            virtual_stages=spec.parallelism.virtual_stages,
            blocking_power_w=blocking_w,
            frequency_mhz=spec.policy.frequency_mhz,
        )
        key = _digest(repr(request))
        if self.memo.frontier is None or self.memo.frontier_key != key:
            try:
                self.memo.frontier = await self.planner.solve(request)
            except PlanningError as exc:
                self.fail("PlanningFailed", str(exc))
                return None
            self.memo.frontier_key = key
        self.memo.frontier_generation = self.ref.generation
        return self.memo.frontier, cm_name

    async def _optimize(self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]) -> None:
        solved = await self._frontier(spec, ranks)
        if solved is None:
            return
        frontier, cm_name = solved
        t_min = float(frontier.times_s[frontier.t_min_index])
        self.status.frontier = FrontierSummary(
            tMinSeconds=t_min,
            tStarSeconds=float(frontier.times_s[frontier.t_star_index]),
            tMaxSeconds=float(frontier.times_s[0]),
            points=len(frontier),
            profileConfigMap=cm_name,
        )
        self.condition(
            ConditionType.OPTIMIZED, True, "Optimized", f"frontier of {len(frontier)} points"
        )
        self.memo.retarget_s = None
        if await self._gpus_held_by_an_older_job(ranks):
            return
        await self._write_plans(spec, ranks, frontier, {})
        self.status.phase = Phase.RUNNING

    async def _write_plans(
        self,
        spec: PerseusJobSpec,
        ranks: Sequence[RankPlacement],
        frontier: Frontier,
        stragglers: Mapping[int, Any],
    ) -> None:
        """Plans for the current target: T_min (or the slowdown budget) for every replica, or,
        with stragglers, the straggler target for the others."""
        # Building a plan takes tens of milliseconds: not on the event loop.
        tmin = await asyncio.to_thread(choose_plan, frontier, spec.policy)
        plans = {TMIN_PLAN: tmin}
        plan_of_replica: dict[int, str] = {}
        target = self.memo.retarget_s
        current = tmin
        if target is not None and stragglers:
            retargeted = await asyncio.to_thread(
                choose_plan, frontier, spec.policy, straggler_target_s=target
            )
            plans[RETARGETED_PLAN] = retargeted
            dp = spec.parallelism.data_parallel
            plan_of_replica = {d: RETARGETED_PLAN for d in range(dp) if d not in stragglers}
            current = retargeted
        self.status.revision += 1
        self.memo.plan = current
        estimate = current.estimate
        self.status.plan = PlanStatus(
            targetIterationSeconds=estimate.iteration_time_s,
            expectedSavingsRatio=expected_savings_ratio(current),
            revision=self.status.revision,
        )
        if not applies_clocks(spec.policy):
            await self._release_plans()
            self.status.message = "Observe mode: plans computed, no clock changed"
            self.condition(ConditionType.PLAN_APPLIED, False, "Observe", self.status.message)
            return
        node_plans = get_node_plans(
            namespace=self.ref.namespace,
            job=self.ref.name,
            revision=self.status.revision,
            granularity=spec.policy.granularity,
            ranks=ranks,
            plans=plans,
            plan_of_replica=plan_of_replica,
        )
        await self._write_node_plans(node_plans)
        self.status.message = (
            f"plan revision {self.status.revision}: target {estimate.iteration_time_s:.4g} s, "
            f"expected savings {expected_savings_ratio(current):.1%}"
        )
        self.event("Normal", "PlanWritten", self.status.message)

    async def _run(self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]) -> None:
        solved = await self._frontier(spec, ranks)
        if solved is None:
            return
        frontier, _ = solved
        plans = await self.io.list_node_plans(self.ref.namespace, self.ref.name)
        self.iterations = max_iterations(plans)
        if applies_clocks(spec.policy):
            self._applied_condition(plans)
        samples = rank_samples(plans, ranks, now_s=self.now_s)
        planned_s = fastest_planned_s(plans)
        detector = self._detector(spec)
        if self.memo.plan is None:  # after a restart: the plan of the target in effect
            self.memo.retarget_s = planned_target_s(
                detector.published_target_s, detector.reference_s, planned_s
            )
            self.memo.plan = await asyncio.to_thread(
                choose_plan, frontier, spec.policy, straggler_target_s=self.memo.retarget_s
            )
        verdict = detector.observe(samples, self.now_s)
        self._report_stragglers(verdict)
        if spec.policy.mode != Mode.STRAGGLER_AWARE or not verdict.changed:
            return
        self.memo.retarget_s = (
            planned_target_s(verdict.target_s, detector.reference_s, planned_s)
            if verdict.stragglers
            else None
        )
        await self._write_plans(spec, ranks, frontier, verdict.stragglers)

    def _detector(self, spec: PerseusJobSpec) -> StragglerDetector:
        key = spec.stragglers.model_dump_json()
        if self.memo.detector is None and self.saved_detector:
            # A restarted operator: resume the saved counters and the target in effect.
            try:
                state = json.loads(self.saved_detector)
                self.memo.detector = StragglerDetector.from_state(spec.stragglers, state)
                self.memo.detector_key = key
            except (ValueError, TypeError, KeyError):
                self.memo.detector = None  # unreadable: start afresh
        if self.memo.detector is None or self.memo.detector_key != key:
            self.memo.detector = StragglerDetector(spec.stragglers)
            self.memo.detector_key = key
        return self.memo.detector

    def _report_stragglers(self, verdict: StragglerVerdict) -> None:
        previous = {s.data_parallel_rank: s for s in self.status.stragglers}
        self.status.stragglers = [
            StragglerStatus(
                dataParallelRank=s.dp_rank,
                node=s.node,
                slowdown=round(s.slowdown, 4),
                since=previous[s.dp_rank].since if s.dp_rank in previous else now_rfc3339(),
            )
            for s in sorted(verdict.stragglers.values(), key=lambda s: s.dp_rank)
        ]
        self.new_stragglers = len(set(verdict.stragglers) - set(previous))
        for dp in sorted(set(verdict.stragglers) - set(previous)):
            s = verdict.stragglers[dp]
            self.event(
                "Warning",
                "StragglerDetected",
                f"data-parallel replica {dp} on node {s.node} is {s.slowdown:.3f}x slower",
            )
        for dp in sorted(set(previous) - set(verdict.stragglers)):
            self.event("Normal", "StragglerRecovered", f"data-parallel replica {dp} recovered")
        if verdict.stragglers:
            names = ", ".join(str(d) for d in sorted(verdict.stragglers))
            self.condition(
                ConditionType.STRAGGLER_DETECTED, True, "Straggler", f"replica(s) {names}"
            )
        else:
            self.condition(ConditionType.STRAGGLER_DETECTED, False, "NoStraggler")
        if verdict.degraded_nodes:
            nodes = ", ".join(sorted(verdict.degraded_nodes))
            self.condition(
                ConditionType.DEGRADED, True, "StaleTelemetry", f"no recent reports from {nodes}"
            )
        elif any(
            c.type == ConditionType.DEGRADED and c.reason == "StaleTelemetry" and c.status == "True"
            for c in self.status.conditions
        ):
            self.condition(ConditionType.DEGRADED, False, "TelemetryRecovered")

    def _applied_condition(self, plans: Sequence[Mapping[str, Any]]) -> None:
        revision = self.status.revision
        behind, failed = [], []
        for p in plans:
            status = node_plan_status(p)
            node = (p.get("spec") or {}).get("node", "?")
            if status.observed_revision != revision:
                behind.append(node)
                continue
            for c in status.conditions:
                if c.type == resources.CONDITION_APPLIED and c.status != "True":
                    failed.append(f"{node}: {c.message}")
        if failed:
            self.condition(ConditionType.PLAN_APPLIED, False, "ApplyFailed", "; ".join(failed))
        elif behind:
            message = f"waiting for the agents of {', '.join(sorted(behind))}"
            self.condition(ConditionType.PLAN_APPLIED, False, "Pending", message)
        else:
            self.condition(
                ConditionType.PLAN_APPLIED, True, "Applied", f"revision {revision} on all nodes"
            )

    # -- writing --

    async def _write_node_plans(self, node_plans: Mapping[str, NodePlan]) -> None:
        existing = await self.io.list_node_plans(self.ref.namespace, self.ref.name)
        wanted = {resources.node_plan_name(p.job, p.node) for p in node_plans.values()}
        for plan in node_plans.values():
            await self.io.put_node_plan(resources.node_plan_object(plan), self.ref.owner)
        for obj in existing:
            namespace, name = resources.object_key(obj)
            if name not in wanted:
                await self.io.delete_node_plan(namespace, name)

    async def _release_plans(self) -> None:
        for obj in await self.io.list_node_plans(self.ref.namespace, self.ref.name):
            await self.io.delete_node_plan(*resources.object_key(obj))


# -- pure helpers ------------------------------------------------------------------------------


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _parse_rfc3339(stamp: str, default_s: float) -> float:
    """Unix seconds of an RFC 3339 time (``default_s`` when it cannot be read)."""
    when = parse_rfc3339(stamp)
    return default_s if when is None else when.timestamp()


def rank_samples(
    plans: Sequence[Mapping[str, Any]], ranks: Sequence[RankPlacement], *, now_s: float
) -> list[RankSample]:
    """The straggler detector's input from the agents' reports in the node plans' status.

    A report's time is its ``reportedAt`` (Unix seconds), else ``now_s``. A report measured
    under an older revision of its node plan than the one written is left out (agents say which
    revision their mean covers). Each rank's mean is given at the pace of the job's fastest
    plan: times the fastest plan's expected iteration time over that of the rank's own plan.
    So a replica re-targeted to a straggler's ``T'`` on purpose neither looks slow nor moves
    the baseline the straggler is measured against, which would end the straggler state as
    soon as the re-targeted plans took effect, and start it again once they were undone.
    """
    placed = {r.rank: r for r in ranks}
    expected = [expected_iteration_s(plan) for plan in plans]
    fastest_s = fastest_planned_s(plans)
    samples = []
    for plan, expected_s in zip(plans, expected, strict=True):
        status = node_plan_status(plan)
        spec = plan.get("spec") or {}
        node = spec.get("node", "")
        reported_at = _reported_at_s(status, now_s)
        for report in status.ranks:
            rank, mean_s, iterations = report.rank, report.mean_iteration_s, report.iterations
            where = placed.get(rank)
            if where is None or not math.isfinite(mean_s) or mean_s <= 0:
                continue
            measured_under = report.revision
            if measured_under is not None and measured_under != spec.get("revision"):
                continue
            own_s = expected_s.get(rank)
            if fastest_s is not None and own_s is not None:
                mean_s *= fastest_s / own_s
            samples.append(
                RankSample(
                    rank=rank,
                    dp_rank=where.dp_rank,
                    pp_rank=where.pp_rank,
                    node=node or where.node,
                    iterations=iterations,
                    mean_iteration_s=mean_s,
                    reported_at_s=reported_at,
                )
            )
    return samples


def fastest_planned_s(plans: Sequence[Mapping[str, Any]]) -> float | None:
    """The planned iteration time of the job's fastest plan: the pace :func:`rank_samples`
    gives every rank's measured time at (None without plans)."""
    return min((s for plan in plans for s in expected_iteration_s(plan).values()), default=None)


def planned_target_s(
    measured_target_s: float | None, reference_s: float | None, planned_s: float | None
) -> float | None:
    """The straggler's ``T'`` in the frontier's time: its slowdown over the other replicas
    (both measured) times the planned iteration time of the plan they were measured at.

    Measured iteration times carry what the profile does not (the gradient all-reduce, data
    loading, framework overhead), so the wall-clock ``T'`` taken as a frontier time would
    re-target the healthy replicas to run slower than the straggler. Without a reference
    (no replica measured yet) or plans, the measured ``T'`` is used as it is.
    """
    if measured_target_s is None:
        return None
    if reference_s is None or reference_s <= 0 or planned_s is None:
        return measured_target_s
    return measured_target_s / reference_s * planned_s


def expected_iteration_s(plan: Mapping[str, Any]) -> dict[int, float]:
    """Expected iteration time (seconds) of each rank's plan in a node plan's spec."""
    spec = plan.get("spec") or {}
    pipelines = spec.get("plans") or {}
    estimate_key = (
        "stage_estimate" if spec.get("granularity") == Granularity.STAGE else "instruction_estimate"
    )
    out: dict[int, float] = {}
    for assignment in spec.get("assignments") or ():
        try:
            seconds = float(pipelines[assignment["plan"]][estimate_key]["iteration_time_s"])
            rank = int(assignment["rank"])
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(seconds) and seconds > 0:
            out[rank] = seconds
    return out


def _reported_at_s(status: NodePlanStatus, now_s: float) -> float:
    """When the agent wrote ``status``, in Unix seconds (``now_s`` when it does not say)."""
    stamp = status.reported_at
    return _parse_rfc3339(stamp, now_s) if stamp is not None else now_s


def profiling_placeholder_plan(spec: PerseusJobSpec) -> PipelinePlan:
    """A plan that only says which computations each stage runs, for profiling node plans
    (the agents measure instead of applying it)."""
    p = spec.parallelism
    schedule = Schedule.parse(p.schedule.value).value
    clock = get_profiling_spec(spec.policy, spec.profiling).frequencies_mhz[0]
    estimate = PlanEstimate(iteration_time_s=1.0, energy_j=1.0, savings_ratio=0.0)
    return PipelinePlan(
        schedule=schedule,
        num_stages=p.pipeline_stages,
        num_microbatches=p.microbatches,
        virtual_stages=p.virtual_stages,
        granularity=Granularity.INSTRUCTION,
        objective=PlanObjective.MIN_TIME,
        unit_time_s=0.001,
        blocking_power_w=1.0,
        t_min_s=1.0,
        t_star_s=1.0,
        baseline_iteration_time_s=1.0,
        instruction_estimate=estimate,
        stage_estimate=estimate,
        stages=[
            StagePlan(
                stage=s,
                frequency_mhz=clock,
                instructions=[
                    InstructionClock(
                        instruction=step.instruction,
                        microbatch=step.microbatch,
                        frequency_mhz=clock,
                        virtual_stage=step.virtual_stage if p.virtual_stages > 1 else None,
                    )
                    for step in gpu_computation_order(
                        schedule, p.pipeline_stages, p.microbatches, s, p.virtual_stages
                    )
                ],
            )
            for s in range(p.pipeline_stages)
        ],
    )


# -- deletion ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """Where releasing a deleted job's GPUs stands."""

    done: bool
    waiting_for: tuple[str, ...] = ()
    """Nodes whose agents have not yet confirmed the reset."""


async def release(namespace: str, job: str, io: JobIO, owner: Mapping[str, Any]) -> Release:
    """One step of releasing a deleted job's GPUs: every node plan is first emptied (its agent
    resets the clocks and reports the empty revision), then deleted once confirmed. Call
    again until ``done``; on a deadline, :func:`force_release` deletes what is left."""
    waiting = []
    for obj in await io.list_node_plans(namespace, job):
        spec = obj.get("spec") or {}
        node = str(spec.get("node", "?"))
        revision = int(spec.get("revision") or 0)
        if spec.get("assignments"):
            emptied = {**spec, "assignments": [], "plans": {}, "profiling": None}
            emptied["revision"] = revision + 1
            metadata = obj.get("metadata") or {}
            # Only what identifies it: a body with the server's fields (resourceVersion, uid)
            # is refused on create (HTTP 500 from kube-apiserver).
            body = {
                "apiVersion": resources.API_VERSION,
                "kind": resources.NODE_PLAN_KIND,
                "metadata": {
                    "name": metadata.get("name"),
                    "namespace": metadata.get("namespace"),
                    "labels": metadata.get("labels") or {},
                },
                "spec": emptied,
            }
            await io.put_node_plan(body, owner)
            waiting.append(node)
        elif node_plan_status(obj).observed_revision == revision:
            await io.delete_node_plan(*resources.object_key(obj))
        else:
            waiting.append(node)
    return Release(done=not waiting, waiting_for=tuple(sorted(waiting)))


RELEASE_PENDING: Final = "GPU reset pending"
"""Starts the message of every retry of a deletion that waits for agents (the handlers log
those as the normal course of a deletion, not as the errors kopf takes retries for)."""


@dataclass(frozen=True)
class ReleaseDecision:
    """What the delete handler does after one :func:`release` step.

    Attributes:
        retry_in_s: Seconds until the next step (the finalizer stays); ``None``: finish now.
        force: Finish by deleting the node plans left (:func:`force_release`): the agents did
            not confirm the reset in time.
        message: Why (for the retry, or the warning event when forcing).
    """

    retry_in_s: float | None
    force: bool = False
    message: str = ""

    @property
    def finish(self) -> bool:
        """Whether the finalizer may be removed now."""
        return self.retry_in_s is None


def decide_release(
    outcome: Release, waited_s: float, timeout_s: float, poll_s: float
) -> ReleaseDecision:
    """The next move of a deletion that has waited ``waited_s`` for the agents.

    Done: finish. Agents still resetting: retry in ``poll_s`` (sooner if the deadline is
    nearer), so that the handler never sleeps and many deletions proceed side by side. At
    ``timeout_s``: force (the same bound as before, counted across retries and restarts).
    """
    if outcome.done:
        return ReleaseDecision(retry_in_s=None)
    nodes = ", ".join(outcome.waiting_for)
    remaining_s = timeout_s - waited_s
    if remaining_s <= 0:
        return ReleaseDecision(
            retry_in_s=None,
            force=True,
            message=f"agents of {nodes} did not confirm the reset within {timeout_s:g} s; "
            "deleting their plans anyway",
        )
    return ReleaseDecision(
        retry_in_s=max(min(poll_s, remaining_s), 0.0),
        message=f"{RELEASE_PENDING}: waiting for the agents of {nodes} to reset their GPUs "
        f"({waited_s:.0f} of {timeout_s:g} s)",
    )


async def force_release(namespace: str, job: str, io: JobIO) -> None:
    """Delete the job's node plans without waiting (agents reset when a plan disappears)."""
    for obj in await io.list_node_plans(namespace, job):
        await io.delete_node_plan(*resources.object_key(obj))


def _decisive(state: Mapping[str, Any]) -> Any:
    """The part of a detector state that decides verdicts (streaks, flags, the published
    target): per-report details (iteration counts, recent times) are left to the next one."""
    replicas = state.get("replicas") or {}
    return (
        state.get("published"),
        {
            dp: {k: v for k, v in r.items() if k in ("slowStreak", "fastStreak", "flagged")}
            for dp, r in replicas.items()
            if isinstance(r, Mapping)
        },
    )


def _decisive_json(text: str) -> Any:
    try:
        state = json.loads(text)
    except ValueError:
        return None
    return _decisive(state) if isinstance(state, Mapping) else None
