"""Intrinsic energy bloat removed at ``T_min`` (Perseus paper, SOSP 2024, Table 6).

Savings of the fastest frontier point against every GPU at its highest clock, compared at
the same iteration time (the baseline's GPUs wait at blocking power for the rest of it).
"""

from __future__ import annotations

import pytest

from conftest import SolveFrontier
from perseus_planner.frontier import max_frequency_baseline

TOLERANCE_PERCENTAGE_POINTS = 0.05

# (model, gpu) -> {microbatches: savings in percent}, as printed in Table 6.
TABLE_6: dict[tuple[str, str], dict[int, float]] = {
    ("gpt3-175b", "a100_sxm"): {12: 15.20, 24: 14.19, 48: 13.62, 96: 13.32},
    ("gpt3-175b", "a40"): {12: 11.81, 24: 10.22, 48: 9.34, 96: 8.88},
    ("bloom", "a100_sxm"): {12: 10.47, 24: 7.06, 48: 5.23, 96: 4.28},
    ("bloom", "a40"): {12: 6.97, 24: 4.49, 48: 3.12, 96: 2.41},
}


def _cases(microbatch_counts: tuple[int, ...]) -> list[object]:
    return [
        pytest.param(model, gpu, mb, row[mb], id=f"{model}-{gpu}-mb{mb}")
        for (model, gpu), row in TABLE_6.items()
        for mb in microbatch_counts
    ]


def intrinsic_savings_percent(
    solved_frontier: SolveFrontier, model: str, gpu: str, microbatches: int
) -> float:
    frontier = solved_frontier(model, gpu, microbatches)
    baseline = max_frequency_baseline(frontier.problem)
    # T_min is the frontier's last point, and the baseline runs no faster than it.
    assert frontier.t_min_index == len(frontier) - 1
    assert frontier.times_s[-1] <= baseline.time_s
    saving = baseline.savings_ratio(frontier.energies_j[-1], frontier.times_s[-1])
    return 100.0 * saving


@pytest.mark.parametrize(("model", "gpu", "microbatches", "percent"), _cases((12, 24)))
def test_table6_savings(
    solved_frontier: SolveFrontier, model: str, gpu: str, microbatches: int, percent: float
) -> None:
    saving = intrinsic_savings_percent(solved_frontier, model, gpu, microbatches)
    assert saving == pytest.approx(percent, abs=TOLERANCE_PERCENTAGE_POINTS)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "gpu", "microbatches", "percent"), _cases((48, 96)))
def test_table6_savings_many_microbatches(
    solved_frontier: SolveFrontier, model: str, gpu: str, microbatches: int, percent: float
) -> None:
    # The A40 cases have tens of thousands of frontier points (mb96: ~65,000), minutes each.
    saving = intrinsic_savings_percent(solved_frontier, model, gpu, microbatches)
    assert saving == pytest.approx(percent, abs=TOLERANCE_PERCENTAGE_POINTS)


def test_baseline_energy_accounts_for_blocking_power(solved_frontier: SolveFrontier) -> None:
    frontier = solved_frontier("gpt3-175b", "a100_sxm", 12)
    baseline = max_frequency_baseline(frontier.problem)
    assert baseline.num_stages == 8
    assert baseline.blocking_power_w == 83.64
    assert baseline.energy_j() == pytest.approx(
        baseline.busy_energy_j + 83.64 * (8 * baseline.time_s - baseline.busy_time_s), rel=1e-12
    )
    later = baseline.time_s + 1.0
    assert baseline.energy_j(later) - baseline.energy_j() == pytest.approx(8 * 83.64, rel=1e-9)
    assert baseline.savings_ratio(baseline.energy_j(later), later) == pytest.approx(0, abs=1e-15)
