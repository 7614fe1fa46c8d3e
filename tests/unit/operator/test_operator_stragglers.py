"""Straggler detection on synthetic, seeded report traces.

A trace is an array ``times[round, dp_rank, pp_rank]`` of the ranks' mean iteration times in
seconds; by default every rank is past warm-up and reports fresh telemetry every round.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from perseus_api.job import Stragglers
from perseus_operator.jobs.stragglers import (
    RankSample,
    StragglerDetector,
    StragglerVerdict,
)

PERIOD_S = 10.0  # between report rounds
ITERATIONS_PER_ROUND = 10
SETTINGS = Stragglers()  # 1.05 / 1.02, 3 reports, 5 warm-up iterations, stale after 60 s
PERSISTENCE = SETTINGS.persistence_reports


def node_of(dp_rank: int, pp_rank: int) -> str:
    """Four GPUs per node: a replica of 8 stages spans two nodes."""
    return f"node-{dp_rank}-{pp_rank // 4}"


def noisy_times(
    seed: int, rounds: int, dp: int = 4, pp: int = 8, noise: float = 0.01
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 1.0 * (1.0 + noise * rng.standard_normal((rounds, dp, pp)))


def flat_times(rounds: int, dp: int = 4, pp: int = 8) -> np.ndarray:
    return np.ones((rounds, dp, pp))


def default_iterations(times: np.ndarray) -> np.ndarray:
    rounds = times.shape[0]
    per_round = 100 + ITERATIONS_PER_ROUND * np.arange(rounds)
    return np.broadcast_to(per_round[:, None, None], times.shape).copy()


def default_reported(times: np.ndarray) -> np.ndarray:
    rounds = times.shape[0]
    per_round = PERIOD_S * np.arange(rounds, dtype=float)
    return np.broadcast_to(per_round[:, None, None], times.shape).copy()


def round_samples(
    times: np.ndarray, iterations: np.ndarray, reported_s: np.ndarray, r: int
) -> list[RankSample]:
    _, dp, pp = times.shape
    return [
        RankSample(
            rank=d * pp + p,
            dp_rank=d,
            pp_rank=p,
            node=node_of(d, p),
            iterations=int(iterations[r, d, p]),
            mean_iteration_s=float(times[r, d, p]),
            reported_at_s=float(reported_s[r, d, p]),
        )
        for d in range(dp)
        for p in range(pp)
    ]


def run(
    times: np.ndarray,
    *,
    iterations: np.ndarray | None = None,
    reported_s: np.ndarray | None = None,
    detector: StragglerDetector | None = None,
    first_round: int = 0,
) -> list[StragglerVerdict]:
    """Verdicts of rounds ``first_round..`` (earlier rounds are not fed)."""
    iterations = default_iterations(times) if iterations is None else iterations
    reported_s = default_reported(times) if reported_s is None else reported_s
    detector = StragglerDetector(SETTINGS) if detector is None else detector
    return [
        detector.observe(round_samples(times, iterations, reported_s, r), now_s=PERIOD_S * r)
        for r in range(first_round, times.shape[0])
    ]


def flagged_rounds(verdicts: list[StragglerVerdict], dp_rank: int) -> list[int]:
    return [r for r, v in enumerate(verdicts) if dp_rank in v.stragglers]


def episode_trace(seed: int = 7) -> np.ndarray:
    """Replica 2's stage 5 runs 1.2x slower from round 20 to round 60 (exclusive)."""
    times = noisy_times(seed, rounds=90)
    times[20:60, 2, 5] *= 1.2
    return times


# -- detection, recovery, noise ----------------------------------------------------------------


