"""Carries out the PerseusPowerBudgets: reads the cluster, decides each budget's round
(:func:`perseus_operator.power.budget_decisions.decide_budget`), re-targets the jobs and
writes the budgets' statuses.

One controller per operator (the leader's: it runs where the policy controller runs) runs a
round every ``interval_s`` and as soon as a budget changes (:meth:`BudgetController.wake`).
Each round reads the budgets, every node (the domains select theirs by label), every node plan
(a domain's jobs are those with a node plan on its nodes; their reports carry the GPUs' energy
counters, the draw) and every PerseusJob (replicas, ``powerWeight``, phase). The jobs' frontiers
are the ones their reconciles solved, held in this process (``frontiers``): nothing is solved
again here.

A job is re-targeted through the path a straggler uses: the controller writes the frontier
time chosen for it in the job's annotation :data:`~perseus_operator.jobs.job_decisions.
POWER_TARGET_ANNOTATION` (removed for ``T_min``), and the job's next reconcile rewrites its
plans from its frontier for that time (the slower of it and a straggler's ``T'``). A job in no
budget's allocation any more (its budget deleted, the job moved away) gets its annotation
removed, so it returns to ``T_min``.

With ``enforcement: PlansAndPowerLimits`` each job also gets the power limit of its GPUs, by
node (:func:`~perseus_operator.power.budget_decisions.gpu_power_limits`), in its annotation
:data:`~perseus_operator.jobs.power_limits.POWER_LIMITS_ANNOTATION`; its reconcile writes them
into its node plans. A job no ``PlansAndPowerLimits`` budget covers gets that annotation removed,
so its plans lose their limits and the agents put the GPUs' own limits back.

The domain's draw comes from Prometheus when the operator has its URL (``draw``: every GPU,
the unmanaged ones included), else from the node plans' reports
(:mod:`perseus_operator.power.domain`). What a round decides is also posted as Events on the
budget (:mod:`perseus_operator.power.budget_events`, bounded).

A round that cannot read everything changes nothing (a partial view could look like jobs
ended); one failed write is logged and the rest of the round goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from perseus_api.conventions import now_rfc3339
from perseus_api.power_budget import (
    PerseusPowerBudgetSpec,
    PerseusPowerBudgetStatus,
    PowerBudgetSpecError,
    parse_power_budget,
)
from perseus_api.resources import object_key
from perseus_operator.cluster.kube.client import KubeClient, KubeError
from perseus_operator.jobs.job_decisions import POWER_TARGET_ANNOTATION
from perseus_operator.jobs.power_limits import POWER_LIMITS_ANNOTATION
from perseus_operator.jobs.power_limits import annotation_value as limits_annotation
from perseus_operator.metrics import OperatorMetrics
from perseus_operator.power.budget_decisions import (
    BudgetDecision,
    BudgetMemo,
    DomainJob,
    JobKey,
    decide_budget,
    gpu_power_limits,
    job_gpus_by_node,
    overlapping_nodes,
)
from perseus_operator.power.budget_events import (
    BudgetEvent,
    EventGate,
    budget_events,
    event_body,
)
from perseus_operator.power.domain import (
    DrawMeter,
    JobInput,
    domain_draw,
    domain_gpus,
    job_inputs,
    selected_nodes,
)
from perseus_operator.power.prometheus_draw import DrawByJob, PrometheusDraw, PrometheusDrawError
from perseus_planner import Frontier
from perseus_planner.power import JobPoints, PowerBudgetError, allocate
from perseus_planner.power.frontier_points import IntArray, frontier_points

__all__ = ["BudgetController", "JobFrontier", "annotation_value"]

log = logging.getLogger("perseus_operator.power")

_COMPONENT: Final = "perseus-operator"
_SIGNIFICANT: Final = 9
"""Digits of a target time written in the annotation (a frontier time, far finer than a clock
step)."""


@dataclass(frozen=True)
class JobFrontier:
    """A job's frontier as its reconcile solved it, and its straggler's ``T'`` (frontier time;
    None: no straggler)."""

    frontier: Frontier
    floor_s: float | None = None


def annotation_value(target_s: float | None) -> str | None:
    """The annotation for a target (None: remove it, the job runs ``T_min``)."""
    return None if target_s is None else f"{target_s:.{_SIGNIFICANT}g}"


@dataclass
class _Budget:
    uid: str
    memo: BudgetMemo | None = None


class BudgetController:
    """Keeps every PerseusPowerBudget's jobs on their allocated points and its status current.

    Args:
        kube: The API client.
        frontiers: The frontiers this process's reconciles hold, by job.
        interval_s: Longest time between two rounds.
        metrics: Where the budgets' figures go (None: nowhere).
        namespaces: The namespaces the operator manages; empty: all of them.
        now_s: The clock (Unix seconds; the agents' report times are wall-clock times).
        draw: Where to read the domains' draw (None: the node plans' reports).
        events_namespace: Where the budgets' Events go (they are cluster-scoped; the
            operator's own namespace).
    """

    def __init__(
        self,
        kube: KubeClient,
        frontiers: Callable[[], Mapping[JobKey, JobFrontier]],
        *,
        interval_s: float,
        metrics: OperatorMetrics | None = None,
        namespaces: Collection[str] = (),
        now_s: Callable[[], float] = time.time,
        draw: PrometheusDraw | None = None,
        events_namespace: str = "default",
    ) -> None:
        self._kube = kube
        self._frontiers = frontiers
        self._interval_s = interval_s
        self._metrics = metrics
        self._namespaces = frozenset(namespaces)
        self._now_s = now_s
        self._wake = asyncio.Event()
        self._budgets: dict[str, _Budget] = {}
        self._meter = DrawMeter()
        self._points: dict[JobKey, tuple[tuple[object, ...], JobPoints, IntArray]] = {}
        self._crd_missing_logged = False
        self._draw = draw
        self._draw_error: str | None = None
        self._gate = EventGate()
        self._events_namespace = events_namespace

    def wake(self) -> None:
        """Run the next round now (a PerseusPowerBudget changed)."""
        self._wake.set()

    async def run(self) -> None:
        """Rounds until cancelled; a failed round is logged and retried at the next one."""
        # The allocation's compiled kernels load (or compile: ~20 s on a busy core) on first
        # use: here, off the event loop, rather than in the round of the first budget.
        await asyncio.to_thread(_warm_allocation)
        while True:
            self._wake.clear()
            try:
                await self.sync()
            except KubeError as exc:
                log.warning("power budget round skipped: %s", exc)
            except Exception:
                log.exception("power budget round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._interval_s)

    async def sync(self) -> dict[str, BudgetDecision] | None:
        """One round: each valid budget's decision; None when the CRD is not installed.

        Raises:
            KubeError: The cluster could not be read; nothing was changed.
        """
        kube = self._kube
        budgets = await kube.list_power_budgets()
        if budgets is None:
            if not self._crd_missing_logged:
                log.warning("the PerseusPowerBudget CRD is not installed: power budgets off")
                self._crd_missing_logged = True
            return None
        self._crd_missing_logged = False
        nodes = await kube.list_nodes() if budgets else []
        node_plans, jobs = await self._read_namespaced()
        self._meter.record(node_plans)
        self._meter.forget_except(node_plans)

        valid = self._parse(budgets)
        domains = {name: selected_nodes(spec.node_selector, nodes) for name, (_, spec) in
                   valid.items()}  # fmt: skip
        shared = overlapping_nodes(domains)
        inputs = job_inputs(jobs)
        frontiers = self._frontiers()
        scraped = await self._scrape({spec.averaging_window_seconds for _, spec in valid.values()})
        decisions: dict[str, BudgetDecision] = {}
        wanted: dict[JobKey, str | None] = {}
        limits: dict[JobKey, dict[str, float]] = {}
        for name, (body, spec) in sorted(valid.items()):
            own = domains[name] - shared[name]  # a node in two domains is in neither
            decision, targets = await self._round(
                name, body, spec, own, shared[name], node_plans, inputs, frontiers,
                scraped.get(spec.averaging_window_seconds),
            )  # fmt: skip
            decisions[name] = decision
            wanted.update(targets)
            gpus = job_gpus_by_node(own, node_plans)
            for key, by_node in gpu_power_limits(spec, decision.memo.assigned, gpus).items():
                limits.setdefault(key, {}).update(by_node)
        await self._retarget(wanted, jobs)
        await self._limit(limits, jobs)
        for gone in set(self._budgets) - set(valid):
            del self._budgets[gone]
            self._gate.forget(gone)
            if self._metrics is not None:
                self._metrics.forget_budget(gone)
        self._points = {k: v for k, v in self._points.items() if k in frontiers}
        return decisions

    # -- one budget --

    def _parse(self, budgets: Sequence[Mapping[str, Any]]) -> dict[str, tuple[Any, Any]]:
        valid: dict[str, tuple[Mapping[str, Any], PerseusPowerBudgetSpec]] = {}
        for body in budgets:
            try:
                spec = parse_power_budget(body)
            except PowerBudgetSpecError as exc:
                log.warning("%s", exc)  # the API server's schema lets few such through
                continue
            valid[object_key(body)[1]] = (body, spec)
        return valid

    async def _round(
        self,
        name: str,
        body: Mapping[str, Any],
        spec: PerseusPowerBudgetSpec,
        own: set[str],
        overlapping: set[str],
        node_plans: Sequence[Mapping[str, Any]],
        inputs: Mapping[JobKey, JobInput],
        frontiers: Mapping[JobKey, JobFrontier],
        scraped: DrawByJob | None = None,
    ) -> tuple[BudgetDecision, dict[JobKey, str | None]]:
        """The budget's decision, and the annotation each of its jobs should carry."""
        metadata = body.get("metadata") or {}
        uid = str(metadata.get("uid") or "")
        budget = self._budgets.get(name)
        if budget is None or budget.uid != uid:
            budget = self._budgets[name] = _Budget(uid)
        held = domain_gpus(own, node_plans)
        domain_jobs = []
        for key, gpus in sorted(held.gpus.items()):
            job, solved = inputs.get(key), frontiers.get(key)
            if job is None or not job.running or solved is None:
                continue  # not running yet, or its frontier not solved in this process yet
            points = await self._job_points(key, solved, job)
            if points is not None:
                domain_jobs.append(DomainJob(key[0], key[1], points[0], points[1], gpus))
        measured_w, unmanaged_w = domain_draw(
            own, {j.key for j in domain_jobs}, scraped=scraped, meter=self._meter,
            plans=held.plans, window_s=spec.averaging_window_seconds, now_s=self._now_s(),
        )  # fmt: skip
        previous = _status(body)
        # Pure, but thousands of jobs' points take a while: off the event loop.
        decision = await asyncio.to_thread(
            decide_budget,
            spec,
            int(metadata.get("generation") or 0),
            domain_jobs,
            unmanaged_w=unmanaged_w,
            measured_w=measured_w,
            memo=budget.memo,
            previous=previous,
            nodes=len(own),
            overlapping_nodes=overlapping,
        )
        budget.memo = decision.memo
        await self._post_events(body, budget_events(decision, previous))
        status = decision.status.model_dump(mode="json", by_alias=True)
        if previous is None or previous.model_dump(mode="json", by_alias=True) != status:
            try:
                await self._kube.patch_power_budget_status(name, status)
            except KubeError as exc:
                if not exc.not_found:
                    log.warning("could not write the status of PerseusPowerBudget %s: %s",
                                name, exc)  # fmt: skip
        if self._metrics is not None:
            self._metrics.observe_budget(name, decision.status)
        targets = {}
        for j in domain_jobs:
            position = decision.memo.assigned[j.key].position
            at_t_min = position == j.t_min_position
            targets[j.key] = annotation_value(
                None if at_t_min else float(j.points.times_s[position])
            )
        return decision, targets

    async def _job_points(
        self, key: JobKey, solved: JobFrontier, job: JobInput
    ) -> tuple[JobPoints, IntArray] | None:
        """The job's allocation points (replayed once per frontier, replicas, weight, floor)."""
        version = (id(solved.frontier), solved.floor_s, job.replicas, job.weight)
        cached = self._points.get(key)
        if cached is not None and cached[0] == version:
            return cached[1], cached[2]
        name = f"{key[0]}/{key[1]}"
        try:
            # Replaying up to a thousand points takes milliseconds: not on the event loop.
            points, indices = await asyncio.to_thread(
                frontier_points,
                name,
                solved.frontier,
                job.replicas,
                weight=job.weight,
                floor_s=solved.floor_s,
            )
        except PowerBudgetError as exc:
            log.warning("PerseusJob %s left out of its power budget: %s", name, exc)
            return None
        self._points[key] = (version, points, indices)
        return points, indices

    async def _scrape(self, windows: Collection[int]) -> dict[int, DrawByJob]:
        """The draw by node and job over each window, from Prometheus; empty without it or
        when it does not answer (the rounds then use the node plans' reports)."""
        if self._draw is None or not windows:
            return {}
        out = {}
        try:
            for window_s in sorted(windows):
                out[window_s] = await asyncio.to_thread(self._draw.draw, window_s)
        except PrometheusDrawError as exc:
            if str(exc) != self._draw_error:  # once per kind of failure, not every round
                log.warning("power budgets: draw from the node plans' reports: %s", exc)
            self._draw_error = str(exc)
            return {}
        if self._draw_error is not None:
            log.info("power budgets: draw from %s again", self._draw.url)
        self._draw_error = None
        return out

    async def _post_events(self, body: Mapping[str, Any], events: list[BudgetEvent]) -> None:
        """Log the round's Events and post those the gate lets through (a failed post is
        logged, never retried: the next change says more)."""
        name = object_key(body)[1]
        for event in events:
            level = logging.INFO if event.type == "Normal" else logging.WARNING
            log.log(level, "PerseusPowerBudget %s: %s: %s", name, event.reason, event.message)
        for event in self._gate.admit(name, events, self._now_s()):
            obj = event_body(body, event, self._events_namespace, now_rfc3339(), _COMPONENT)
            try:
                await self._kube.create_event(self._events_namespace, obj)
            except KubeError as exc:
                log.warning("could not post event %s on PerseusPowerBudget %s: %s",
                            event.reason, name, exc)  # fmt: skip

    # -- the jobs --

    async def _retarget(
        self, wanted: Mapping[JobKey, str | None], jobs: Sequence[Mapping[str, Any]]
    ) -> None:
        """Write each job's annotation where it differs from its allocated target (``wanted``);
        remove it from jobs no budget allocates any more. Compared with what the API shows,
        so a failed write is made again at the next round."""
        for job in jobs:
            key = object_key(job)
            annotations = (job.get("metadata") or {}).get("annotations") or {}
            current = annotations.get(POWER_TARGET_ANNOTATION)
            value = wanted.get(key)  # in no budget's allocation: back to T_min
            if current == value:
                continue
            patch = {"metadata": {"annotations": {POWER_TARGET_ANNOTATION: value}}}
            try:
                await self._kube.patch_job(key[0], key[1], patch)
            except KubeError as exc:
                if not exc.not_found:
                    log.warning("could not re-target PerseusJob %s/%s: %s", *key, exc)
                continue
            log.info("PerseusJob %s/%s re-targeted for its power budget: %s", key[0], key[1],
                     "T_min" if value is None else f"{value} s")  # fmt: skip

    async def _limit(
        self, limits: Mapping[JobKey, Mapping[str, float]], jobs: Sequence[Mapping[str, Any]]
    ) -> None:
        """Write each job's per-GPU power limits annotation where it differs from ``limits``
        (removed from jobs no ``PlansAndPowerLimits`` budget covers); compared with what the API
        shows, so a failed write is made again at the next round."""
        for job in jobs:
            key = object_key(job)
            annotations = (job.get("metadata") or {}).get("annotations") or {}
            value = limits_annotation(limits.get(key) or {})
            if annotations.get(POWER_LIMITS_ANNOTATION) == value:
                continue
            patch = {"metadata": {"annotations": {POWER_LIMITS_ANNOTATION: value}}}
            try:
                await self._kube.patch_job(key[0], key[1], patch)
            except KubeError as exc:
                if not exc.not_found:
                    log.warning("could not set the power limits of PerseusJob %s/%s: %s", *key,
                                exc)  # fmt: skip
                continue
            log.info("PerseusJob %s/%s: GPU power limits %s", key[0], key[1],
                     "removed" if value is None else value)  # fmt: skip

    async def _read_namespaced(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every node plan and PerseusJob the operator manages (namespace by namespace when it
        watches some only: its account may list no others)."""
        if not self._namespaces:
            return await self._kube.list_all_node_plans(), await self._kube.list_jobs(None)
        plans, jobs = [], []
        for namespace in sorted(self._namespaces):
            plans += await self._kube.list_all_node_plans(namespace)
            jobs += await self._kube.list_jobs(namespace)
        return plans, jobs


def _warm_allocation() -> None:
    """Solve a tiny allocation that takes every path of the solver (search included)."""
    times_s = np.array([1.0, 1.1, 1.2, 1.4])
    jobs = [
        JobPoints(f"warm-{k}", times_s * (1 + k / 10), np.array([300.0, 260.0, 240.0, 200.0]))
        for k in range(3)
    ]
    allocate(jobs, 760.0, 10.0)


def _status(body: Mapping[str, Any]) -> PerseusPowerBudgetStatus | None:
    raw = body.get("status")
    if not isinstance(raw, Mapping) or not raw:
        return None
    try:
        return PerseusPowerBudgetStatus.model_validate(raw)
    except ValueError:
        return None  # an unreadable status is rebuilt, not trusted
