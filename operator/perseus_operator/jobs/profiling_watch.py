"""How a profiling run stands, and when to give up on training processes that never call in.

The node agents measure a profile only while each GPU's training process calls the
``perseus_client`` hooks: the first ``step_begin`` locks the first clock of the sweep. A GPU
whose process never calls in (a training loop without the hooks, e.g. ``Stage`` granularity
with no code change; a crashed or stuck process; no agent on the node) would keep the job in
``Profiling`` for ever. :func:`decide_profiling` reads the agents' reports in the node plans'
status and says: done, still waiting (and for whom), or, once
``profiling.trainingProcessTimeoutSeconds`` have passed since the profiling plans were
written, that the job ends with ``NoTrainingProcess``, naming the pods that never called in.

A sweep that runs takes as long as its clocks x iterations take, which depends on the model,
not on the operator: it is never timed out as a whole. What is bounded, by the same
``trainingProcessTimeoutSeconds``, is a sweep that stops moving (no iteration measured or
dropped, no clock done, on any GPU of the job: :func:`profiling_progress`), e.g. training
processes that called in and then hung: the job ends with ``ProfilingStalled``, naming the
pods not done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from perseus_api.node_report import GpuProfilingReport
from perseus_operator.jobs.node_status import node_plan_status
from perseus_operator.workloads.ranks import RankPlacement

NO_TRAINING_PROCESS: Final = "NoTrainingProcess"
PROFILING_STALLED: Final = "ProfilingStalled"


@dataclass(frozen=True)
class SilentPod:
    """A pod none of whose profiled GPUs (on ``node``) has seen its training process."""

    pod: str
    node: str
    ranks: tuple[int, ...]
    """The global ranks of its processes (node plans name GPUs by process, not by index)."""
    agent_reported: bool
    """Whether the node's agent reported the profiling plan at all."""

    def describe(self) -> str:
        ranks = ", ".join(str(r) for r in self.ranks)
        where = f"rank{'s' if len(self.ranks) > 1 else ''} {ranks} on node {self.node}"
        if not self.agent_reported:
            return f"{self.pod} ({where}: no report from the node agent)"
        return f"{self.pod} ({where})"


class ProfilingState(StrEnum):
    DONE = "Done"
    """Every pipeline stage has a finished profile."""
    WAITING = "Waiting"
    """Measuring, or waiting (within the bound) for training processes to call in."""
    NO_TRAINING_PROCESS = "NoTrainingProcess"
    """Some processes never called in within the bound: the job ends (see ``message``)."""
    STALLED = "ProfilingStalled"
    """The sweep made no progress within the bound: the job ends (see ``message``)."""


@dataclass(frozen=True)
class ProfilingVerdict:
    state: ProfilingState
    message: str
    silent: tuple[SilentPod, ...] = ()


def called_in(report: GpuProfilingReport) -> bool:
    """Whether a GPU's profiling report (``status.profiling`` entry) shows that its training
    process began an iteration: a clock was locked for it, or iterations were measured or
    dropped, or it is done."""
    return (
        report.done
        or any(a is not None for a in report.applied_mhz)
        or report.measured_iterations > 0
        or report.dropped_iterations > 0
    )


def silent_pods(
    plans: Sequence[Mapping[str, Any]], ranks: Sequence[RankPlacement]
) -> tuple[SilentPod, ...]:
    """The pods whose every GPU has not seen its training process yet (a pod with one GPU
    measuring has called in: its other processes may still be starting)."""
    reports: dict[tuple[str, int], GpuProfilingReport] = {}  # by (node, global rank)
    reported_nodes = set()
    for plan in plans:
        node = str((plan.get("spec") or {}).get("node") or "")
        entries = node_plan_status(plan).profiling
        if entries:
            reported_nodes.add(node)
        for entry in entries:
            if entry.rank is not None:
                reports[(node, entry.rank)] = entry
    by_pod: dict[tuple[str, str], list[int]] = {}
    active: set[tuple[str, str]] = set()
    for r in ranks:
        key = (r.pod, r.node)
        by_pod.setdefault(key, []).append(r.rank)
        report = reports.get((r.node, r.rank))
        if report is not None and called_in(report):
            active.add(key)
    return tuple(
        SilentPod(pod, node, tuple(sorted(gpus)), node in reported_nodes)
        for (pod, node), gpus in sorted(by_pod.items())
        if (pod, node) not in active
    )