def test_detects_after_persistence_and_recovers_after_persistence() -> None:
    verdicts = run(episode_trace())

    assert flagged_rounds(verdicts, 2) == list(range(20 + PERSISTENCE - 1, 60 + PERSISTENCE - 1))
    assert all(set(v.stragglers) <= {2} for v in verdicts)
    for v in verdicts[22:62]:
        assert v.target_s == pytest.approx(1.2, rel=0.02)
        assert v.baseline_s == pytest.approx(1.0, rel=0.03)
        straggler = v.stragglers[2]
        assert straggler.node == "node-2-1"
        assert straggler.since_s == PERIOD_S * 22
        assert v.baseline_s is not None
        assert straggler.slowdown == pytest.approx(straggler.iteration_s / v.baseline_s)
    # Recovering rounds (60, 61) do not drag T' down: plans change only on entry and exit.
    assert [r for r, v in enumerate(verdicts) if v.changed] == [22, 62]
    assert verdicts[62].target_s is None
    assert all(v.degraded_nodes == frozenset() for v in verdicts)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_no_false_positives_on_noise(seed: int) -> None:
    verdicts = run(noisy_times(seed, rounds=1000))

    assert not any(v.stragglers or v.changed for v in verdicts)
    assert all(v.baseline_s is not None for v in verdicts)


def test_checkpoint_spikes_never_trigger() -> None:
    times = noisy_times(11, rounds=80)
    times[10, 1, :] *= 3.0  # one replica saves a checkpoint
    times[30 : 30 + PERSISTENCE - 1, 3, 0] *= 3.0  # one rank, just short of persistence
    times[50, :, :] *= 3.0  # every replica saves at once

    verdicts = run(times)

    assert not any(v.stragglers or v.changed for v in verdicts)


# -- hysteresis --------------------------------------------------------------------------------


def test_oscillation_below_slowdown_threshold_does_not_flag() -> None:
    times = flat_times(200)
    times[:, 1, 3] = 1.04 + 0.008 * np.sin(np.arange(200))  # around 1.04, under 1.05
    times[100:, 1, 3] = np.tile([1.06, 1.06, 1.03], 34)[:100]  # never 3 slow in a row

    verdicts = run(times)

    assert not any(v.stragglers or v.changed for v in verdicts)


def test_straggler_in_hysteresis_band_stays_flagged() -> None:
    times = flat_times(120)
    times[:10, 1, 3] = 1.2
    times[10:60, 1, 3] = 1.04 + 0.008 * np.sin(np.arange(50))  # between 1.02 and 1.05
    times[60:99, 1, 3] = np.tile([1.01, 1.01, 1.03], 13)  # never 3 fast in a row
    times[99:, 1, 3] = 1.0

    verdicts = run(times)

    assert flagged_rounds(verdicts, 1) == list(range(PERSISTENCE - 1, 99 + PERSISTENCE - 1))
    # Still a straggler, only a milder one: the target follows it down (10..12), then holds.
    assert [r for r, v in enumerate(verdicts) if v.changed] == [2, 10, 11, 12, 101]
    assert verdicts[59].target_s == pytest.approx(1.04, abs=0.01)
    assert verdicts[98].target_s == pytest.approx(1.03)  # its fast rounds are not a target


def test_target_is_smoothed_and_retargets_only_beyond_tolerance() -> None:
    times = flat_times(40)
    times[:, 1, 3] = 1.2
    times[10:20, 1, 3] = 1.21  # within 2% of 1.2: plans stay
    times[20:, 1, 3] = 1.25  # a 4% step, seen through the mean of the last 3 rounds

    verdicts = run(times)

    assert [r for r, v in enumerate(verdicts) if v.changed] == [2, 21]
    assert verdicts[20].target_s == pytest.approx((1.21 + 1.21 + 1.25) / 3)
    assert verdicts[21].target_s == pytest.approx((1.21 + 1.25 + 1.25) / 3)
    assert verdicts[30].target_s == pytest.approx(1.25)


# -- warm-up and restarts ------------------------------------------------------------------------


def test_warmup_iterations_after_restart_are_ignored() -> None:
    times = noisy_times(3, rounds=60)
    iterations = default_iterations(times)
    times[30:33, 1, :] = 2.0  # slow while warming up for PERSISTENCE rounds
    iterations[30:, 1, :] = 1 + 2 * np.arange(30)[:, None]  # 1, 3, 5: warm-up; 7: counted

    verdicts = run(times, iterations=iterations)

    assert not any(v.stragglers or v.changed for v in verdicts)
    assert all(v.baseline_s == pytest.approx(1.0, rel=0.03) for v in verdicts)


