"""Iteration times of the training processes: ``perseus_iteration_seconds`` and the ranks'
recent iterations in the node's report (the operator's straggler detection reads those).

Only the process driving a GPU of the plan is measured, under the plan's labels: what a client
claims in hello never names a series or a rank. A rank's recent iterations restart with each
plan revision, and an iteration that a plan change cut in two is not kept.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from perseus_agent.control.plan_state import GpuState, PlanState, TrainingProcess
from perseus_agent.exporter import AgentMetrics
from perseus_api.node_report import ITERATION_WINDOW as _ITERATION_WINDOW
from perseus_api.node_report import RankReport

__all__ = ["IterationStats"]


@dataclass
class _RankTimes:
    dp_rank: int | None
    pp_rank: int | None
    count: int = 0
    revision: int | None = None
    recent_s: deque[float] = field(default_factory=lambda: deque(maxlen=_ITERATION_WINDOW))


class IterationStats:
    """The iteration series and times of the processes of ``state``'s plan.

    Not thread-safe: the applier calls it under the state's lock.
    """

    def __init__(self, state: PlanState, metrics: AgentMetrics) -> None:
        self._state = state
        self._metrics = metrics
        self._ranks: dict[int, _RankTimes] = {}
        self._series: set[tuple[str, ...]] = set()  # perseus_iteration_seconds label values

    def record(self, g: GpuState, s: TrainingProcess, seconds: float) -> None:
        """Process ``s``, driving ``g`` (its first GPU), ended an iteration of ``seconds``."""
        plan = self._state.plan
        self._series.add(self._metrics.observe_iteration(self._labels(g), seconds))
        dp_rank, pp_rank = g.assignment.dp_rank, g.assignment.stage
        rank = g.assignment.rank if g.assignment.rank is not None else s.rank
        if rank is None:
            return
        times = self._ranks.get(rank)
        if times is None or (times.dp_rank, times.pp_rank) != (dp_rank, pp_rank):
            times = self._ranks[rank] = _RankTimes(dp_rank, pp_rank)
            self._prune_ranks()
        times.count += 1
        revision = None if plan is None else plan.revision
        if revision != times.revision:
            # A new plan changes the pace on purpose (e.g. re-targeted to a straggler): the
            # operator compares means under one plan, so start a new one.
            times.revision = revision
            times.recent_s.clear()
        if s.step_revision == revision:  # not an iteration the change cut in two
            times.recent_s.append(seconds)

    def prune(self) -> None:
        """Remove the iteration series of GPUs that left the plan (or whose labels changed),
        and the iteration times of ranks it no longer has."""
        state = self._state
        live = (
            {self._metrics.iteration_values(self._labels(g)) for g in state.gpus.values()}
            if state.plan is not None
            else set()
        )
        for values in self._series - live:
            self._metrics.remove_iteration(values)
        self._series &= live
        self._prune_ranks()

    def rank_reports(self) -> list[RankReport]:
        """The ranks with an iteration under the current revision kept, by rank."""
        return [
            RankReport(
                rank=rank,
                dp_rank=t.dp_rank,
                pp_rank=t.pp_rank,
                iterations=t.count,
                last_iteration_s=t.recent_s[-1],
                mean_iteration_s=statistics.fmean(t.recent_s),
                revision=t.revision,
            )
            for rank, t in sorted(self._ranks.items())
            if t.recent_s
        ]

    def _prune_ranks(self) -> None:
        state = self._state
        if state.plan is None:
            self._ranks.clear()
            return
        live = {a.rank for a in state.plan.assignments if a.rank is not None}
        for key, s in state.sessions.items():
            if s.rank is not None and state.owned(key, s):
                live.add(s.rank)
        for rank in set(self._ranks) - live:
            del self._ranks[rank]

    def _labels(self, g: GpuState) -> dict[str, str]:
        """Labels of ``g``'s ``perseus_iteration_seconds`` series, all from the plan."""
        plan = self._state.plan
        assert plan is not None
        a = g.assignment
        return {
            **g.labels(plan),
            "gpu": str(g.info.index),
            "uuid": g.info.uuid,
            "rank": "" if a.rank is None else str(a.rank),
        }
