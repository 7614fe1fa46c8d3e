"""One reconcile step of a PerseusJob: observe, decide, act, report.

The kopf handlers call :func:`reconcile` on every change of the job and on a timer. Each call
moves the job along ``Pending → Profiling → Optimizing → Running → Completed/Failed`` as far
as it can, and returns the new status plus the events to emit. Each stage reads what it needs
(:mod:`perseus_operator.jobs.job_observation`), asks a pure decision
(:mod:`perseus_operator.jobs.job_decisions`, :mod:`perseus_operator.jobs.phase_decisions`,
:mod:`perseus_operator.jobs.running_decisions`), and here carries out the actions that decision
names: the node plans and ConfigMaps it writes, what the job's memo keeps.

All the state that must survive an operator restart is in the cluster: the phase and plan
revision in the status, the profile in a ConfigMap owned by the job, the plans in
PerseusNodePlans. What is kept in memory (:class:`JobMemo`: the solved frontier, the straggler
detector) is rebuilt from those when missing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from perseus_api import resources
from perseus_api.errors import validation_summary
from perseus_api.job import PerseusJobSpec, with_default_policy
from perseus_api.job_status import PerseusJobStatus, Phase
from perseus_operator.jobs.job_decisions import (
    STRAGGLER_STATE_ANNOTATION,
    Action,
    Decision,
    Event,
    ForgetDetector,
    JobRef,
    PlanInEffect,
    ReleaseNodePlans,
    ReplaceNodePlans,
    StoreProfile,
    TargetFor,
    copy_status,
    decide_conflict,
    decide_generation,
    decide_workload,
    invalid_spec,
    phase_event,
    power_target_s,
)
from perseus_operator.jobs.job_memo import JobMemo, Outcome, remember_step
from perseus_operator.jobs.job_observation import (
    JobIO,
    Planner,
    ReadChanges,
    ReadSnapshots,
    observe_conflict,
    observe_gpu_product,
    observe_profile,
    observe_workload,
    plan_reports,
)
from perseus_operator.jobs.job_release import (
    DeleteNodePlan,
    EmptyNodePlan,
    Release,
    decide_release_step,
)
from perseus_operator.jobs.phase_decisions import (
    decide_frontier,
    decide_lookup,
    decide_pending,
    decide_plans,
    decide_profile_stored,
    decide_profiling_round,
    decide_profiling_start,
    planning_failed,
    planning_request,
    request_key,
)
from perseus_operator.jobs.planning import PlanningError, choose_plan
from perseus_operator.jobs.power_limits import limits_changed, power_limits_w
from perseus_operator.jobs.quiet_steps import (
    Observation,
    Settled,
    same_memo,
    same_verdict,
    step_inputs,
)
from perseus_operator.jobs.running_decisions import (
    decide_running,
    fastest_reported_s,
    planned_target_s,
    report_samples,
    reports_timed,
)
from perseus_operator.jobs.stragglers import StragglerDetector
from perseus_operator.workloads.objects import owner_reference
from perseus_operator.workloads.ranks import RankPlacement
from perseus_planner import Frontier

__all__ = ["JobMemo", "Outcome", "force_release", "reconcile", "release"]
# JobMemo and Outcome live in job_memo; importers of lifecycle keep finding them here.


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
    metadata = body.get("metadata") or {}
    ref = JobRef(
        namespace=str(metadata.get("namespace") or "default"),
        name=str(metadata.get("name") or ""),
        uid=str(metadata.get("uid") or ""),
        generation=int(metadata.get("generation") or 0),
        owner=owner_reference(body),
        created=str(metadata.get("creationTimestamp") or ""),
    )
    saved_detector = (metadata.get("annotations") or {}).get(STRAGGLER_STATE_ANNOTATION)
    now = time.time() if now_s is None else now_s
    # What the last step decided, where this one would decide the same (quiet_steps).
    reads = io if isinstance(io, ReadSnapshots) else None
    inputs = None if reads is None else step_inputs(body, default_policy)
    last, memo.last_step = memo.last_step, None
    changes = ReadChanges.OTHER
    if reads is not None and last is not None and inputs is not None and inputs == last.inputs:
        changes = reads.changes_since(last.reads)
    whole = last.whole if last is not None and changes is ReadChanges.NONE else None
    preobserved = None
    detector = memo.detector
    if whole is not None and detector is not None and same_memo(memo.used(), whole.memo):
        # Only the detector runs: it counts report rounds by the clock.
        verdict = detector.observe(whole.observed.samples, now)
        if same_verdict(whole, verdict, detector.reference_s):
            memo.last_step = last
            state = detector.state_to_save(saved_detector)
            return Outcome(
                whole.status, [], whole.plan, whole.iterations, whole.new_stragglers, state
            )
        preobserved = replace(whole.observed, verdict=verdict, reference_s=detector.reference_s)
    settled = last.settled if last is not None and changes is not ReadChanges.OTHER else None
    if settled is not None:
        assert reads is not None and last is not None
        reads.adopt(last.reads)
        step = _Step(ref, settled.before, io, planner, memo, now, saved_detector)
        step.power_target_s = power_target_s(metadata.get("annotations"))
        step.power_limits_w = power_limits_w(metadata.get("annotations"))
        step.preobserved = preobserved
        await step.resume(settled)
    else:
        try:
            status = PerseusJobStatus.model_validate(body.get("status") or {})
        except ValidationError:
            status = PerseusJobStatus()  # an unreadable status is rebuilt, not trusted
        step = _Step(ref, status, io, planner, memo, now, saved_detector)
        step.power_target_s = power_target_s(metadata.get("annotations"))
        step.power_limits_w = power_limits_w(metadata.get("annotations"))
        try:
            raw_spec = body.get("spec") or {}
            spec = PerseusJobSpec.model_validate(with_default_policy(raw_spec, default_policy))
        except ValidationError as exc:
            message = f"invalid spec: {validation_summary(exc)}"
            await step.apply(invalid_spec(step.status, ref.generation, message))
            return step.outcome()
        await step.run(spec)
    outcome = step.outcome()
    if reads is not None and inputs is not None:
        remember_step(
            memo,
            settled=step.settled,
            resumed=step.resumed,
            observed=step.observed,
            acted=step.acted,
            outcome=outcome,
            before=body.get("status"),
            inputs=inputs,
            snapshot=reads.snapshot(),
        )
    return outcome


# -- the step ----------------------------------------------------------------------------------


class _Step:
    """Runs the stages of one step in order, each observe → decide → act; the decisions are
    the only place the status changes."""

    def __init__(
        self,
        ref: JobRef,
        status: PerseusJobStatus,
        io: JobIO,
        planner: Planner,
        memo: JobMemo,
        now_s: float,
        saved_detector: str | None,
    ) -> None:
        self.ref = ref
        self.status = copy_status(status)
        self.before = status
        self.io = io
        self.planner = planner
        self.memo = memo
        self.now_s = now_s
        self.saved_detector = saved_detector
        self.events: list[Event] = []
        self.iterations = 0
        self.new_stragglers = 0
        self.power_target_s: float | None = None
        self.power_limits_w: dict[str, float] = {}
        self.acted = False
        """Whether the step took some action (a write, a change of the memo)."""
        self.observed: Observation | None = None
        """The detector's round in this step."""
        self.preobserved: Observation | None = None
        """The detector's round already made for this step's samples (by the check of the
        last step, which found the verdict changed): not observed twice."""
        self.settled: Settled | None = None
        """What the stages before the Running stage decided, when they took no action."""
        self.resumed = False
        """Whether the step began at the Running stage, with the last step's ``settled``."""

    def outcome(self) -> Outcome:
        changed = phase_event(self.before, self.status)
        if changed is not None:
            self.events.append(changed)
        running = self.status.phase == Phase.RUNNING
        plan = self.memo.plan if running else None
        state = None
        if self.memo.detector is not None and running:
            state = self.memo.detector.state_to_save(self.saved_detector)
        return Outcome(self.status, self.events, plan, self.iterations, self.new_stragglers, state)

    # -- acting --

    async def apply(self, decision: Decision) -> bool:
        """Take ``decision``: its status, events and actions; whether the step goes on."""
        self.status = decision.status
        self.events.extend(decision.events)
        self.acted = self.acted or bool(decision.actions)
        for action in decision.actions:
            await self._act(action)
        return decision.go_on

    async def _act(self, action: Action) -> None:
        memo, ref = self.memo, self.ref
        match action:
            case ReplaceNodePlans(node_plans):
                existing = await self.io.list_node_plans(ref.namespace, ref.name)
                wanted = {resources.node_plan_name(p.job, p.node) for p in node_plans.values()}
                for plan in node_plans.values():
                    await self.io.put_node_plan(resources.node_plan_object(plan), ref.owner)
                for obj in existing:
                    namespace, name = resources.object_key(obj)
                    if name not in wanted:
                        await self.io.delete_node_plan(namespace, name)
            case ReleaseNodePlans():
                await force_release(ref.namespace, ref.name, self.io)
            case StoreProfile(name, data, labels):
                await self.io.put_config_map(ref.namespace, name, data, ref.owner, labels=labels)
            case ForgetDetector():
                memo.detector = None
            case TargetFor(retarget_s):
                memo.retarget_s = retarget_s
            case PlanInEffect(plan):
                memo.plan = plan

    # -- the stages --

    async def run(self, spec: PerseusJobSpec) -> None:
        if not await self.apply(decide_generation(spec, self.status, self.ref.generation)):
            return
        view = await observe_workload(self.io, self.ref, spec)
        workload = decide_workload(spec, self.status, self.ref, view)
        if not await self.apply(workload.decision):
            return
        ranks = workload.ranks
        assert ranks is not None  # the step goes on only with every rank placed
        # Checked where node plans exist (here) or are about to be written (_start, _optimize):
        # a job that fails for its own reasons says those, whoever holds its GPUs.
        phase = self.status.phase
        if phase in (Phase.PROFILING, Phase.RUNNING) and not await self._gpus_free(ranks):
            return
        if self.status.phase == Phase.PENDING:
            await self._start(spec, ranks)
        if self.status.phase == Phase.PROFILING:
            await self._profile(spec, ranks)
        if self.status.phase == Phase.OPTIMIZING:
            await self._optimize(spec, ranks)
        if self.status.phase == Phase.RUNNING:
            if not self.acted and not self.events:
                self.settled = Settled(self.before, spec, ranks, self.status)
            await self._run(spec, ranks)

    async def resume(self, settled: Settled) -> None:
        """The Running stage, after stages that would decide what they did last time."""
        self.settled, self.resumed, self.status = settled, True, settled.status
        await self._run(settled.spec, settled.ranks)

    async def _gpus_free(self, ranks: Sequence[RankPlacement]) -> bool:
        """Whether no other, older job's node plans hold some of this job's GPUs (if one does,
        this job withdraws its own node plans and waits)."""
        view = await observe_conflict(self.io, self.ref, ranks)
        return await self.apply(decide_conflict(self.status, self.ref, ranks, view))

    async def _start(self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]) -> None:
        products = self.memo.gpu_products
        found = await observe_profile(self.io, self.ref, spec, ranks, products)
        gen = self.ref.generation
        if not await self.apply(decide_lookup(spec, self.status, gen, found.profile, found.error)):
            return
        product = await observe_gpu_product(self.io, spec, ranks, products)
        pending = decide_pending(spec, self.status, gen, found.profile, product)
        await self.apply(pending.decision)
        if not pending.profile or not await self._gpus_free(ranks):
            return
        decision = decide_profiling_start(
            spec, self.status, self.ref, ranks, self.now_s, pending.note
        )
        await self.apply(decision)

    async def _profile(self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]) -> None:
        plans = await self.io.list_node_plans(self.ref.namespace, self.ref.name)
        gen = self.ref.generation
        done = decide_profiling_round(spec, self.status, gen, plans, ranks, self.now_s)
        if not await self.apply(done.decision) or done.gathered is None:
            return
        product = await observe_gpu_product(self.io, spec, ranks, self.memo.gpu_products)
        await self.apply(decide_profile_stored(spec, self.status, self.ref, done.gathered, product))

    async def _frontier(
        self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]
    ) -> tuple[Frontier, str] | None:
        """The frontier of the job's stored profile and that profile's ConfigMap (solved again
        only when the profile or the planning spec changed); None: the step ends here (the
        decision said why)."""
        memo, ref = self.memo, self.ref
        summary = self.status.frontier
        if (
            memo.frontier is not None
            and memo.frontier_generation == ref.generation
            and summary is not None
        ):
            # Solved for this spec already: no need to read the profile again every tick.
            return memo.frontier, summary.profile_config_map
        found = await observe_profile(self.io, ref, spec, ranks, memo.gpu_products)
        planning = planning_request(spec, self.status, ref, found.profile, found.error)
        if not await self.apply(planning.decision):
            return None
        assert planning.request is not None  # the step goes on only with a request
        key = request_key(planning.request)
        if memo.frontier is None or memo.frontier_key != key:
            try:
                memo.frontier = await self.planner.solve(planning.request)
            except PlanningError as exc:
                await self.apply(planning_failed(self.status, ref.generation, str(exc)))
                return None
            memo.frontier_key = key
        memo.frontier_generation = ref.generation
        return memo.frontier, planning.config_map

    async def _optimize(self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]) -> None:
        solved = await self._frontier(spec, ranks)
        if solved is None:
            return
        frontier, config_map = solved
        await self.apply(decide_frontier(self.status, self.ref.generation, frontier, config_map))
        if await self._gpus_free(ranks):
            await self._write_plans(spec, ranks, frontier, None, ())

    async def _write_plans(
        self,
        spec: PerseusJobSpec,
        ranks: Sequence[RankPlacement],
        frontier: Frontier,
        retarget_s: float | None,
        stragglers: Collection[int],
    ) -> None:
        """Plans for T_min (or the slowdown budget) for every replica, or, for a straggler
        target ``retarget_s``, that target for all but the ``stragglers``."""
        # Building a plan takes tens of milliseconds: not on the event loop.
        memo, policy_key = self.memo, spec.policy.model_dump_json()
        tmin = memo.tmin_plan
        if memo.tmin_for != (frontier, policy_key) or tmin is None:
            tmin = await asyncio.to_thread(choose_plan, frontier, spec.policy)
            memo.tmin_plan, memo.tmin_for = tmin, (frontier, policy_key)
        retargeted = None
        if retarget_s is not None:
            retargeted = await asyncio.to_thread(
                choose_plan, frontier, spec.policy, straggler_target_s=retarget_s
            )
        decision = decide_plans(
            spec, self.status, self.ref, ranks, tmin, retargeted, stragglers, self.power_limits_w
        )
        await self.apply(decision)

    async def _run(self, spec: PerseusJobSpec, ranks: Sequence[RankPlacement]) -> None:
        solved = await self._frontier(spec, ranks)
        if solved is None:
            return
        frontier, _ = solved
        # Read as reports: the parts of the plans this stage reads, kept per plan version.
        plans = await plan_reports(self.io, self.ref.namespace, self.ref.name)
        detector = self._detector(spec)
        if self.memo.plan is None:  # after a restart: the plan of the target in effect
            self.memo.retarget_s = planned_target_s(
                detector.published_target_s, detector.reference_s, fastest_reported_s(plans)
            )
            self.memo.plan = await asyncio.to_thread(
                choose_plan, frontier, spec.policy, straggler_target_s=self.memo.retarget_s
            )
        samples = tuple(report_samples(plans, ranks, now_s=self.now_s))
        pre = self.preobserved
        if pre is not None and pre.samples == samples:
            verdict = pre.verdict
        else:
            verdict = detector.observe(samples, self.now_s)
        self.observed = Observation(samples, verdict, detector.reference_s, reports_timed(plans))
        gen = self.ref.generation
        running = decide_running(spec, self.status, gen, plans, verdict, detector.reference_s)
        self.iterations, self.new_stragglers = running.iterations, running.new_stragglers
        await self.apply(running.decision)
        power_changed = self.power_target_s != self.memo.power_target_s or (
            # a budget's backstop, in the plans
            limits_changed(self.power_limits_w, [p.power_limits for p in plans])
        )
        if running.replan or power_changed:
            # A power budget's target slows every healthy replica as a straggler's T' does;
            # with both, the slower of the two.
            self.memo.power_target_s = self.power_target_s
            straggler_s = running.retarget_s if running.replan else self.memo.retarget_s
            targets = [t for t in (straggler_s, self.power_target_s) if t is not None]
            target_s = max(targets) if targets else None
            await self._write_plans(spec, ranks, frontier, target_s, verdict.stragglers)

    def _detector(self, spec: PerseusJobSpec) -> StragglerDetector:
        memo, key = self.memo, spec.stragglers.model_dump_json()
        if memo.detector is None and self.saved_detector:
            # A restarted operator: resume the saved counters and the target in effect.
            memo.detector = StragglerDetector.from_saved(spec.stragglers, self.saved_detector)
            memo.detector_key = key
        if memo.detector is None or memo.detector_key != key:
            memo.detector = StragglerDetector(spec.stragglers)
            memo.detector_key = key
        return memo.detector


# -- deletion ----------------------------------------------------------------------------------


async def release(namespace: str, job: str, io: JobIO, owner: Mapping[str, Any]) -> Release:
    """One step of releasing a deleted job's GPUs (:func:`~perseus_operator.jobs.job_release.
    decide_release_step`). Call again until ``done``; on a deadline, :func:`force_release`
    deletes what is left."""
    step = decide_release_step(await io.list_node_plans(namespace, job))
    for write in step.writes:
        match write:
            case EmptyNodePlan(body):
                await io.put_node_plan(body, owner)
            case DeleteNodePlan(namespace=ns, name=name):
                await io.delete_node_plan(ns, name)
    return step.outcome


async def force_release(namespace: str, job: str, io: JobIO) -> None:
    """Delete the job's node plans without waiting (agents reset when a plan disappears)."""
    for obj in await io.list_node_plans(namespace, job):
        await io.delete_node_plan(*resources.object_key(obj))