@pytest.mark.parametrize(
    ("restarted_stages", "first_flagged"),
    [
        # The whole replica restarts: round 12 is warm-up, 13..15 count from zero.
        (slice(None), 15),
        # One rank restarts, the others keep measuring: 12..14 count from zero.
        (slice(0, 1), 14),
    ],
)
def test_restart_resets_persistence(restarted_stages: slice, first_flagged: int) -> None:
    times = flat_times(30)
    iterations = default_iterations(times)
    times[10:, 1, 3] = 1.2  # two slow rounds (10, 11) before the restart
    iterations[12:, 1, restarted_stages] = 1 + 10 * np.arange(18)[:, None]

    verdicts = run(times, iterations=iterations)

    assert flagged_rounds(verdicts, 1)[0] == first_flagged


# -- stale telemetry -----------------------------------------------------------------------------


def silent_node(
    times: np.ndarray, dp_rank: int, node_half: int, start: int, end: int
) -> tuple[np.ndarray, np.ndarray]:
    """Node ``node-<dp>-<half>`` sends nothing new in rounds ``start..end-1``."""
    iterations = default_iterations(times)
    reported_s = default_reported(times)
    stages = slice(4 * node_half, 4 * node_half + 4)
    for array in (times, iterations, reported_s):
        array[start:end, dp_rank, stages] = array[start - 1, dp_rank, stages]
    return iterations, reported_s


def test_stale_node_is_degraded_not_straggler() -> None:
    times = noisy_times(5, rounds=60)
    iterations, reported_s = silent_node(times, dp_rank=3, node_half=0, start=20, end=40)

    verdicts = run(times, iterations=iterations, reported_s=reported_s)

    # Last heard at round 19 (190 s): stale once more than 60 s old, from round 26.
    degraded = [r for r, v in enumerate(verdicts) if v.degraded_nodes]
    assert degraded == list(range(26, 40))
    assert all(verdicts[r].degraded_nodes == {"node-3-0"} for r in degraded)
    assert not any(v.stragglers or v.changed for v in verdicts)
    assert all(v.baseline_s == pytest.approx(1.0, rel=0.03) for v in verdicts)


def test_straggler_on_stale_node_is_dropped() -> None:
    times = noisy_times(6, rounds=40)
    times[5:, 2, 5] *= 1.2
    iterations, reported_s = silent_node(times, dp_rank=2, node_half=1, start=20, end=40)

    verdicts = run(times, iterations=iterations, reported_s=reported_s)

    assert flagged_rounds(verdicts, 2) == list(range(7, 26))
    assert verdicts[26].changed
    assert verdicts[26].target_s is None
    assert verdicts[26].degraded_nodes == {"node-2-1"}
    assert not any(v.changed for v in verdicts[27:])


# -- replica counts ------------------------------------------------------------------------------


def test_single_replica_job_never_has_a_straggler() -> None:
    times = noisy_times(8, rounds=50, dp=1)
    times[10:, 0, 4] *= 2.0

    verdicts = run(times)

    assert not any(v.stragglers or v.changed for v in verdicts)
    assert all(v.baseline_s is None for v in verdicts)


def test_two_stragglers_target_the_slowest() -> None:
    times = noisy_times(9, rounds=50, dp=6)
    times[10:, 1, 2] *= 1.15
    times[20:, 4, 6] *= 1.3

    verdicts = run(times)

    assert set(verdicts[15].stragglers) == {1}
    assert verdicts[15].target_s == pytest.approx(1.15, rel=0.02)
    later = verdicts[30]
    assert set(later.stragglers) == {1, 4}
    assert later.target_s == pytest.approx(1.3, rel=0.02)
    assert later.target_s == later.stragglers[4].iteration_s
    assert later.stragglers[1].slowdown == pytest.approx(1.15, rel=0.03)
    assert verdicts[22].changed


# -- persistence of the detector -----------------------------------------------------------------


@pytest.mark.parametrize("split", [21, 40, 61])
def test_state_round_trip_resumes_identically(split: int) -> None:
    times = episode_trace(seed=12)
    original = StragglerDetector(SETTINGS)
    run(times[:split], detector=original)

    state = json.loads(json.dumps(original.to_state()))
    resumed = StragglerDetector.from_state(SETTINGS, state)

    assert resumed.to_state() == original.to_state()
    expected = run(times, detector=original, first_round=split)
    assert run(times, detector=resumed, first_round=split) == expected


