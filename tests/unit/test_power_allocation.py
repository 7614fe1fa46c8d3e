"""The power-budget allocation against exhaustive search, and its edge cases.

Random instances small enough to enumerate every choice (at most 6**4 per instance): integer
watts and times, which make ties and equal-power points common, and random floats; with
weights, straggler floors and budgets from infeasible to roomy. The allocation runs with a
tolerance of 0 (the exact optimum), and also with its default, on larger smooth frontiers where
the exact search (tolerance 0) checks it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from perseus_planner.power import JobPoints, PowerBudgetError, allocate


def _brute_force(jobs: list[JobPoints], budget_w: float) -> float | None:
    best: float | None = None
    costs = [job.weight * job.slowdowns() for job in jobs]
    for combo in itertools.product(*(range(len(job.times_s)) for job in jobs)):
        watts = sum(float(job.powers_w[i]) for job, i in zip(jobs, combo, strict=True))
        if watts > budget_w + 1e-9:
            continue
        cost = sum(float(c[i]) for c, i in zip(costs, combo, strict=True))
        best = cost if best is None else min(best, cost)
    return best


def _random_jobs(rng: np.random.Generator) -> list[JobPoints]:
    jobs = []
    integral = rng.random() < 0.5
    for k in range(int(rng.integers(1, 5))):
        n = int(rng.integers(1, 7))
        if integral:
            times = rng.integers(1, 6, n).astype(float)
            powers = rng.integers(0, 10, n).astype(float)
        else:
            times, powers = rng.uniform(1, 2, n), rng.uniform(0, 10, n)
        floor_s = float(rng.uniform(1, 3)) if rng.random() < 0.3 else None
        jobs.append(JobPoints(f"j{k}", times, powers, float(rng.integers(1, 4)), floor_s))
    return jobs


@pytest.mark.parametrize("seed", range(6))
def test_exact_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    checked = infeasible = 0
    for _ in range(400):
        jobs = _random_jobs(rng)
        budget_w = float(rng.integers(0, 30)) if rng.random() < 0.5 else float(rng.uniform(0, 30))
        result = allocate(jobs, budget_w, optimality_tolerance=0.0)
        best = _brute_force(jobs, budget_w)
        if best is None:
            infeasible += 1
            least_w = sum(float(job.powers_w.min()) for job in jobs)
            assert not result.feasible
            assert result.missing_w == pytest.approx(least_w - budget_w)
            assert [s.power_w for s in result.shares] == [float(j.powers_w.min()) for j in jobs]
            continue
        checked += 1
        assert result.feasible
        assert result.allocated_w <= budget_w + 1e-9
        assert result.objective == pytest.approx(best, abs=1e-9)
        assert result.lower_bound <= result.objective + 1e-9
        # The shares say what was chosen, consistently with the job's own points.
        for job, share in zip(jobs, result.shares, strict=True):
            assert share.power_w == job.powers_w[share.index]
            assert share.slowdown == pytest.approx(job.slowdowns()[share.index])
    assert checked > 200 and infeasible > 10  # both kinds of instance were drawn


def _smooth_jobs(rng: np.random.Generator, num_jobs: int, num_points: int) -> list[JobPoints]:
    jobs = []
    for j in range(num_jobs):
        t_min = rng.uniform(1, 10)
        times = np.linspace(t_min, t_min * rng.uniform(1.2, 1.6), num_points)
        x = (times - t_min) / (times[-1] - t_min)
        most_w = rng.uniform(1000, 30000)
        least_w = most_w * rng.uniform(0.5, 0.75)
        powers = least_w + (most_w - least_w) * (1 - x) ** rng.uniform(1.5, 3)
        jobs.append(JobPoints(f"j{j}", times, powers, float(rng.integers(1, 4))))
    return jobs


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.95])
def test_smooth_frontiers_certified_by_the_bound(fraction: float) -> None:
    """Many jobs with dense convex frontiers (the hard case: thousands of near-ties): the
    default tolerance keeps the choice within 1e-9 mean slowdown of the exact optimum."""
    rng = np.random.default_rng(7)
    jobs = _smooth_jobs(rng, 60, 80)
    least = sum(float(j.powers_w.min()) for j in jobs)
    most = sum(float(j.powers_w.max()) for j in jobs)
    budget_w = least + fraction * (most - least)
    result = allocate(jobs, budget_w)
    assert result.feasible and result.allocated_w <= budget_w
    assert result.lower_bound <= result.objective
    exact = allocate(jobs, budget_w, optimality_tolerance=0.0)
    assert exact.objective <= result.objective + 1e-12
    assert result.objective - exact.objective <= 1e-9 * sum(j.weight for j in jobs)


def test_budget_above_every_t_min_slows_nothing() -> None:
    jobs = _smooth_jobs(np.random.default_rng(3), 5, 20)
    most = sum(float(j.powers_w.max()) for j in jobs)
    result = allocate(jobs, most + 1.0, unmanaged_w=1.0)
    assert result.objective == 0.0 and result.feasible
    assert all(s.slowdown == 0.0 for s in result.shares)
    assert result.headroom_w == pytest.approx(0.0, abs=1e-6)


def test_unmanaged_watts_count_against_the_budget() -> None:
    job = JobPoints("a", np.array([1.0, 1.5, 2.0]), np.array([300.0, 200.0, 150.0]))
    assert allocate([job], 300.0).shares[0].index == 0
    assert allocate([job], 300.0, unmanaged_w=100.0).shares[0].index == 1
    short = allocate([job], 300.0, unmanaged_w=200.0)
    assert not short.feasible and short.missing_w == pytest.approx(50.0)
    assert short.shares[0].index == 2  # the least it can draw: what to apply anyway
    assert short.headroom_w == pytest.approx(-50.0)


def test_straggler_floor_makes_its_faster_points_worthless() -> None:
    """Behind a straggler at T' = 1.5 the job gives up its faster points for free, so the
    other job keeps T_min under a budget that would otherwise slow one of them."""
    times = np.array([1.0, 1.25, 1.5, 2.0])
    powers = np.array([400.0, 320.0, 260.0, 200.0])
    straggled = JobPoints("straggled", times, powers, floor_s=1.5)
    healthy = JobPoints("healthy", times, powers)
    result = allocate([straggled, healthy], 660.0)
    assert [s.index for s in result.shares] == [2, 0]
    assert result.shares[0].slowdown == pytest.approx(0.5)  # T'/T_min - 1, not chargeable
    assert result.shares[1].slowdown == 0.0


def test_weights_decide_who_slows() -> None:
    times = np.array([1.0, 1.2])
    powers = np.array([500.0, 400.0])
    light = JobPoints("light", times, powers, weight=1.0)
    heavy = JobPoints("heavy", times, powers, weight=3.0)
    result = allocate([heavy, light], 900.0)
    assert [s.index for s in result.shares] == [0, 1]


def test_no_jobs_and_bad_input() -> None:
    assert allocate([], 100.0, unmanaged_w=30.0).feasible
    assert allocate([], 100.0, unmanaged_w=130.0).missing_w == pytest.approx(30.0)
    with pytest.raises(PowerBudgetError, match="budget"):
        allocate([], float("nan"))
    with pytest.raises(PowerBudgetError, match="weight"):
        JobPoints("a", np.array([1.0]), np.array([1.0]), weight=0.0)
    with pytest.raises(PowerBudgetError, match="one power per iteration time"):
        JobPoints("a", np.array([1.0, 2.0]), np.array([1.0]))
    with pytest.raises(PowerBudgetError, match="powers"):
        JobPoints("a", np.array([1.0]), np.array([-1.0]))
