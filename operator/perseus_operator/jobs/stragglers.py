"""Straggler detection: which data-parallel replica is persistently slow, and by how much.

Perseus re-targets the healthy pipelines of a job to the iteration time ``T'`` of its slowest
replica: since data-parallel replicas synchronise every iteration, running the others faster
than ``T'`` only wastes energy. This module decides, from the node agents' reports, when a
replica is a straggler, what ``T'`` is, and when plans must be rewritten. It is pure and
deterministic (no clock, no I/O): the operator passes the samples and ``now_s`` of each report
round, and persists :meth:`StragglerDetector.state_to_save` to resume after a restart
(:meth:`StragglerDetector.from_saved`).

A replica's iteration time is the maximum over its ranks' ``mean_iteration_s`` (the slowest
stage gates the whole pipeline), counting only ranks past warm-up with fresh telemetry. The
reference time ``T`` is the lower median of the replicas' times, so one slow replica does not
move it (with two replicas it is the faster one, so ``T'/T`` is the straggler's true slowdown).
A round that measures fewer than two replicas (right after plans change, no agent has a mean
under the new plan yet) is no evidence: the verdict and the last reference stand.
Decisions need ``persistenceReports`` rounds in a row on the same side of a threshold, and the
thresholds differ for entering and leaving the straggler state (hysteresis), so noise,
checkpoint spikes and restarts do not make plans flap. A report round is a report interval of
the agents: an agent that writes only changes (and a heartbeat) stands for a report every
interval it stays silent, and is stale only when its heartbeat is overdue
(:mod:`perseus_operator.jobs.straggler_samples`). What it remembers between rounds, and its
saved form: :mod:`perseus_operator.jobs.straggler_state`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from perseus_api.job import Stragglers
from perseus_operator.jobs.straggler_samples import RankSample
from perseus_operator.jobs.straggler_state import (
    STATE_VERSION,
    DetectorMemory,
    Published,
    ReplicaMemory,
    decisive_key,
    memory_from_saved,
    memory_from_state,
    state_to_save,
    to_state,
)

__all__ = [
    "STATE_VERSION",
    "RankSample",
    "Straggler",
    "StragglerDetector",
    "StragglerVerdict",
]


@dataclass(frozen=True, slots=True)
class Straggler:
    """A replica flagged as straggler.

    ``node`` hosts its slowest rank; ``iteration_s`` is its smoothed iteration time in seconds
    (mean of its last ``persistenceReports`` times); ``slowdown`` is that over the baseline;
    ``since_s`` is the ``now_s`` of the round that flagged it.
    """

    dp_rank: int
    node: str
    slowdown: float
    since_s: float
    iteration_s: float


@dataclass(frozen=True, slots=True)
class StragglerVerdict:
    """The outcome of one report round.

    ``target_s`` (``T'``, seconds) is the slowest straggler's iteration time, which the other
    replicas should be re-targeted to; ``None`` without stragglers. ``baseline_s`` (``T``,
    seconds) is the lower median of the measured replicas' times (with two replicas, the
    faster one); ``None`` with fewer than two.
    ``degraded_nodes`` have stale telemetry: their replicas are neither flagged nor measured.
    ``changed`` says plans must be rewritten: the straggler set changed, or ``target_s`` moved
    by more than the retarget tolerance since the last verdict that changed.
    """

    stragglers: dict[int, Straggler]
    target_s: float | None
    baseline_s: float | None
    degraded_nodes: frozenset[str]
    changed: bool


@dataclass(frozen=True, slots=True)
class _ReplicaRound:
    """One round's view of a replica: ``time_s`` is None when no rank is past warm-up."""

    stale: bool
    time_s: float | None = None
    node: str | None = None
    reported_s: float | None = None


class _Side(Enum):
    SLOW = "slow"
    BETWEEN = "between"
    FAST = "fast"


# -- pure helpers ----------------------------------------------------------------------------------


def _check_round(samples: Sequence[RankSample], now_s: float) -> None:
    if not math.isfinite(now_s):
        raise ValueError(f"now_s must be finite, got {now_s}")
    seen: set[int] = set()
    for sample in samples:
        if sample.rank in seen:
            raise ValueError(f"rank {sample.rank} reported twice in one round")
        seen.add(sample.rank)


