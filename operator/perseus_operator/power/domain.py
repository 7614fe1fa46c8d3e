"""What a power domain holds, from what the controller read: its nodes, the managed jobs on
them and their GPUs, and the draw measured from the agents' energy counters.

Pure apart from :class:`DrawMeter`'s memory of past counter readings (no I/O): the budget
controller (:mod:`perseus_operator.power.budget_controller`) reads the cluster and passes
the objects here.

The draw comes, when the operator is given a Prometheus URL, from the Prometheus that scrapes
the node agents (:mod:`perseus_operator.power.prometheus_draw`): every GPU of every node, by
job, the GPUs no PerseusJob manages included. Without one, or when it does not answer, from
the node agents' reports: each GPU of a node plan reports its NVML energy counter
(``status.gpus[].energyJoules``) with the report's time (``status.reportedAt``), every report
interval. A GPU's draw over the window is the growth of its counter between the oldest and the
newest reading in the window over the time between them. Only GPUs under a node plan report
there: the GPUs of nodes with no plan are then not measured (counted as 0 W).

Either way the *unmanaged* draw the allocation plans around is the domain's draw less that of
the jobs it allocates: GPUs of no PerseusJob, and of PerseusJobs not (yet) in the allocation
(profiling, say), count at what they draw.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from perseus_api.conventions import parse_rfc3339
from perseus_api.job import LabelSelector
from perseus_api.resources import JOB_LABEL, object_key
from perseus_operator.jobs.node_status import node_plan_status
from perseus_operator.power.budget_decisions import JobKey
from perseus_operator.power.prometheus_draw import DrawByJob
from perseus_operator.workloads.selectors import matches

__all__ = [
    "DomainGpus",
    "DrawMeter",
    "domain_draw",
    "domain_gpus",
    "job_inputs",
    "selected_nodes",
]

_MAX_SAMPLES: Final = 512
"""Readings kept per GPU: a window of an hour at a report every ~7 s."""


def selected_nodes(selector: LabelSelector, nodes: Iterable[Mapping[str, Any]]) -> set[str]:
    """Names of the ``nodes`` whose labels ``selector`` selects."""
    out = set()
    for node in nodes:
        metadata = node.get("metadata") or {}
        labels = metadata.get("labels") or {}
        name = metadata.get("name")
        if isinstance(name, str) and name and matches(selector, labels):
            out.add(name)
    return out


@dataclass
class DomainGpus:
    """The node plans on a domain's nodes: each job's GPUs there, and the plans (for the draw)."""

    gpus: dict[JobKey, int] = field(default_factory=dict)
    plans: list[Mapping[str, Any]] = field(default_factory=list)


def domain_gpus(nodes: set[str], node_plans: Iterable[Mapping[str, Any]]) -> DomainGpus:
    """The node plans on ``nodes``, and each job's GPUs among them."""
    out = DomainGpus()
    for plan in node_plans:
        spec = plan.get("spec") or {}
        if spec.get("node") not in nodes:
            continue
        namespace, _ = object_key(plan)
        job = spec.get("job") or ((plan.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)
        if not isinstance(job, str) or not job:
            continue
        assignments = spec.get("assignments")
        count = len(assignments) if isinstance(assignments, list) else 0
        key = (namespace, job)
        out.gpus[key] = out.gpus.get(key, 0) + count
        out.plans.append(plan)
    return out


@dataclass(frozen=True)
class JobInput:
    """What the allocation needs of a PerseusJob's object: replicas and weight."""

    replicas: int
    weight: float
    running: bool


def job_inputs(jobs: Iterable[Mapping[str, Any]]) -> dict[JobKey, JobInput]:
    """Replicas, ``spec.policy.powerWeight`` and whether it runs, of each PerseusJob (a field
    the API server let through but that is not a number counts as its default)."""
    out = {}
    for job in jobs:
        key = object_key(job)
        spec = job.get("spec") or {}
        parallelism = spec.get("parallelism") or {}
        policy = spec.get("policy") or {}
        replicas = _number(parallelism.get("dataParallel"), 1.0)
        weight = _number(policy.get("powerWeight"), 1.0)
        phase = (job.get("status") or {}).get("phase")
        out[key] = JobInput(
            max(1, int(replicas)), weight if weight > 0 else 1.0, phase == "Running"
        )
    return out


def _number(value: object, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return default
    return float(value)


class DrawMeter:
    """The GPUs' draw from their energy counters, remembered across rounds (see the module
    docstring)."""

    def __init__(self) -> None:
        self._samples: dict[tuple[str, str], deque[tuple[float, float]]] = {}

    def record(self, plans: Iterable[Mapping[str, Any]]) -> None:
        """Take the readings of the plans' latest reports (a report already seen adds nothing)."""
        for plan in plans:
            status = node_plan_status(plan)
            when = parse_rfc3339(status.reported_at)
            node = (plan.get("spec") or {}).get("node") or status.node or ""
            if when is None:
                continue
            t_s = when.timestamp()
            for gpu in status.gpus:
                if gpu.uuid is None or gpu.energy_j is None:
                    continue
                samples = self._samples.setdefault((node, gpu.uuid), deque(maxlen=_MAX_SAMPLES))
                if samples and t_s <= samples[-1][0]:
                    continue
                if samples and gpu.energy_j < samples[-1][1]:
                    samples.clear()  # the counter started over (a driver reload)
                samples.append((t_s, gpu.energy_j))

    def watts(
        self, plans: Sequence[Mapping[str, Any]], window_s: float, now_s: float
    ) -> float | None:
        """The plans' GPUs' draw averaged over the last ``window_s``; None when no GPU has two
        readings in it yet."""
        total_w, measured = 0.0, False
        for gpu in _gpus_of(plans):
            samples = self._samples.get(gpu)
            if not samples:
                continue
            inside = [(t, e) for t, e in samples if t >= now_s - window_s]
            if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
                continue
            total_w += (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
            measured = True
        return total_w if measured else None

    def forget_except(self, plans: Iterable[Mapping[str, Any]]) -> None:
        """Drop the readings of GPUs no plan holds any more."""
        keep = set(_gpus_of(plans))
        for gpu in set(self._samples) - keep:
            del self._samples[gpu]


def domain_draw(
    nodes: Collection[str],
    allocated: Collection[JobKey],
    *,
    scraped: DrawByJob | None,
    meter: DrawMeter,
    plans: Sequence[Mapping[str, Any]],
    window_s: float,
    now_s: float,
) -> tuple[float | None, float]:
    """The domain's measured draw (None: none yet) and its unmanaged draw, in watts.

    Args:
        nodes: The domain's nodes.
        allocated: The jobs the allocation plans for.
        scraped: The draw by node and job from Prometheus (None: not asked or no answer).
        meter: The node plans' readings, used without ``scraped``.
        plans: The node plans on the domain's nodes.
        window_s, now_s: The averaging window and the time (Unix seconds).
    """
    if scraped is not None:
        inside = [(key, w) for key, w in scraped.items() if key[0] in nodes]
        if not inside:
            return None, 0.0
        total_w = math.fsum(w for _, w in inside)
        managed_w = math.fsum(w for (_, ns, job), w in inside if (ns, job) in allocated)
        return total_w, max(0.0, total_w - managed_w)
    measured_w = meter.watts(plans, window_s, now_s)
    others = [p for p in plans if _job_of(p) not in allocated]
    unmanaged_w = meter.watts(others, window_s, now_s) if others else None
    return measured_w, unmanaged_w or 0.0


def _job_of(plan: Mapping[str, Any]) -> JobKey:
    namespace, _ = object_key(plan)
    spec = plan.get("spec") or {}
    job = spec.get("job") or ((plan.get("metadata") or {}).get("labels") or {}).get(JOB_LABEL)
    return namespace, str(job or "")


def _gpus_of(plans: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    out = []
    for plan in plans:
        status = node_plan_status(plan)
        node = (plan.get("spec") or {}).get("node") or status.node or ""
        out += [(node, g.uuid) for g in status.gpus if g.uuid is not None]
    return out
