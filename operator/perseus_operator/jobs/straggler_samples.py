"""The straggler detector's input: one rank's latest telemetry (:class:`RankSample`), when it
is stale, and which report round it stands for.

An agent that writes only reports that say something new (a dead-band on the iteration
times, plus a heartbeat: ``perseus_agent.kube.report_cadence``) says so in its status
(``reportIntervalSeconds``, ``heartbeatSeconds``). Its report not rewritten for a report
interval is one more report of the same times: the agent would have written a change, so
persistence still counts report intervals (:meth:`RankSample.evidence_s`). And its
telemetry is stale only when the heartbeat is well overdue (:meth:`RankSample.stale`):
``staleAfterSeconds``, or twice the heartbeat if that is longer, so that a job whose
``staleAfterSeconds`` is shorter than the agents' heartbeat does not see live agents as dead.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RankSample"]


@dataclass(frozen=True, slots=True)
class RankSample:
    """One rank's latest telemetry, as reported by the agent of its node.

    ``iterations`` counts iterations since the rank (re)started; ``mean_iteration_s`` is the
    agent's mean iteration time over its last few iterations, in seconds; ``reported_at_s`` is
    when the agent wrote it, in seconds on the same clock as the detector's ``now_s``.
    ``report_interval_s`` and ``heartbeat_s``: the agent's cadence when it writes only what
    changed (None: every report is written, as older agents do).
    """

    rank: int
    dp_rank: int
    pp_rank: int
    node: str
    iterations: int
    mean_iteration_s: float
    reported_at_s: float
    report_interval_s: float | None = None
    heartbeat_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in (
            ("rank", self.rank),
            ("dp_rank", self.dp_rank),
            ("pp_rank", self.pp_rank),
            ("iterations", self.iterations),
        ):
            if value < 0:
                raise ValueError(f"rank sample: {name} must be >= 0, got {value}")
        if not self.node:
            raise ValueError(f"rank sample of rank {self.rank}: node must not be empty")
        if not (math.isfinite(self.mean_iteration_s) and self.mean_iteration_s >= 0):
            raise ValueError(
                f"rank sample of rank {self.rank}: mean_iteration_s must be finite and >= 0, "
                f"got {self.mean_iteration_s}"
            )
        if not math.isfinite(self.reported_at_s):
            raise ValueError(
                f"rank sample of rank {self.rank}: reported_at_s must be finite, "
                f"got {self.reported_at_s}"
            )
        for name, cadence in (
            ("report_interval_s", self.report_interval_s),
            ("heartbeat_s", self.heartbeat_s),
        ):
            if cadence is not None and not (math.isfinite(cadence) and cadence > 0):
                raise ValueError(
                    f"rank sample of rank {self.rank}: {name} must be > 0, got {cadence}"
                )

    def stale_after_s(self, stale_after_s: float) -> float:
        """How old this sample's report may get before its telemetry is stale: the job's
        ``stale_after_s``, or twice the agent's heartbeat when that is longer."""
        if self.heartbeat_s is None:
            return stale_after_s
        return max(stale_after_s, 2 * self.heartbeat_s)

    def stale(self, now_s: float, stale_after_s: float) -> bool:
        return now_s - self.reported_at_s > self.stale_after_s(stale_after_s)

    def evidence_s(self, now_s: float) -> float:
        """The time of the latest report this sample stands for: when it was written, or,
        from an agent that writes only changes, its last report interval up to ``now_s``."""
        interval = self.report_interval_s
        if interval is None or now_s <= self.reported_at_s:
            return self.reported_at_s
        return self.reported_at_s + math.floor((now_s - self.reported_at_s) / interval) * interval
