"""When the agent writes a node plan status: the dead-band, the heartbeat, and everything
that is not iteration telemetry written at once (perseus_agent.kube.report_cadence)."""

from __future__ import annotations

from typing import Any

import pytest

from perseus_agent.kube.report_cadence import ReportCadence, WriteReason, write_due

CADENCE = ReportCadence(report_interval_s=10.0, heartbeat_s=30.0, dead_band=0.01)


def rank(
    rank: int = 0, *, mean_s: float = 2.0, iterations: int = 100, revision: int = 1
) -> dict[str, Any]:
    return {
        "rank": rank,
        "dpRank": rank,
        "ppRank": 0,
        "iterations": iterations,
        "lastIterationSeconds": mean_s * 1.003,
        "meanIterationSeconds": mean_s,
        "revision": revision,
    }


def report(*ranks: dict[str, Any], at: str = "2026-12-05T00:00:00.000+00:00") -> dict[str, Any]:
    return CADENCE.stamp(
        {
            "observedRevision": 1,
            "reportedAt": at,
            "conditions": [{"type": "Applied", "status": "True", "reason": "Applied"}],
            "node": "n1",
            "job": "gpt3",
            "namespace": "ml",
            "revision": 1,
            "granularity": "Instruction",
            "gpus": [{"index": 0, "plan": "tmin", "stage": 0, "status": "Applied"}],
            "ranks": list(ranks) or [rank()],
            "profiling": [],
        }
    )


def due(written: dict[str, Any] | None, now: dict[str, Any], since_s: float = 10.0) -> Any:
    return write_due(written, now, since_written_s=since_s, cadence=CADENCE)


def test_the_first_report_is_written() -> None:
    assert due(None, report()) is WriteReason.FIRST


def test_a_report_within_the_dead_band_waits_for_the_heartbeat() -> None:
    written = report(rank(mean_s=2.0))
    later = report(rank(mean_s=2.019, iterations=150), at="2026-12-05T00:00:10.000+00:00")
    assert due(written, later, since_s=10.0) is None
    assert due(written, later, since_s=20.0) is None
    # Reports come every interval: one a hair before the heartbeat counts (no 4th interval).
    assert due(written, later, since_s=29.9) is WriteReason.HEARTBEAT
    assert due(written, later, since_s=31.0) is WriteReason.HEARTBEAT


@pytest.mark.parametrize("mean_s", [2.021, 1.979, 2.4, 1.0])
def test_a_mean_out_of_the_dead_band_is_written_at_once(mean_s: float) -> None:
    assert due(report(rank(mean_s=2.0)), report(rank(mean_s=mean_s)), 0.1) is WriteReason.TELEMETRY


def test_the_band_is_relative_to_the_value_written_not_the_last_report() -> None:
    """A slow drift is written once it adds up to more than the band."""
    written = report(rank(mean_s=2.0))
    means = [2.005, 2.01, 2.015, 2.019, 2.025]
    verdicts = [due(written, report(rank(mean_s=m)), 1.0) for m in means]
    assert verdicts == [None, None, None, None, WriteReason.TELEMETRY]


def test_one_rank_out_of_the_band_is_enough() -> None:
    written = report(rank(0, mean_s=2.0), rank(1, mean_s=3.0))
    now = report(rank(0, mean_s=2.001), rank(1, mean_s=3.5))
    assert due(written, now, 1.0) is WriteReason.TELEMETRY


def test_a_restart_or_a_doubled_count_is_written() -> None:
    written = report(rank(iterations=40))
    assert due(written, report(rank(iterations=79)), 1.0) is None
    assert due(written, report(rank(iterations=80)), 1.0) is WriteReason.TELEMETRY
    assert due(written, report(rank(iterations=3)), 1.0) is WriteReason.TELEMETRY
    # Warm-up ends soon after it does: 0 -> 1 -> 2 -> 4 ... are each written.
    assert due(report(rank(iterations=0)), report(rank(iterations=1)), 1.0) is not None


@pytest.mark.parametrize(
    "change",
    [
        {"observedRevision": 2, "revision": 2},
        {"conditions": [{"type": "Applied", "status": "False", "reason": "Failed"}]},
        {"gpus": []},
        {"profiling": [{"uuid": "GPU-0", "frequencyIndex": 3}]},
        {"ranks": [rank(), rank(1)]},  # a rank called in
        {"ranks": [rank(revision=2)]},  # the mean now covers another revision
        {"reportIntervalSeconds": 5.0},
    ],
)
def test_anything_but_telemetry_is_written_at_once(change: dict[str, Any]) -> None:
    written = report()
    assert due(written, {**report(), **change}, 0.0) is WriteReason.CHANGED


def test_a_status_that_is_no_report_is_written_once() -> None:
    stopped = {"observedRevision": 1, "conditions": [{"type": "Applied", "status": "False"}]}
    assert due(report(), stopped, 0.0) is WriteReason.CHANGED
    assert due(stopped, dict(stopped), 1000.0) is None  # no heartbeat: nothing to refresh
    assert CADENCE.stamp(stopped) == stopped


def test_older_spellings_of_the_telemetry_are_read_too() -> None:
    old = {"rank": 0, "iterations": 10, "mean_iteration_s": 2.0, "last_iteration_s": 2.0}
    assert due(report(old), report({**old, "mean_iteration_s": 2.01}), 1.0) is None
    assert due(report(old), report({**old, "mean_iteration_s": 2.1}), 1.0) is not None


def test_a_zero_band_writes_every_change() -> None:
    every = ReportCadence(10.0, 10.0, dead_band=0.0)
    written = report(rank(mean_s=2.0))
    assert write_due(written, report(rank(mean_s=2.0001)), since_written_s=1, cadence=every)
    assert write_due(written, report(rank(mean_s=2.0)), since_written_s=1, cadence=every) is None


def test_the_cadence_is_checked_and_said() -> None:
    assert ReportCadence.every(10.0) == ReportCadence(10.0, 30.0, 0.01)
    stamped = CADENCE.stamp({"reportedAt": "x"})
    assert stamped["reportIntervalSeconds"] == 10.0 and stamped["heartbeatSeconds"] == 30.0
    for bad in ((0.0, 10.0, 0.01), (10.0, 5.0, 0.01), (10.0, 30.0, 1.0), (10.0, 30.0, -0.1)):
        with pytest.raises(ValueError):
            ReportCadence(*bad)
