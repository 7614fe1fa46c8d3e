"""The warm-started solver against the reference that rebuilds every flow from zero.

Both run in one process on realistic inputs (bundled profiles, both schedules, the
published time units): every point must have the same iteration time, the same
computations sped up and slowed down, and the same energy to the micro-joule.

On the bundled profiles the new bounds never push the kept flow out of range, so
the repair that routes an imbalance back never runs there; one test unbalances
the flow on purpose before many steps to check that path against the reference.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from perseus_api.profile import load_profile
from perseus_planner import _kept_cut, _kernel
from perseus_planner._steps import WarmStepper
from perseus_planner.bundled import bundled_profile
from perseus_planner.dag import build_pipeline_dag
from perseus_planner.frontier import compute_frontier
from perseus_planner.solver import FrontierPoint, FrontierProblem, build_problem, iterate_frontier

IntArray = npt.NDArray[np.int64]
Step = tuple[int, int, tuple[int, ...], tuple[int, ...]]

CASES = [
    pytest.param("gpt3-175b+a100_sxm", "1f1b", 8, None, id="gpt3-a100-1f1b-8"),
    pytest.param("gpt3-175b+a100_sxm", "1f1b", 24, None, id="gpt3-a100-1f1b-24"),
    pytest.param("bloom+a100_sxm", "1f1b", 12, None, id="bloom-a100-1f1b-12"),
    pytest.param("gpt3-175b+a100_sxm", "gpipe", 6, None, id="gpt3-a100-gpipe-6"),
    pytest.param("gpt3-175b+a40", "1f1b", 3, None, id="gpt3-a40-1f1b-3"),
    pytest.param("bloom+a40", "gpipe", 2, None, id="bloom-a40-gpipe-2"),
    pytest.param("bloom+a40", "1f1b", 4, 0.0005, id="bloom-a40-1f1b-4-0.5ms"),
]


def _problem(name: str, schedule: str, microbatches: int, unit_s: float | None) -> FrontierProblem:
    bundled = bundled_profile(name)
    profile = load_profile(bundled.path)
    dag = build_pipeline_dag(schedule, profile.num_stages, microbatches)
    unit = bundled.unit_time_s if unit_s is None else unit_s
    return build_problem(profile, dag, unit, bundled.blocking_power_w)


def _micro_joules(energy_j: float) -> int:
    return round(energy_j * 1e6)


@pytest.mark.parametrize(("name", "schedule", "microbatches", "unit_s"), CASES)
def test_warm_frontier_equals_reference(
    name: str, schedule: str, microbatches: int, unit_s: float | None
) -> None:
    problem = _problem(name, schedule, microbatches, unit_s)
    warm = list(iterate_frontier(problem))
    reference = list(iterate_frontier(problem, keep_flow=False))
    assert len(warm) == len(reference) > 10
    for w, r in zip(warm, reference, strict=True):
        assert w.iteration == r.iteration
        assert w.quant_time == r.quant_time
        assert w.time_s == r.time_s
        assert _micro_joules(w.energy_j) == _micro_joules(r.energy_j)
        assert _micro_joules(w.cost_j) == _micro_joules(r.cost_j)
        np.testing.assert_array_equal(w.sped_up, r.sped_up)
        np.testing.assert_array_equal(w.slowed_down, r.slowed_down)
        np.testing.assert_array_equal(w.quant_durations, r.quant_durations)
        np.testing.assert_array_equal(w.frequencies_mhz, r.frequencies_mhz)


def _steps(problem: FrontierProblem, seed: int | None) -> list[Step]:
    """Run the warm stepper; with a seed, move random flows off balance before each step."""
    t = problem._tables
    n = problem.dag.num_nodes
    dur = t.dmax.copy()
    dur[n:] = 0
    ef = np.empty(n + 2, dtype=np.int64)
    ls = np.empty(n + 2, dtype=np.int64)
    _kernel.critical_path(*t.graph, dur, ef, ls)
    stepper = WarmStepper(t, dur, ef, ls)
    rng = np.random.default_rng(seed)
    up = np.empty(n + 2, dtype=np.int64)
    down = np.empty(n + 2, dtype=np.int64)
    out_i = np.zeros(4, dtype=np.int64)
    out_f = np.zeros(2, dtype=np.float64)
    steps: list[Step] = []
    while True:
        if seed is not None and steps:
            finite = np.flatnonzero((stepper.hi > stepper.lo) & (stepper.hi < _kernel.INF_UNITS))
            for pair in rng.choice(finite, size=min(len(finite), 5), replace=False).tolist():
                lo, hi = int(stepper.lo[pair]), int(stepper.hi[pair])
                stepper.move_flow(pair, int(rng.integers(lo, hi + 1)))
        stepper.step(up, down, out_i, out_f)
        if out_i[0] != _kernel.STATUS_OK:
            return steps
        # The step keeps the critical DAG and leaves the times behind while it can show they
        # cannot change it: both must match a full recomputation.
        ef_full, ls_full = np.empty_like(ef), np.empty_like(ls)
        assert _kernel.critical_path(*t.graph, dur, ef_full, ls_full) == out_i[1]
        if not stepper.kc[_kept_cut.FULL]:  # (else the next step updates them first)
            np.testing.assert_array_equal(stepper.crit, ef_full == ls_full + dur)
            crit_edges = ef_full[t.edge_u] == ls_full[t.edge_v]
            np.testing.assert_array_equal(stepper.ecrit, crit_edges)
        if len(steps) % 5 == 4:  # several steps' pending changes at once
            assert stepper.sync_times() == out_i[1]
            np.testing.assert_array_equal(ef, ef_full)
            np.testing.assert_array_equal(ls, ls_full)
        steps.append(
            (
                int(out_i[1]),
                _micro_joules(float(out_f[1])),
                tuple(up[: out_i[2]].tolist()),
                tuple(down[: out_i[3]].tolist()),
            )
        )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_repaired_flow_gives_the_reference_steps(seed: int) -> None:
    problem = _problem("gpt3-175b+a100_sxm", "1f1b" if seed != 2 else "gpipe", 6, None)
    reference = [
        (
            p.quant_time,
            _micro_joules(p.cost_j),
            tuple(p.sped_up.tolist()),
            tuple(p.slowed_down.tolist()),
        )
        for p in iterate_frontier(problem, keep_flow=False)
    ][1:]
    assert _steps(problem, None) == reference
    assert _steps(problem, seed) == reference


def test_move_flow_rejects_a_flow_outside_the_bounds() -> None:
    problem = _problem("gpt3-175b+a100_sxm", "1f1b", 2, None)
    t = problem._tables
    n = problem.dag.num_nodes
    dur = t.dmax.copy()
    dur[n:] = 0
    stepper = WarmStepper(t, dur, np.zeros(n + 2, np.int64), np.zeros(n + 2, np.int64))
    with pytest.raises(ValueError, match="outside the bounds"):
        stepper.move_flow(0, 1)


@pytest.mark.parametrize(
    ("name", "microbatches"), [("bloom+a100_sxm", 6), ("gpt3-175b+a100_sxm", 40)]
)
def test_compute_frontier_keeps_what_the_points_say(name: str, microbatches: int) -> None:
    # compute_frontier skips the per-point copies and clock tables, and without on_point
    # sums the energies after the solve (_costs): it must still agree with every point,
    # float for float, and hand on_point the same points.
    problem = _problem(name, "1f1b", microbatches, None)
    points = list(iterate_frontier(problem))
    seen: list[FrontierPoint] = []
    for frontier in (compute_frontier(problem), compute_frontier(problem, on_point=seen.append)):
        assert frontier.quant_times.tolist() == [p.quant_time for p in points]
        assert frontier.times_s.tolist() == [p.time_s for p in points]
        assert frontier.costs_j.tolist() == [p.cost_j for p in points]
        assert frontier.energies_j.tolist() == [p.energy_j for p in points]
        for index in (0, 1, len(points) // 2, len(points) - 1):
            np.testing.assert_array_equal(
                frontier.durations_at(index), points[index].quant_durations
            )
    assert len(seen) == len(points)
    for s, p in zip(seen, points, strict=True):
        assert (s.iteration, s.quant_time, s.energy_j) == (p.iteration, p.quant_time, p.energy_j)
        np.testing.assert_array_equal(s.quant_durations, p.quant_durations)
        np.testing.assert_array_equal(s.frequencies_mhz, p.frequencies_mhz)
        np.testing.assert_array_equal(s.sped_up, p.sped_up)
