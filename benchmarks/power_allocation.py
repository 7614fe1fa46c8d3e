"""Power-budget allocation at scale: 1,000 jobs x 1,000 frontier points (issue 35).

Times :func:`perseus_planner.power.allocate` (exact within its default tolerance: 1e-9 mean
slowdown; "gap to bound" is how far above the linear relaxation's bound the choice is) against,
in the same run:

* the textbook greedy for the multiple-choice knapsack (every job's hull segments sorted by
  watts saved per unit of slowdown, taken while they fit: one ``argsort`` of all the segments).
  It is fast and not exact; its weighted slowdown is shown beside ours;
* ``numpy.sort`` of as many floats as there are points, an anchor for the machine's speed
  (the machine this runs on is shared, so ratios travel better than milliseconds).

Frontiers: a family shaped like the bundled ones (convex, power falling as the iteration slows:
``P(T) = P_min + (P_max - P_min) (1 - x)^k``, ``x`` the fraction of the way from ``T_min`` to
``T_max``), with random sizes (1-30 kW), spans (20-60 % of ``T_min``), exponents and weights
(1-3); one job in ten behind a straggler. Budgets at 20, 50 and 90 % of the way from every
job's least draw to its most.

Run from the repository root::

    python benchmarks/power_allocation.py            # 1,000 x 1,000
    python benchmarks/power_allocation.py --quick    # 200 x 200 (CI): checks, no timing goal

Exit status 1 when a choice exceeds the budget, when ours is worse than the greedy, or when
the reported bound is above the choice; timing is reported, not enforced (the target is
100 ms on an unloaded machine).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from perseus_planner.power import JobPoints, _mckp, allocate

T = TypeVar("T")
TARGET_MS = 100.0
ROUNDS = 5


def make_jobs(num_jobs: int, num_points: int, seed: int) -> list[JobPoints]:
    rng = np.random.default_rng(seed)
    jobs = []
    for j in range(num_jobs):
        t_min = rng.uniform(1.0, 10.0)
        span = rng.uniform(0.2, 0.6)
        times = np.linspace(t_min, t_min * (1 + span), num_points)
        x = np.clip((times - t_min) / (t_min * span), 0.0, 1.0)
        most_w = rng.uniform(1000.0, 30000.0)
        least_w = most_w * rng.uniform(0.5, 0.75)
        powers = least_w + (most_w - least_w) * (1 - x) ** rng.uniform(1.5, 3.0)
        floor_s = t_min * rng.uniform(1.0, 1.3) if rng.random() < 0.1 else None
        jobs.append(JobPoints(f"job-{j}", times, powers, float(rng.integers(1, 4)), floor_s))
    return jobs


def greedy(jobs: list[JobPoints], budget_w: float) -> float:
    """The sort-based greedy's weighted slowdown (every segment it takes fits; no refinement)."""
    sizes = np.array([len(job.times_s) for job in jobs])
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    power = np.concatenate([job.powers_w for job in jobs])
    effective = [np.maximum(job.times_s, job.floor_s or 0.0) for job in jobs]
    cost = np.concatenate(
        [job.weight * (t / job.t_min_s - 1) for job, t in zip(jobs, effective, strict=True)]
    )
    _, par_idx, hull_ptr, hull_pos = _mckp.pareto_hulls(ptr, power, cost)
    hp, hc = power[par_idx][hull_pos], cost[par_idx][hull_pos]
    first = hull_ptr[:-1]
    segment = np.ones(len(hp), dtype=bool)
    segment[hull_ptr[1:] - 1] = False  # a job's last hull point starts no segment
    starts = np.flatnonzero(segment)
    dp = hp[starts + 1] - hp[starts]
    rate = (hc[starts] - hc[starts + 1]) / dp
    order = np.argsort(-rate, kind="stable")
    room = budget_w - float(hp[first].sum())
    taken = starts[order][: int(np.searchsorted(np.cumsum(dp[order]), room, side="right"))]
    saved = float((hc[taken] - hc[taken + 1]).sum())
    return float(hc[first].sum()) - saved


def _median_ms(fn: Callable[[], T]) -> tuple[float, float, T]:
    """Median wall and process CPU milliseconds (CPU time: less disturbed on a shared machine)."""
    wall, cpu = [], []
    for _ in range(ROUNDS):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(1000 * (time.perf_counter() - start))
        cpu.append(1000 * (time.process_time() - start_cpu))
    return statistics.median(wall), statistics.median(cpu), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 jobs x 200 points (CI)")
    args = parser.parse_args()
    num_jobs, num_points = (200, 200) if args.quick else (1000, 1000)
    warm = make_jobs(8, 50, 1)
    allocate(warm, sum(float(j.powers_w.min()) for j in warm) * 1.02)  # load the kernels
    greedy(warm, sum(float(j.powers_w.min()) for j in warm) * 1.02)
    jobs = make_jobs(num_jobs, num_points, 0)
    least = sum(float(j.powers_w.min()) for j in jobs)
    most = sum(float(j.powers_w.max()) for j in jobs)
    anchor = np.random.default_rng(2).random(num_jobs * num_points)
    print(f"{num_jobs} jobs x {num_points} points; medians of {ROUNDS} rounds")
    print(
        f"{'budget':>8} {'ours ms':>9} {'CPU ms':>7} {'greedy ms':>10} {'sort ms':>8} "
        f"{'ours/sort':>10} "
        f"{'ours/greedy':>12} {'ours obj':>11} {'greedy obj':>11} {'gap to bound':>13}"
    )
    failed = False
    for fraction in (0.2, 0.5, 0.9):
        budget_w = least + fraction * (most - least)
        ours_ms, ours_cpu_ms, a = _median_ms(functools.partial(allocate, jobs, budget_w))
        greedy_ms, _, greedy_obj = _median_ms(functools.partial(greedy, jobs, budget_w))
        sort_ms, _, _ = _median_ms(lambda: np.sort(anchor))
        gap = a.objective - a.lower_bound
        print(
            f"{fraction:>8.0%} {ours_ms:>9.1f} {ours_cpu_ms:>7.1f} {greedy_ms:>10.1f} "
            f"{sort_ms:>8.1f} "
            f"{ours_ms / sort_ms:>10.1f} {ours_ms / greedy_ms:>12.2f} "
            f"{a.objective:>11.6f} {greedy_obj:>11.6f} {gap:>13.3g}"
        )
        if a.allocated_w > budget_w * (1 + 1e-12):
            print("  FAIL: over the budget")
            failed = True
        if a.objective > greedy_obj + 1e-9 or gap < -1e-9:
            print("  FAIL: worse than the greedy, or the bound above the choice")
            failed = True
    print(f"target: {TARGET_MS:.0f} ms for 1,000 x 1,000 on an unloaded machine (reported only)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
