"""Straggler detection from agents that write only what changed (a dead-band on the mean
iteration time and a heartbeat: perseus_agent.kube.report_cadence): the same verdicts, in the
same rounds, as from agents that write every report."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from perseus_agent.kube.report_cadence import ReportCadence, write_due
from perseus_api.job import Stragglers
from perseus_operator.jobs.straggler_samples import RankSample
from perseus_operator.jobs.stragglers import StragglerDetector

PERIOD_S = 10.0
CADENCE = ReportCadence.every(PERIOD_S)  # heartbeat 30 s, dead-band 1 %
SETTINGS = Stragglers()  # 1.05 / 1.02, 3 reports, stale after 60 s
DP, PP = 4, 4


def trace(seed: int, rounds: int, noise: float) -> np.ndarray:
    """times[round, dp, pp]: every rank at 1 s with ``noise``, replica 2 slowed 1.2x in rounds
    10-24, replica 1 slowed 1.1x ramping over rounds 30-34 (an agent's moving mean)."""
    rng = np.random.default_rng(seed)
    times = 1.0 + noise * rng.uniform(-1, 1, (rounds, DP, PP))
    times[10:25, 2, :] *= 1.2
    for k, r in enumerate(range(30, rounds)):
        times[r, 1, :] *= 1.0 + 0.1 * min(1.0, (k + 1) / 5)
    return times


def status(
    times: np.ndarray, r: int, d: int, iterations: int, at_s: float, cadence: ReportCadence
) -> dict[str, Any]:
    """The status of node ``d`` (all ranks of replica ``d``) at round ``r``."""
    return cadence.stamp(
        {
            "reportedAt": at_s,
            "observedRevision": 1,
            "ranks": [
                {"rank": d * PP + p, "iterations": iterations, "meanIterationSeconds": t}
                for p, t in enumerate(times[r, d])
            ],
        }
    )


def samples(stored: dict[int, dict[str, Any]], cadence: ReportCadence | None) -> list[RankSample]:
    return [
        RankSample(
            rank=rank["rank"],
            dp_rank=d,
            pp_rank=rank["rank"] % PP,
            node=f"node-{d}",
            iterations=rank["iterations"],
            mean_iteration_s=rank["meanIterationSeconds"],
            reported_at_s=doc["reportedAt"],
            report_interval_s=None if cadence is None else cadence.report_interval_s,
            heartbeat_s=None if cadence is None else cadence.heartbeat_s,
        )
        for d, doc in sorted(stored.items())
        for rank in doc["ranks"]
    ]


def run(
    times: np.ndarray, cadence: ReportCadence | None, *, silent_from: int | None = None
) -> tuple[list[tuple[int, ...]], list[bool], list[frozenset[str]], int]:
    """Per round (the operator looks 1 s after the agents report): the flagged replicas,
    whether plans change and the degraded nodes; and how many statuses were written. The
    agent of replica 3 stops writing at round ``silent_from``."""
    detector = StragglerDetector(SETTINGS)
    stored: dict[int, dict[str, Any]] = {}
    written_at: dict[int, float] = {}
    writes = 0
    flagged, changed, degraded = [], [], []
    for r in range(times.shape[0]):
        now_s = PERIOD_S * r
        for d in range(DP):
            if silent_from is not None and d == 3 and r >= silent_from:
                continue
            doc = status(times, r, d, 100 + 10 * r, now_s, cadence or CADENCE)
            if cadence is not None:
                since_s = now_s - written_at[d] if d in written_at else float("inf")
                due = write_due(stored.get(d), doc, since_written_s=since_s, cadence=cadence)
                if due is None:
                    continue
            stored[d], written_at[d] = doc, now_s
            writes += 1
        verdict = detector.observe(samples(stored, cadence), now_s=now_s + 1.0)
        flagged.append(tuple(sorted(verdict.stragglers)))
        changed.append(verdict.changed)
        degraded.append(verdict.degraded_nodes)
    return flagged, changed, degraded, writes


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_dead_band_changes_no_verdict_and_saves_most_writes(seed: int) -> None:
    times = trace(seed, rounds=60, noise=0.004)
    every = run(times, None)
    banded = run(times, CADENCE)
    assert banded[:3] == every[:3]
    assert {2} <= {dp for round_ in every[0] for dp in round_}  # the trace has stragglers
    assert {1} <= {dp for round_ in every[0] for dp in round_}
    assert banded[3] < every[3] / 2  # 240 writes every report; ~90 with the dead-band


def test_a_silent_agent_is_stale_when_twice_its_heartbeat_passed() -> None:
    """staleAfterSeconds 60 = twice the 30 s heartbeat: a dead agent is seen as late as an
    agent writing every report would be, and a live but quiet one never."""
    times = trace(1, rounds=30, noise=0.0)
    *_, quiet = run(times, CADENCE)
    _, _, degraded, _ = run(times, CADENCE, silent_from=10)
    _, _, degraded_every, _ = run(times, None, silent_from=10)
    assert quiet
    first = next(r for r, nodes in enumerate(degraded) if "node-3" in nodes)
    first_every = next(r for r, nodes in enumerate(degraded_every) if "node-3" in nodes)
    # The last write before round 10 was up to a heartbeat earlier.
    assert first_every - 3 <= first <= first_every
    assert all(not nodes for nodes in run(times, CADENCE)[2])


def sample(**overrides: Any) -> RankSample:
    fields: dict[str, Any] = {
        "rank": 0,
        "dp_rank": 0,
        "pp_rank": 0,
        "node": "n0",
        "iterations": 10,
        "mean_iteration_s": 1.0,
        "reported_at_s": 100.0,
    }
    return RankSample(**{**fields, **overrides})


def test_a_quiet_report_stands_for_one_report_per_interval() -> None:
    quiet = sample(report_interval_s=10.0, heartbeat_s=30.0)
    assert [quiet.evidence_s(now) for now in (99.0, 100.0, 109.9, 110.0, 125.0)] == [
        100.0,
        100.0,
        100.0,
        110.0,
        120.0,
    ]
    assert sample().evidence_s(125.0) == 100.0  # an agent writing every report


def test_staleness_follows_the_heartbeat_when_it_is_longer() -> None:
    quiet = sample(report_interval_s=10.0, heartbeat_s=30.0)
    assert quiet.stale_after_s(20.0) == 60.0
    assert not quiet.stale(159.0, 20.0) and quiet.stale(161.0, 20.0)
    assert quiet.stale_after_s(120.0) == 120.0
    assert sample().stale(121.0, 20.0)


@pytest.mark.parametrize("field", ["report_interval_s", "heartbeat_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_cadence_is_rejected(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        sample(**{field: value})