def _summarize(
    samples: Sequence[RankSample], now_s: float, settings: Stragglers
) -> tuple[dict[int, _ReplicaRound], frozenset[str]]:
    """Per-replica view of the round, and the nodes whose telemetry is stale."""
    by_replica: dict[int, list[RankSample]] = {}
    for sample in samples:
        by_replica.setdefault(sample.dp_rank, []).append(sample)
    stale_after_s = settings.stale_after_seconds
    degraded = frozenset(s.node for s in samples if s.stale(now_s, stale_after_s))
    rounds: dict[int, _ReplicaRound] = {}
    for dp_rank, ranks in sorted(by_replica.items()):
        if any(s.stale(now_s, stale_after_s) for s in ranks):
            rounds[dp_rank] = _ReplicaRound(stale=True)
            continue
        warm = [s for s in ranks if s.iterations > settings.warmup_iterations]
        if not warm:
            rounds[dp_rank] = _ReplicaRound(stale=False)
            continue
        # Ties go to the lowest rank so the reported node is deterministic.
        slowest = max(warm, key=lambda s: (s.mean_iteration_s, -s.rank))
        rounds[dp_rank] = _ReplicaRound(
            stale=False,
            time_s=slowest.mean_iteration_s,
            node=slowest.node,
            reported_s=max(s.evidence_s(now_s) for s in ranks),
        )
    return rounds, degraded


def _restarted(samples: Sequence[RankSample], iterations: Mapping[int, int]) -> frozenset[int]:
    """Replicas with a rank whose iteration count went down since the last round."""
    return frozenset(
        s.dp_rank for s in samples if s.rank in iterations and s.iterations < iterations[s.rank]
    )


def _side(time_s: float, baseline_s: float, settings: Stragglers) -> _Side:
    ratio = time_s / baseline_s
    if ratio >= settings.slowdown_threshold:
        return _Side.SLOW
    if ratio < settings.recovery_threshold:
        return _Side.FAST
    return _Side.BETWEEN


def _advance(
    replica: ReplicaMemory,
    round_: _ReplicaRound,
    baseline_s: float,
    now_s: float,
    settings: Stragglers,
) -> ReplicaMemory:
    """The replica's memory after a round that measured it at ``round_.time_s`` seconds.

    Only a newer report than the last one folded in counts: the operator may look more often
    than the agents report, and persistence is measured in reports.
    """
    time_s, node = round_.time_s, round_.node
    assert time_s is not None
    if (
        round_.reported_s is not None
        and replica.last_report_s is not None
        and round_.reported_s <= replica.last_report_s
    ):
        return replace(replica, node=replica.node or node)
    persistence = settings.persistence_reports
    side = _side(time_s, baseline_s, settings)
    # A round between the thresholds breaks both streaks: it is evidence for neither change.
    # Streaks stop at the persistence needed: longer ones decide nothing more.
    slow = min(replica.slow_streak + 1, persistence) if side is _Side.SLOW else 0
    fast = min(replica.fast_streak + 1, persistence) if side is _Side.FAST else 0
    flagged, since_s = replica.flagged, replica.since_s
    if not flagged and slow >= persistence:
        flagged, since_s = True, now_s
    elif flagged and fast >= persistence:
        flagged, since_s = False, None
    # A straggler's fast rounds are pending evidence of recovery, not a new target: letting
    # them into T' would rewrite plans on the way out, just before recovery rewrites them again.
    pending_recovery = flagged and side is _Side.FAST
    recent_s = replica.recent_s if pending_recovery else (*replica.recent_s, time_s)[-persistence:]
    return ReplicaMemory(
        slow_streak=slow,
        fast_streak=fast,
        recent_s=recent_s,
        flagged=flagged,
        since_s=since_s,
        node=node,
        last_report_s=round_.reported_s,
    )


def _smoothed_s(replica: ReplicaMemory) -> float:
    return statistics.fmean(replica.recent_s)


def _plans_change(
    published: Published, dp_ranks: frozenset[int], target_s: float | None, tolerance: float
) -> bool:
    if dp_ranks != published.dp_ranks:
        return True
    if target_s is None or published.target_s is None:
        return False
    return abs(target_s - published.target_s) > tolerance * published.target_s


# -- the detector ----------------------------------------------------------------------------------


