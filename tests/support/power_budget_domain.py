"""One power domain of a cluster power budget end to end (``test_power_budget_cluster.py``): its
cluster, node agents, operator process, Prometheus and trainings, read and written through the
API server; draws as Prometheus measures them, iteration times as the trainings record them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from perseus_api import resources
from perseus_api.power_budget import BUDGET_PLURAL
from perseus_operator.jobs.job_decisions import POWER_TARGET_ANNOTATION
from support.agent_process import Agent
from support.cluster_harness import Cluster
from support.emulated_training import Training, Window, window_of
from support.operator_harness import OperatorProcess
from support.prometheus_server import Prometheus

MEASURED = 5  # iterations per measured window
WINDOWS = 3  # windows per measurement
TIMEOUT_S = 180.0


def draw_query(nodes: list[str], window_s: int) -> str:
    """PromQL: the nodes' GPUs' draw over the budget's window, from the agents' counters."""
    return f'sum(rate(perseus_gpu_energy_joules_total{{node=~"{"|".join(nodes)}"}}[{window_s}s]))'


@dataclass
class Domain:
    """The domain's parts, and what the scenarios read and write through them; the numbers a
    scenario measures go on its fields (and, printed, into :attr:`log`)."""

    cluster: Cluster
    workdir: Path
    agents: dict[str, Agent]
    operator: OperatorProcess
    prom: Prometheus
    namespace: str  # of the jobs
    budget_name: str
    node_selector: dict[str, str]  # the budget's domain
    window_s: int  # the budget's averaging window
    margin_ratio: float  # the budget's safety margin
    trainings: dict[str, Training] = field(default_factory=dict)
    all_max_w: dict[str, float] = field(default_factory=dict)
    all_max_s: dict[str, float] = field(default_factory=dict)
    t_min_s: dict[str, float] = field(default_factory=dict)
    unmanaged_w: float = 0.0
    slowed_s: dict[str, float] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    # -- reading the cluster --

    def job(self, name: str) -> dict[str, Any]:
        job: dict[str, Any] = self.cluster.custom.get_namespaced_custom_object(
            resources.GROUP, resources.VERSION, self.namespace, "perseusjobs", name
        )
        return job

    def budget(self) -> dict[str, Any]:
        budget: dict[str, Any] = self.cluster.custom.get_cluster_custom_object(
            resources.GROUP, resources.VERSION, BUDGET_PLURAL, self.budget_name
        )
        return budget

    def node_plans(self, job: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.custom.list_namespaced_custom_object(
            resources.GROUP, resources.VERSION, self.namespace, resources.NODE_PLAN_PLURAL,
            label_selector=f"{resources.JOB_LABEL}={job}",
        )["items"]  # fmt: skip
        return items

    def applied(self, job: str) -> int | None:
        """The job's plan revision once its agent reports it applied, else None."""
        status = self.job(job).get("status", {})
        if status.get("phase") != "Running" or status.get("plan") is None:
            return None
        revision = status["revision"]
        plans = self.node_plans(job)
        done = len(plans) == 1 and plans[0].get("status", {}).get("observedRevision") == revision
        return int(revision) if done else None

    def draw_w(self, nodes: list[str], at_s: float | None = None) -> float:
        return self.prom.scalar(draw_query(nodes, self.window_s), at_s)

    def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float = TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            for agent in self.agents.values():
                if agent.proc is not None and agent.proc.poll() is not None:
                    pytest.fail(f"agent {agent.node} exited waiting for {what}:\n{agent.log}")
            if self.operator.proc.poll() is not None:
                pytest.fail(f"the operator exited waiting for {what}:\n{self.operator.stop()}")
            time.sleep(0.25)
        budget = json.dumps(self.budget().get("status"), indent=1) if self.has_budget() else "-"
        pytest.fail(
            f"timed out waiting for {what}; budget status: {budget}\n"
            f"operator output:\n{self.operator.stop()[-15000:]}"
        )

    def events(self) -> list[Any]:
        """The Events on this budget object, oldest first (in any namespace, as kubectl
        describe finds them). Selected by uid: Events outlive their object by an hour, and
        another test's budget of the same name would otherwise speak here."""
        uid = self.budget()["metadata"]["uid"]
        items = self.cluster.core.list_event_for_all_namespaces(
            field_selector=(
                f"involvedObject.name={self.budget_name},involvedObject.kind=PerseusPowerBudget,"
                f"involvedObject.uid={uid}"
            )
        ).items
        return sorted(items, key=lambda e: e.metadata.creation_timestamp)

    def has_budget(self) -> bool:
        """Whether this domain's budget exists (other tests' budgets may share the cluster)."""
        items = self.cluster.custom.list_cluster_custom_object(
            resources.GROUP, resources.VERSION, BUDGET_PLURAL,
            field_selector=f"metadata.name={self.budget_name}",
        )["items"]  # fmt: skip
        return bool(items)

    # -- writing --

    def set_budget(self, watts: float) -> float:
        """Create or change the budget; the time it was written (Unix seconds)."""
        body = {
            "apiVersion": resources.API_VERSION,
            "kind": "PerseusPowerBudget",
            "metadata": {"name": self.budget_name},
            "spec": {
                "budgetWatts": round(watts, 1),
                "nodeSelector": {"matchLabels": self.node_selector},
                "averagingWindowSeconds": self.window_s,
                "safetyMarginRatio": self.margin_ratio,
            },
        }
        custom = self.cluster.custom
        if self.has_budget():
            custom.patch_cluster_custom_object(
                resources.GROUP, resources.VERSION, BUDGET_PLURAL, self.budget_name,
                {"spec": {"budgetWatts": round(watts, 1)}},
            )  # fmt: skip
        else:
            custom.create_cluster_custom_object(
                resources.GROUP, resources.VERSION, BUDGET_PLURAL, body
            )
        return time.time()

    def target_s(self, job: str) -> float | None:
        annotations = self.job(job)["metadata"].get("annotations") or {}
        value = annotations.get(POWER_TARGET_ANNOTATION)
        return None if value is None else float(value)

    def retargeted(self, generation: int) -> dict[str, Any] | None:
        """The budget's status once it describes ``generation`` and every job of it runs the
        plan of its allocated target, else None."""
        budget = self.budget()
        status = budget.get("status") or {}
        if status.get("observedGeneration") != generation:
            return None
        for job in status.get("jobs", []):
            name = job["name"]
            planned = (self.job(name)["status"].get("plan") or {}).get("targetIterationSeconds")
            target = self.target_s(name)
            if self.applied(name) is None or planned is None:
                return None
            # The plan's target is the frontier point's time, the annotation its 5 digits.
            if target is not None and not math.isclose(planned, target, rel_tol=1e-4):
                return None
        return status

    def measure(self, job: str) -> Window:
        """The job's pace: of :data:`WINDOWS` windows of :data:`MEASURED` iterations (each its
        median), the fastest. A host stall only ever adds time (an emulated GPU never runs
        faster than its clock), so the least-disturbed window is the plan's pace; with a core
        busy on this machine every window can be a stalled one."""
        training = self.trainings[job]
        training.wait_iterations(2)  # the iteration the plan lands in, and one more
        windows = [window_of(training.wait_iterations(MEASURED)) for _ in range(WINDOWS)]
        return min(windows, key=lambda w: w.iteration_s)

    def say(self, line: str) -> None:
        print(line)
        self.log.append(line)