# -- bad inputs ----------------------------------------------------------------------------------


def sample(**overrides: object) -> RankSample:
    fields: dict[str, Any] = {
        "rank": 0,
        "dp_rank": 0,
        "pp_rank": 0,
        "node": "n0",
        "iterations": 10,
        "mean_iteration_s": 1.0,
        "reported_at_s": 0.0,
    }
    fields.update(overrides)
    return RankSample(**fields)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mean_iteration_s": -1.0}, "mean_iteration_s"),
        ({"mean_iteration_s": math.nan}, "mean_iteration_s"),
        ({"dp_rank": -1}, "dp_rank"),
        ({"iterations": -3}, "iterations"),
        ({"reported_at_s": math.inf}, "reported_at_s"),
        ({"node": ""}, "node"),
    ],
)
def test_bad_samples_raise(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample(**overrides)


def test_bad_rounds_and_settings_raise() -> None:
    detector = StragglerDetector(SETTINGS)
    with pytest.raises(ValueError, match="rank 0 reported twice"):
        detector.observe([sample(), sample(dp_rank=1)], now_s=0.0)
    with pytest.raises(ValueError, match="now_s"):
        detector.observe([sample()], now_s=math.nan)
    with pytest.raises(ValueError, match="retarget_tolerance"):
        StragglerDetector(SETTINGS, retarget_tolerance=-0.1)
    with pytest.raises(ValueError, match="version"):
        StragglerDetector.from_state(SETTINGS, {**detector.to_state(), "version": 99})
    with pytest.raises(ValueError, match="malformed"):
        StragglerDetector.from_state(SETTINGS, {"version": 1})


def test_looking_again_at_the_same_reports_is_no_new_evidence() -> None:
    """The operator reconciles more often than agents report: persistence counts reports."""
    times = flat_times(1)
    times[0, 2] *= 1.2
    samples = round_samples(times, default_iterations(times), default_reported(times), 0)
    detector = StragglerDetector(SETTINGS)
    for look in range(3 * PERSISTENCE):
        verdict = detector.observe(samples, now_s=1.0 + look)
        assert verdict.stragglers == {}  # one slow report, however often it is read
    state = detector.to_state()["replicas"]["2"]
    assert (state["slowStreak"], state["lastReportSeconds"]) == (1, 0.0)


def test_streaks_stop_at_the_persistence_needed() -> None:
    times = flat_times(5 * PERSISTENCE)
    detector = StragglerDetector(SETTINGS)
    iterations, reported = default_iterations(times), default_reported(times)
    for r in range(times.shape[0]):
        detector.observe(round_samples(times, iterations, reported, r), now_s=reported[r, 0, 0])
    streaks = {v["fastStreak"] for v in detector.to_state()["replicas"].values()}
    assert streaks == {PERSISTENCE}  # so a healthy job's saved state stops changing


@pytest.mark.parametrize("heard_from", [(), (2,), (0, 2)], ids=["none", "straggler", "two"])
def test_rounds_without_a_reference_leave_the_verdict_standing(heard_from: tuple[int, ...]) -> None:
    """Right after plans are rewritten no agent has a mean under the new revision yet: rounds
    that measure fewer than two replicas are no evidence, and replicas not heard from keep their
    state, so the straggler stays flagged and no plan changes; detection goes on afterwards."""
    times = episode_trace()
    detector = StragglerDetector(SETTINGS)
    verdicts = run(times[:30], detector=detector)
    assert 2 in verdicts[-1].stragglers
    iterations, reported = default_iterations(times), default_reported(times)
    for r in range(30, 40):
        samples = [
            s for s in round_samples(times, iterations, reported, r) if s.dp_rank in heard_from
        ]
        verdict = detector.observe(samples, now_s=PERIOD_S * r)
        assert set(verdict.stragglers) == {2} and not verdict.changed, r
        assert verdict.stragglers[2].slowdown == pytest.approx(1.2, rel=0.03)
    later = run(times, detector=detector, first_round=40)
    assert flagged_rounds(later, 2)[0] == 0 and not any(v.changed for v in later[:15])