class StragglerDetector:
    """Turns report rounds into straggler verdicts, remembering streaks between rounds.

    ``samples`` of a round must hold the latest report of every rank of the job (stale ones
    included: staleness is how a silent node shows). A replica with no sample at all is taken
    to be gone (the job was resized) and forgotten.
    """

    def __init__(self, settings: Stragglers, *, retarget_tolerance: float = 0.02) -> None:
        if not (math.isfinite(retarget_tolerance) and retarget_tolerance >= 0):
            raise ValueError(
                f"retarget_tolerance must be finite and >= 0, got {retarget_tolerance}"
            )
        self._settings = settings
        self._tolerance = retarget_tolerance
        self._iterations: dict[int, int] = {}
        self._replicas: dict[int, ReplicaMemory] = {}
        self._baseline_s: float | None = None
        """The last reference time measured, for rounds that measure no reference."""
        self._published = Published()
        self._kept: tuple[str | None, Hashable] | None = None
        """The ``saved`` state and :func:`decisive_key` for which :meth:`state_to_save` last
        said to keep it (asked at every reconcile; the answer changes only with them)."""

    @property
    def settings(self) -> Stragglers:
        return self._settings

    def observe(self, samples: Sequence[RankSample], now_s: float) -> StragglerVerdict:
        """Fold one report round (``now_s`` in seconds, same clock as the samples) in."""
        _check_round(samples, now_s)
        settings = self._settings
        restarted = _restarted(samples, self._iterations)
        self._iterations = {s.rank: s.iterations for s in samples}
        rounds, degraded = _summarize(samples, now_s, settings)

        # A replica without a report this round (e.g. none measured under its new plan yet) is
        # no evidence either way: it keeps what is known about it.
        replicas: dict[int, ReplicaMemory] = dict(self._replicas)
        for dp_rank, round_ in rounds.items():
            previous = self._replicas.get(dp_rank, ReplicaMemory())
            if round_.stale:
                # Nothing known about it can be trusted any more, including a straggler flag.
                previous = ReplicaMemory()
            elif dp_rank in restarted:
                # Evidence from before a restart says nothing about the new process.
                previous = replace(previous, slow_streak=0, fast_streak=0)
            replicas[dp_rank] = previous

        times_s = {dp: r.time_s for dp, r in rounds.items() if r.time_s is not None}
        baseline_s: float | None = None
        if len(times_s) >= 2:
            baseline_s = statistics.median_low(times_s.values())
        if baseline_s is not None and baseline_s > 0:
            for dp_rank in times_s:
                replicas[dp_rank] = _advance(
                    replicas[dp_rank], rounds[dp_rank], baseline_s, now_s, settings
                )
            self._baseline_s = baseline_s
        else:
            # Fewer than two replicas measured (all plans were just rewritten, say): no
            # reference this round, so no evidence; the verdict so far stands.
            baseline_s = None
        self._replicas = replicas

        stragglers: dict[int, Straggler] = {}
        reference_s = self._baseline_s
        if reference_s is not None:
            for dp_rank, replica in sorted(replicas.items()):
                if not replica.flagged:
                    continue
                assert replica.node is not None and replica.since_s is not None
                iteration_s = _smoothed_s(replica)
                stragglers[dp_rank] = Straggler(
                    dp_rank=dp_rank,
                    node=replica.node,
                    slowdown=iteration_s / reference_s,
                    since_s=replica.since_s,
                    iteration_s=iteration_s,
                )
        target_s = max((s.iteration_s for s in stragglers.values()), default=None)

        dp_ranks = frozenset(stragglers)
        changed = _plans_change(self._published, dp_ranks, target_s, self._tolerance)
        if changed:
            self._published = Published(dp_ranks=dp_ranks, target_s=target_s)
        return StragglerVerdict(
            stragglers=stragglers,
            target_s=target_s,
            baseline_s=baseline_s,
            degraded_nodes=degraded,
            changed=changed,
        )

    @property
    def reference_s(self) -> float | None:
        """The replicas' iteration time stragglers are measured against (the last baseline)."""
        return self._baseline_s

    @property
    def published_target_s(self) -> float | None:
        """``target_s`` of the last verdict that changed plans (None: no straggler)."""
        return self._published.target_s

    # -- persistence (:mod:`perseus_operator.jobs.straggler_state`) -----------------------------

    def _memory(self) -> DetectorMemory:
        return DetectorMemory(
            iterations=self._iterations,
            replicas=self._replicas,
            baseline_s=self._baseline_s,
            published=self._published,
        )

    def _resume(self, memory: DetectorMemory) -> StragglerDetector:
        self._iterations = memory.iterations
        self._replicas = memory.replicas
        self._baseline_s = memory.baseline_s
        self._published = memory.published
        return self

    def to_state(self) -> dict[str, Any]:
        """The detector's memory as a JSON-serializable dict (settings are not included)."""
        return to_state(self._memory())

    @classmethod
    def from_state(
        cls,
        settings: Stragglers,
        state: Mapping[str, Any],
        *,
        retarget_tolerance: float = 0.02,
    ) -> StragglerDetector:
        """A detector that resumes where the one that wrote ``state`` left off."""
        memory = memory_from_state(state, settings.persistence_reports)
        return cls(settings, retarget_tolerance=retarget_tolerance)._resume(memory)

    def state_to_save(self, saved: str | None) -> str | None:
        """:meth:`to_state` as JSON when it differs from ``saved`` in what decides verdicts
        (:func:`~perseus_operator.jobs.straggler_state.state_to_save`); None: keep ``saved``."""
        memory = self._memory()
        asked = (saved, decisive_key(memory))
        if asked == self._kept:
            return None
        to_save = state_to_save(memory, saved)
        self._kept = asked if to_save is None else None
        return to_save

    @classmethod
    def from_saved(cls, settings: Stragglers, saved: str) -> StragglerDetector | None:
        """The detector that :meth:`state_to_save` wrote ``saved`` for (None: unreadable)."""
        memory = memory_from_saved(saved, settings.persistence_reports)
        return None if memory is None else cls(settings)._resume(memory)