def profiling_progress(plans: Sequence[Mapping[str, Any]]) -> int:
    """A count that grows whenever the job's sweep moves (clocks locked, iterations measured
    or dropped, clocks and GPUs done, over every GPU's report); unchanged while it stands
    still. Warm-up iterations after a clock change are not reported, so a sweep stands still
    for up to ``warmupIterations`` iterations at each clock."""
    total = 0
    for plan in plans:
        for r in node_plan_status(plan).profiling:
            for value in (r.measured_iterations, r.dropped_iterations, r.frequency_index):
                total += max(value, 0)
            # a clock locked at an iteration's begin
            total += sum(1 for clock in r.applied_mhz if clock is not None)
            total += 1 if r.done else 0
    return total


def decide_profiling(
    plans: Sequence[Mapping[str, Any]],
    ranks: Sequence[RankPlacement],
    stages: int,
    *,
    started_s: float,
    progress_at_s: float,
    now_s: float,
    timeout_s: float,
    note: str = "",
) -> ProfilingVerdict:
    """Where the profiling of a job stands.

    ``plans``: the job's node plans with the agents' status; ``started_s``, ``progress_at_s``,
    ``now_s``: Unix seconds when the profiling plans were written, when
    :func:`profiling_progress` last changed (or they were written), and now; ``timeout_s``:
    the bound on a training process calling in, and on the sweep standing still; ``note``:
    appended to the messages (what profiling needs).
    """
    reports = [r for p in plans for r in node_plan_status(p).profiling]
    done_stages = {r.stage for r in reports if r.done} & set(range(stages))
    if len(done_stages) == stages:
        return ProfilingVerdict(ProfilingState.DONE, "")
    message = f"profiling: {len(done_stages)} of {stages} pipeline stages measured"
    silent = silent_pods(plans, ranks)
    waited_s = max(now_s - started_s, 0.0)
    if silent and waited_s >= timeout_s:
        names = "; ".join(s.describe() for s in silent)
        return ProfilingVerdict(
            ProfilingState.NO_TRAINING_PROCESS,
            f"no training process called the node agent within {timeout_s:g} s "
            f"(profiling.trainingProcessTimeoutSeconds) on pods {names}. Profiling measures "
            "every forward and backward through the perseus_client hooks (step and "
            "instruction begin/end); a training loop without them needs a stored profile: "
            "set spec.profiling.profileRef (or spec.profiling.model, to use one a job of the "
            "same model stored). The profiling plans were withdrawn and the GPUs reset",
            silent,
        )
    still_s = max(now_s - progress_at_s, 0.0)
    if not silent and still_s >= timeout_s:
        unfinished = unfinished_pods(plans, ranks)
        return ProfilingVerdict(
            ProfilingState.STALLED,
            f"profiling made no progress for {still_s:.0f} s (profiling."
            "trainingProcessTimeoutSeconds: no iteration measured or dropped on any GPU): "
            f"pods {', '.join(unfinished)} have not finished their sweep. Their training "
            "processes called in and then stopped calling (hung, or stopped before an "
            "iteration ended); the profiling plans were withdrawn and the GPUs reset. Fix the "
            "training and change the spec to profile again, or set spec.profiling.profileRef",
        )
    if silent:
        names = ", ".join(s.pod for s in silent)
        message += (
            f"; waiting for the training processes of pods {names} to call in "
            f"({waited_s:.0f} of {timeout_s:g} s)"
        )
    if note:
        message += f". {note}"
    return ProfilingVerdict(ProfilingState.WAITING, message, silent)


def unfinished_pods(
    plans: Sequence[Mapping[str, Any]], ranks: Sequence[RankPlacement]
) -> list[str]:
    """The pods with a profiled GPU whose report is missing or not done."""
    done = set()
    for plan in plans:
        node = str((plan.get("spec") or {}).get("node") or "")
        for r in node_plan_status(plan).profiling:
            if r.done and r.rank is not None:
                done.add((node, r.rank))
    return sorted({r.pod for r in ranks if (r.node, r.rank) not in done})
