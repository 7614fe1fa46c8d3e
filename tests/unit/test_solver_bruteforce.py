"""The frontier solver against exhaustive search on pipelines small enough to enumerate.

Every point the Phillips–Dessouky iteration emits must be a minimum-cost assignment of
integer durations among all assignments that finish within the point's iteration time.
Costs are the solver's own (fitted) cost tables, read through ``problem.cost_j``, so the
comparison checks the search, not the cost model.

Most cases give every (stage, instruction) four or five clocks, so the exponential model is a
real least-squares fit; 12-computation pipelines then have 4**12 assignments, enumerated in
chunks. One case uses two and three clocks, where the cost model falls back to a line or
interpolates exactly.
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
import pytest

from perseus_api.profile import Profile, parse_profile
from perseus_planner.dag import Schedule, build_pipeline_dag, topological_order
from perseus_planner.solver import FrontierProblem, build_problem, iterate_frontier

UNIT_S = 0.001
BLOCKING_W = 20.0
MAX_CHUNK = 1_100_000

Spec = dict[tuple[int, str], tuple[int, float, int]]

# (stage, instruction) -> (fastest time in ms, energy scale, number of clocks). Clock ``k`` runs
# ``fastest + k + 0.5`` ms, so every clock quantizes to its own whole millisecond, away from
# floor-rounding edges. Stages differ so that the faster ones have slack.
SPEC_2_STAGES: Spec = {
    (0, "forward"): (10, 1.0, 5),
    (0, "backward"): (20, 2.5, 4),
    (1, "forward"): (12, 1.6, 4),
    (1, "backward"): (22, 3.0, 5),
}
SPEC_2_STAGES_SMALL: Spec = {
    (0, "forward"): (10, 1.0, 4),
    (0, "backward"): (20, 2.5, 4),
    (1, "forward"): (12, 1.6, 4),
    (1, "backward"): (23, 3.0, 4),
}
SPEC_FEW_CLOCKS: Spec = {
    (0, "forward"): (10, 1.0, 2),
    (0, "backward"): (20, 2.5, 3),
    (1, "forward"): (12, 1.6, 3),
    (1, "backward"): (22, 3.0, 2),
}
SPEC_3_STAGES: Spec = {
    (0, "forward"): (10, 1.0, 4),
    (0, "backward"): (19, 2.2, 4),
    (1, "forward"): (13, 1.7, 4),
    (1, "backward"): (24, 3.1, 4),
    (2, "forward"): (11, 1.3, 4),
    (2, "backward"): (21, 2.6, 4),
}


def synthetic_profile(specs: Spec) -> Profile:
    """Convex energy, decreasing in time: ``E_k = 3 * scale + scale * 0.6**k`` at clock ``k``."""
    lines = ["stage,instruction,frequency,time,energy"]
    for (stage, instruction), (fastest_ms, scale, clocks) in specs.items():
        for k in range(clocks):
            time_s = (fastest_ms + k + 0.5) / 1000
            energy_j = 3.0 * scale + scale * 0.6**k
            lines.append(f"{stage},{instruction},{1410 - 105 * k},{time_s!r},{energy_j!r}")
    return parse_profile("\n".join(lines) + "\n", source="synthetic")


def _node_costs(problem: FrontierProblem) -> tuple[float, list[npt.NDArray[np.float64]]]:
    """``cost_j`` of all-fastest and, per node, the change of moving only that node to each
    of its durations (``cost_j`` is a sum over nodes)."""
    dmin = problem.fastest_durations
    dmax = problem.slowest_durations
    base = problem.cost_j(dmin)
    deltas = []
    for i in range(problem.dag.num_nodes):
        row = []
        for d in range(int(dmin[i]), int(dmax[i]) + 1):
            trial = dmin.copy()
            trial[i] = d
            row.append(problem.cost_j(trial) - base)
        deltas.append(np.asarray(row))
    return base, deltas


def best_cost_by_makespan(problem: FrontierProblem) -> tuple[int, npt.NDArray[np.float64]]:
    """Exhaustive search: ``(t_lo, best)`` with ``best[k]`` the least cost of any assignment
    whose makespan is at most ``t_lo + k`` units (``inf`` where none)."""
    n = problem.dag.num_nodes
    dmin = problem.fastest_durations
    dmax = problem.slowest_durations
    sizes = (dmax - dmin + 1).tolist()
    base, deltas = _node_costs(problem)
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, v in problem.dag.edges.tolist():
        preds[v].append(u)
    topo = topological_order(n, problem.dag.edges).tolist()

    # Enumerate the last nodes' durations as one vectorized block, the first ones in a loop.
    split = n
    while split > 0 and int(np.prod(sizes[split - 1 :])) <= MAX_CHUNK:
        split -= 1
    inner_grids = np.meshgrid(
        *[np.arange(int(dmin[i]), int(dmax[i]) + 1) for i in range(split, n)], indexing="ij"
    )
    inner = [g.reshape(-1).astype(np.int32) for g in inner_grids]
    size = len(inner[0])
    inner_cost = np.full(size, base)
    for i in range(split, n):
        inner_cost += deltas[i][inner[i - split] - dmin[i]]
    sinks = sorted(set(range(n)) - {u for u, _ in problem.dag.edges.tolist()})
    t_lo = problem.makespan(dmin)
    t_hi = problem.makespan(dmax)
    best = np.full(t_hi - t_lo + 1, np.inf)
    rng = np.random.default_rng(0)
    outer_ranges = [range(int(dmin[i]), int(dmax[i]) + 1) for i in range(split)]
    for outer in itertools.product(*outer_ranges):
        columns = [np.full(size, d, dtype=np.int32) for d in outer] + inner
        cost = inner_cost + sum(float(deltas[i][d - dmin[i]]) for i, d in enumerate(outer))
        finish: list[npt.NDArray[np.int32]] = [columns[0]] * n
        for v in topo:
            if not preds[v]:
                finish[v] = columns[v]
                continue
            start = finish[preds[v][0]].copy()
            for u in preds[v][1:]:
                np.maximum(start, finish[u], out=start)
            finish[v] = start + columns[v]
        makespan = finish[sinks[0]].copy()
        for v in sinks[1:]:
            np.maximum(makespan, finish[v], out=makespan)
        for t in np.unique(makespan).tolist():
            best[t - t_lo] = min(best[t - t_lo], float(cost[makespan == t].min()))
        # Cross-check the vectorized evaluation against the problem's own on a sample.
        for row in rng.choice(size, size=4, replace=False).tolist():
            durations = np.array([c[row] for c in columns], dtype=np.int64)
            assert problem.makespan(durations) == makespan[row]
            assert problem.cost_j(durations) == pytest.approx(cost[row], abs=1e-9)
    return t_lo, np.minimum.accumulate(best)


CASES = [
    pytest.param(Schedule.ONE_F_ONE_B, 2, 2, SPEC_2_STAGES, id="1f1b-S2-M2"),
    pytest.param(Schedule.ONE_F_ONE_B, 2, 3, SPEC_2_STAGES_SMALL, id="1f1b-S2-M3"),
    pytest.param(Schedule.ONE_F_ONE_B, 3, 2, SPEC_3_STAGES, id="1f1b-S3-M2"),
    pytest.param(Schedule.ONE_F_ONE_B, 2, 3, SPEC_FEW_CLOCKS, id="1f1b-S2-M3-few-clocks"),
    pytest.param(Schedule.GPIPE, 2, 2, SPEC_2_STAGES, id="gpipe-S2-M2"),
    pytest.param(Schedule.GPIPE, 2, 3, SPEC_2_STAGES_SMALL, id="gpipe-S2-M3"),
    pytest.param(Schedule.GPIPE, 3, 2, SPEC_3_STAGES, id="gpipe-S3-M2"),
]


@pytest.mark.parametrize(("schedule", "stages", "microbatches", "specs"), CASES)
def test_every_frontier_point_is_optimal(
    schedule: Schedule, stages: int, microbatches: int, specs: Spec
) -> None:
    problem = build_problem(
        synthetic_profile(specs),
        build_pipeline_dag(schedule, stages, microbatches),
        UNIT_S,
        BLOCKING_W,
    )
    n = problem.dag.num_nodes
    t_lo, best = best_cost_by_makespan(problem)

    points = list(iterate_frontier(problem))
    t_max = problem.makespan(problem.slowest_durations)
    t_min = problem.makespan(problem.fastest_durations)
    assert t_max > t_min + 2, "the synthetic problem should have room for several steps"
    assert [p.quant_time for p in points] == list(range(t_max, t_max - len(points), -1))
    assert points[0].quant_durations.tolist() == problem.slowest_durations.tolist()

    for point in points:
        durations = point.quant_durations
        assert np.all(durations >= problem.fastest_durations)
        assert np.all(durations <= problem.slowest_durations)
        assert problem.makespan(durations) == point.quant_time
        assert point.cost_j == pytest.approx(problem.cost_j(durations), abs=1e-9)
        optimum = float(best[point.quant_time - t_lo])
        assert point.cost_j == pytest.approx(optimum, abs=1e-6 * n), (
            f"point at {point.quant_time} units costs {point.cost_j} J, optimum {optimum} J"
        )

    assert points[-1].quant_time == t_min


@pytest.mark.parametrize(
    "specs",
    [SPEC_2_STAGES, SPEC_2_STAGES_SMALL, SPEC_3_STAGES, SPEC_FEW_CLOCKS],
    ids=["S2", "S2-small", "S3", "few-clocks"],
)
def test_synthetic_profiles_keep_one_option_per_clock(specs: Spec) -> None:
    # Guards the test design: the enumeration above covers one duration per profiled clock.
    num_stages = 1 + max(stage for stage, _ in specs)
    problem = build_problem(
        synthetic_profile(specs), build_pipeline_dag("1f1b", num_stages, 2), UNIT_S, BLOCKING_W
    )
    for (stage, instruction), (fastest_ms, _, clocks) in specs.items():
        options = problem.models[(stage, instruction)].options
        expected = list(range(fastest_ms + clocks - 1, fastest_ms - 1, -1))
        assert options.quant_times.tolist() == expected
        assert options.frequencies_mhz.tolist() == [1410 - 105 * k for k in reversed(range(clocks))]
