"""Frontiers solved in worker processes, within a time limit, and shared between jobs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from perseus_api.job import ScheduleName
from perseus_operator.jobs.planner_pool import CachingPlanner, InlinePlanner, PoolPlanner
from perseus_operator.jobs.planning import PlanningError, PlanningInput
from perseus_planner import DEFAULT_PROFILE, Frontier, bundled_profile


def request(stages: int = 2, microbatches: int = 4) -> PlanningInput:
    lines = bundled_profile(DEFAULT_PROFILE).path.read_text().strip().splitlines()
    column = lines[0].split(",").index("stage")
    kept = [x for x in lines[1:] if int(x.split(",")[column]) < stages]
    return PlanningInput(
        profile_csv="\n".join([lines[0], *kept]) + "\n",
        profile_source="test",
        schedule=ScheduleName.ONE_F_ONE_B,
        num_stages=stages,
        num_microbatches=microbatches,
        blocking_power_w=83.64,
    )


def test_a_worker_process_solves_the_same_frontier_as_the_caller() -> None:
    seen: list[float] = []
    planner = PoolPlanner(workers=1, timeout_s=120, observe_s=seen.append)
    try:
        remote = asyncio.run(planner.solve(request()))
    finally:
        planner.close()
    local = asyncio.run(InlinePlanner().solve(request()))
    assert np.array_equal(remote.times_s, local.times_s)
    assert np.array_equal(remote.energies_j, local.energies_j)
    assert len(seen) == 1 and seen[0] > 0


def test_a_solve_past_the_time_limit_fails_clearly_and_the_next_one_works() -> None:
    planner = PoolPlanner(workers=1, timeout_s=0.01)
    try:
        with pytest.raises(PlanningError, match=r"did not finish within 0\.01 s"):
            asyncio.run(planner.solve(request(stages=4, microbatches=8)))
        planner._timeout_s = 120  # a fresh pool replaces the killed one
        assert len(asyncio.run(planner.solve(request()))) > 1
    finally:
        planner.close()


class CountingPlanner(InlinePlanner):
    def __init__(self) -> None:
        self.calls = 0

    async def solve(self, request: PlanningInput) -> Frontier:
        self.calls += 1
        await asyncio.sleep(0.01)  # let the other callers arrive while this one solves
        return await super().solve(request)


def test_jobs_with_the_same_inputs_share_one_solve() -> None:
    inner = CountingPlanner()
    planner = CachingPlanner(inner, size=1)

    async def run() -> list[Frontier]:
        same = [planner.solve(request()) for _ in range(3)]
        return list(await asyncio.gather(*same))

    first, second, third = asyncio.run(run())
    assert inner.calls == 1 and first is second is third
    asyncio.run(planner.solve(request(microbatches=5)))  # evicts the first (size 1)
    asyncio.run(planner.solve(request()))
    assert inner.calls == 3


def test_a_failed_solve_is_not_cached() -> None:
    inner = CountingPlanner()
    planner = CachingPlanner(inner)
    bad = PlanningInput(**{**request().__dict__, "num_stages": 3})
    for _ in range(2):
        with pytest.raises(PlanningError):
            asyncio.run(planner.solve(bad))
    assert inner.calls == 2
