"""The operator's Prometheus metrics (names as in DESIGN.md; base units, ``_total`` counters).

:class:`ProcessMetrics` are every replica's (leader or standby: served from the process's start,
:mod:`perseus_operator.endpoints`); :class:`OperatorMetrics` are the leader's reconciles, on the
same registry once it leads.
"""

from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass, field

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from perseus_api.job_status import Phase
from perseus_api.plan import PipelinePlan
from perseus_api.power_budget import PerseusPowerBudgetStatus

BUDGET_JOB_LABELS = ["budget", "job_namespace", "job_name"]
"""A budget's job: ``job_namespace``/``job_name``, not ``namespace``/``job``, which Prometheus
sets on every scraped series (the operator's own) and would rename to ``exported_*``."""

JOB_LABELS = ["job_namespace", "job_name"]
"""A PerseusJob's series: its namespace and name, never Prometheus's target labels
``namespace`` and ``job`` (the operator's pod and the scrape job), as the agents' series."""


class ProcessMetrics:
    """Metrics of the process itself, on ``registry`` (a new dedicated one by default).

    ``perseus_operator_leader`` is 1 while this replica holds the Lease (so
    ``sum(perseus_operator_leader)`` is 1 in a healthy release, 0 while no replica leads, and
    ``absent()`` when no replica is scraped at all); ``perseus_operator_build_info`` names the
    version; ``process_*`` and ``python_*`` are prometheus_client's standard collectors.
    """

    def __init__(self, version: str, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        # The standard collectors, registered on this registry instead of the global one.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self.leader = Gauge(
            "perseus_operator_leader",
            "1 while this replica holds the leader Lease and reconciles, 0 while it waits.",
            registry=r,
        )
        info = Gauge(
            "perseus_operator_build_info",
            "Always 1; the labels name the operator's version and its Python's.",
            ["version", "python_version"],
            registry=r,
        )
        info.labels(version, platform.python_version()).set(1)


@dataclass
class _JobSeen:
    phase: Phase
    iterations: int = 0


@dataclass
class OperatorMetrics:
    """Metrics of one operator process, on their own registry."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.jobs = Gauge("perseus_jobs", "PerseusJobs by phase.", ["phase"], registry=r)
        self.savings = Gauge(
            "perseus_job_expected_savings_ratio",
            "Energy the current plan is expected to save vs. all GPUs at max clock (fraction).",
            JOB_LABELS,
            registry=r,
        )
        self.saved = Counter(
            "perseus_job_energy_saved_joules",
            "Energy saved vs. all GPUs at max clock, estimated from the plans and the "
            "iterations the agents counted, in joules.",
            JOB_LABELS,
            registry=r,
        )
        self.stragglers = Counter(
            "perseus_straggler_events",
            "Data-parallel replicas detected as stragglers.",
            JOB_LABELS,
            registry=r,
        )
        self.planner = Histogram(
            "perseus_planner_seconds",
            "Time to solve one iteration time-energy frontier, in seconds.",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.budget = Gauge(
            "perseus_power_budget_watts",
            "A PerseusPowerBudget's budget for its domain's GPUs, in watts.",
            ["budget"],
            registry=r,
        )
        self.budget_measured = Gauge(
            "perseus_power_budget_measured_watts",
            "The domain's GPU draw averaged over the budget's window, from the agents' energy "
            "counters, in watts.",
            ["budget"],
            registry=r,
        )
        self.budget_missing = Gauge(
            "perseus_power_budget_missing_watts",
            "Watts the budget lacks even with every job at its least-power point (0: feasible).",
            ["budget"],
            registry=r,
        )
        self.budget_allocated = Gauge(
            "perseus_power_budget_job_allocated_watts",
            "Average draw of the frontier point the budget chose for a job, in watts.",
            BUDGET_JOB_LABELS,
            registry=r,
        )
        self.budget_slowdown = Gauge(
            "perseus_power_budget_job_slowdown_ratio",
            "Iteration time of the job's chosen point over its T_min, less 1.",
            BUDGET_JOB_LABELS,
            registry=r,
        )
        self._budget_jobs: dict[str, set[tuple[str, str]]] = {}
        self._seen: dict[tuple[str, str], _JobSeen] = {}
        for phase in Phase:
            self.jobs.labels(phase.value).set(0)

    def observe_job(
        self,
        namespace: str,
        job: str,
        phase: Phase,
        plan: PipelinePlan | None,
        iterations: int,
        replicas: int,
        new_stragglers: int,
    ) -> None:
        """Record one reconcile of ``job``: its phase, its plan's expected savings, the energy
        saved over the ``iterations`` the agents counted since the last call, and stragglers."""
        key = (namespace, job)
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = _JobSeen(phase, iterations)
            self.jobs.labels(phase.value).inc()
        elif seen.phase != phase:
            self.jobs.labels(seen.phase.value).dec()
            self.jobs.labels(phase.value).inc()
            seen.phase = phase
        if new_stragglers:
            self.stragglers.labels(namespace, job).inc(new_stragglers)
        if plan is None:
            seen.iterations = iterations
            return
        self.savings.labels(namespace, job).set(plan.estimate.savings_ratio)
        # Counters restart with the training process; count only growth.
        done = iterations - seen.iterations if iterations >= seen.iterations else iterations
        seen.iterations = iterations
        if done > 0 and phase == Phase.RUNNING:
            self.saved.labels(namespace, job).inc(done * replicas * saved_per_iteration_j(plan))

    def forget_job(self, namespace: str, job: str) -> None:
        seen = self._seen.pop((namespace, job), None)
        if seen is not None:
            self.jobs.labels(seen.phase.value).dec()
        for metric in (self.savings, self.saved, self.stragglers):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, job)

    def observe_budget(self, name: str, status: PerseusPowerBudgetStatus) -> None:
        """Record one round of budget ``name`` (its status as written)."""
        self.budget.labels(name).set(status.budget_watts or 0.0)
        if status.measured_watts is None:
            with contextlib.suppress(KeyError):
                self.budget_measured.remove(name)
        else:
            self.budget_measured.labels(name).set(status.measured_watts)
        self.budget_missing.labels(name).set(status.missing_watts or 0.0)
        now = {(j.namespace, j.name) for j in status.jobs}
        for namespace, job in self._budget_jobs.get(name, set()) - now:
            for metric in (self.budget_allocated, self.budget_slowdown):
                with contextlib.suppress(KeyError):
                    metric.remove(name, namespace, job)
        for j in status.jobs:
            self.budget_allocated.labels(name, j.namespace, j.name).set(j.allocated_watts)
            self.budget_slowdown.labels(name, j.namespace, j.name).set(j.slowdown_ratio)
        self._budget_jobs[name] = now

    def forget_budget(self, name: str) -> None:
        for metric in (self.budget, self.budget_measured, self.budget_missing):
            with contextlib.suppress(KeyError):
                metric.remove(name)
        for namespace, job in self._budget_jobs.pop(name, set()):
            for job_metric in (self.budget_allocated, self.budget_slowdown):
                with contextlib.suppress(KeyError):
                    job_metric.remove(name, namespace, job)


def saved_per_iteration_j(plan: PipelinePlan) -> float:
    """Joules one pipeline saves per iteration: baseline energy minus the plan's."""
    estimate = plan.estimate
    ratio = estimate.savings_ratio
    if ratio >= 1:
        return 0.0
    return estimate.energy_j * ratio / (1 - ratio)
