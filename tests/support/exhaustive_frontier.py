"""The frontier solver's reference: exhaustive search over integer duration assignments, and the
synthetic profiles of pipelines small enough to enumerate (the brute-force solver tests)."""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
import pytest

from perseus_api.profile import Profile, parse_profile
from perseus_planner.dag import topological_order
from perseus_planner.solver import FrontierProblem, iterate_frontier

UNIT_S = 0.001
BLOCKING_W = 20.0
MAX_CHUNK = 1_100_000

# (stage, instruction) -> (fastest time in ms, energy scale, number of clocks). Clock ``k`` runs
# ``fastest + k + 0.5`` ms, so every clock quantizes to its own whole millisecond, away from
# floor-rounding edges.
Spec = dict[tuple[int, str], tuple[int, float, int]]


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


def assert_frontier_is_optimal(problem: FrontierProblem) -> None:
    """Every point ``iterate_frontier`` emits, one unit apart from ``T_max`` (all slowest) down
    to ``T_min``, is a feasible assignment whose cost is the exhaustive search's minimum."""
    n = problem.dag.num_nodes
    t_lo, best = best_cost_by_makespan(problem)
    points = list(iterate_frontier(problem))
    t_max = problem.makespan(problem.slowest_durations)
    t_min = problem.makespan(problem.fastest_durations)
    assert t_max > t_min + 2, "the synthetic problem should have room for several steps"
    assert [p.quant_time for p in points] == list(range(t_max, t_max - len(points), -1))
    assert points[0].quant_durations.tolist() == problem.slowest_durations.tolist()
    assert points[-1].quant_time == t_min
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


def assert_one_option_per_clock(problem: FrontierProblem, specs: Spec) -> None:
    """Guards the test design: the problem has one duration per profiled clock of every
    (stage, instruction) of ``specs``, looked up by its (model) stage."""
    assert set(problem.models) == set(specs)
    for (stage, instruction), (fastest_ms, _, clocks) in specs.items():
        options = problem.models[(stage, instruction)].options
        expected = list(range(fastest_ms + clocks - 1, fastest_ms - 1, -1))
        assert options.quant_times.tolist() == expected
        assert options.frequencies_mhz.tolist() == [1410 - 105 * k for k in reversed(range(clocks))]
