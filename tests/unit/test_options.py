"""Tests for perseus_planner.options (execution options) and the exponential cost model."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_api.profile import Measurements
from perseus_planner import options as options_module
from perseus_planner.cost_model import (
    ExponentialCostModel,
    LinearCostModel,
    fit_cost_model,
    fit_exponential,
)
from perseus_planner.errors import CostModelError, PlannerError, SolverError
from perseus_planner.options import (
    SOFT_FILTER_TOLERANCE,
    ExecutionOptions,
    build_options,
    pareto_filter,
)

UNIT_S = 0.001


def measurements(rows: list[tuple[int, float, float]]) -> Measurements:
    """``rows`` of (MHz, seconds, joules), in file order."""
    return Measurements(
        frequencies_mhz=np.array([r[0] for r in rows], dtype=np.int64),
        times_s=np.array([r[1] for r in rows], dtype=np.float64),
        energies_j=np.array([r[2] for r in rows], dtype=np.float64),
    )


# Five Pareto-optimal clocks (faster costs more energy) and two dominated ones.
PARETO_ROWS = [
    (1400, 0.0105, 10.0),
    (1300, 0.0115, 8.0),
    (1250, 0.0125, 9.0),  # dominated by 1300 MHz: slower and more energy
    (1200, 0.0125, 7.0),
    (1100, 0.0135, 6.5),
    (1000, 0.0145, 6.2),
    (900, 0.0165, 6.3),  # dominated by 1000 MHz
]


def test_pareto_filter_drops_dominated_clocks() -> None:
    options = build_options(measurements(PARETO_ROWS), UNIT_S, 0.0)
    assert options.frequencies_mhz.tolist() == [1000, 1100, 1200, 1300, 1400]
    assert options.quant_times.tolist() == [14, 13, 12, 11, 10]
    assert options.energies_j.tolist() == [6.2, 6.5, 7.0, 8.0, 10.0]
    assert options.min_quant_time == 10
    assert options.max_quant_time == 14
    assert options.unit_time_s == UNIT_S


def test_input_order_does_not_matter() -> None:
    forward = build_options(measurements(PARETO_ROWS), UNIT_S, 5.0)
    backward = build_options(measurements(PARETO_ROWS[::-1]), UNIT_S, 5.0)
    for name in ("quant_times", "energies_j", "costs_j", "frequencies_mhz"):
        assert getattr(forward, name).tolist() == getattr(backward, name).tolist()


def test_quantization_floors() -> None:
    rows = [(1400, 0.0109, 9.0), (1300, 0.0111, 8.0), (1200, 0.01299, 7.0), (1100, 0.0151, 6.0)]
    options = build_options(measurements(rows), UNIT_S, 0.0)
    assert options.quant_times.tolist() == [15, 12, 11, 10]
    assert options.quant_times.dtype == np.int64
    # A finer unit keeps the tenths (times chosen away from floating-point floor edges).
    rows = [(1400, 0.01095, 9.0), (1300, 0.01115, 8.0), (1200, 0.01295, 7.0), (1100, 0.01515, 6.0)]
    fine = build_options(measurements(rows), 0.0001, 0.0)
    assert fine.quant_times.tolist() == [151, 129, 111, 109]


def test_quantization_is_python_float_floor_division() -> None:
    # Like the Perseus artifact (needed to reproduce its frontiers tie for tie): 0.0151 s is
    # 150.99999999999997 units of 0.1 ms in binary floating point, so it quantizes to 150.
    rows = [(1400, 0.0109, 9.0), (1300, 0.0111, 8.0), (1200, 0.01299, 7.0), (1100, 0.0151, 6.0)]
    fine = build_options(measurements(rows), 0.0001, 0.0)
    assert fine.quant_times.tolist() == [150, 129, 110, 108]
    assert fine.quant_times.tolist() == [int(r[1] // 0.0001) for r in rows[::-1]]


def test_equal_quantized_time_keeps_highest_energy() -> None:
    rows = [
        (1400, 0.0102, 10.0),
        (1350, 0.0112, 9.0),  # quantizes to 11, more energy than 1300 MHz: kept
        (1300, 0.0118, 8.5),  # also 11, less energy: dropped
        (1200, 0.0125, 8.0),
        (1100, 0.0135, 7.5),
    ]
    options = build_options(measurements(rows), UNIT_S, 0.0)
    assert options.quant_times.tolist() == [13, 12, 11, 10]
    assert options.frequencies_mhz.tolist() == [1100, 1200, 1350, 1400]
    assert options.energies_j.tolist() == [7.5, 8.0, 9.0, 10.0]


def test_soft_refilter_when_three_or_fewer_options() -> None:
    rows = [
        (1400, 0.0105, 10.0),
        (1300, 0.0125, 8.0),
        (1200, 0.0135, 8.1),  # dominated by 1300 MHz, but by less than 5% in energy
        (1100, 0.0145, 6.0),
    ]
    # The strict filter leaves three options, so the 5% tolerant one runs and keeps 1200 MHz.
    assert SOFT_FILTER_TOLERANCE == 0.95
    options = build_options(measurements(rows), UNIT_S, 0.0)
    assert options.frequencies_mhz.tolist() == [1100, 1200, 1300, 1400]
    assert options.quant_times.tolist() == [14, 13, 12, 10]
    assert options.energies_j.tolist() == [6.0, 8.1, 8.0, 10.0]


def test_no_soft_refilter_with_four_strict_options() -> None:
    rows = [
        (1400, 0.0105, 10.0),
        (1300, 0.0115, 9.0),
        (1250, 0.0125, 8.0),
        (1200, 0.0135, 8.1),  # within 5% of 1250 MHz, but four options survive strictly
        (1100, 0.0145, 6.0),
    ]
    options = build_options(measurements(rows), UNIT_S, 0.0)
    assert options.frequencies_mhz.tolist() == [1100, 1250, 1300, 1400]


def test_soft_refilter_still_drops_clearly_dominated() -> None:
    rows = [
        (1400, 0.0105, 10.0),
        (1300, 0.0125, 8.0),
        (1200, 0.0145, 9.0),  # 16% slower and 12.5% more energy than 1300 MHz
        (1100, 0.0155, 6.0),
    ]
    options = build_options(measurements(rows), UNIT_S, 0.0)
    assert options.frequencies_mhz.tolist() == [1100, 1300, 1400]


@pytest.mark.parametrize("blocking_w", [0.0, 20.0, 83.64])
def test_costs_subtract_blocking_energy(blocking_w: float) -> None:
    options = build_options(measurements(PARETO_ROWS), UNIT_S, blocking_w)
    expected = [
        e - blocking_w * q * UNIT_S
        for q, e in zip(options.quant_times.tolist(), options.energies_j.tolist(), strict=True)
    ]
    assert options.costs_j.tolist() == expected
    assert options.costs_j[0] == pytest.approx(6.2 - blocking_w * 0.014, abs=1e-12)


def test_frequency_for_picks_slowest_clock_that_fits() -> None:
    options = ExecutionOptions(
        quant_times=np.array([14, 12, 11, 10]),
        energies_j=np.array([6.0, 7.0, 8.0, 10.0]),
        costs_j=np.array([6.0, 7.0, 8.0, 10.0]),
        frequencies_mhz=np.array([1000, 1200, 1300, 1400]),
        unit_time_s=UNIT_S,
    )
    assert options.frequency_for(20) == 1000  # anything fits: the slowest clock
    assert options.frequency_for(14) == 1000
    assert options.frequency_for(13) == 1200  # 14 does not fit, 12 does
    assert options.frequency_for(12) == 1200
    assert options.frequency_for(11) == 1300
    assert options.frequency_for(10) == 1400
    assert options.frequency_for(9) == 1400  # nothing fits: the fastest clock


@pytest.mark.parametrize("unit_s", [0.0, -0.001, float("nan"), float("inf")])
def test_invalid_unit_time(unit_s: float) -> None:
    with pytest.raises(SolverError, match="unit time must be a positive number of seconds"):
        build_options(measurements(PARETO_ROWS), unit_s, 10.0)


@pytest.mark.parametrize("blocking_w", [-1.0, -1e-9, float("nan"), float("inf")])
def test_invalid_blocking_power(blocking_w: float) -> None:
    with pytest.raises(SolverError, match="blocking power must be >= 0 W"):
        build_options(measurements(PARETO_ROWS), UNIT_S, blocking_w)


def test_too_coarse_unit_time() -> None:
    # Every clock takes 10.5..14.5 ms: with a 10 ms unit all of them quantize to 1.
    with pytest.raises(SolverError, match=r"only 1 distinct duration\(s\) remain") as info:
        build_options(measurements(PARETO_ROWS), 0.01, 10.0)
    assert "use a smaller unit time" in str(info.value)
    assert isinstance(info.value, PlannerError)


@pytest.mark.parametrize(
    ("a", "b", "c"), [(3.0, -0.2, 1.5), (120.0, -0.05, 4.0), (0.5, -0.01, 30.0)]
)
def test_fit_exponential_recovers_noiseless_model(a: float, b: float, c: float) -> None:
    q = np.arange(10, 30, dtype=np.int64)
    costs = a * np.exp(b * q) + c
    model = fit_exponential(q, costs, UNIT_S)
    assert isinstance(model, ExponentialCostModel)
    assert model.a > 0
    assert model.a == pytest.approx(a, rel=1e-4)
    assert model.b == pytest.approx(b, rel=1e-4)
    assert model.c == pytest.approx(c, rel=1e-4, abs=1e-6)
    assert np.allclose(model(q), costs, rtol=1e-9, atol=1e-9)


def test_two_options_get_the_line_through_them() -> None:
    q = np.array([12, 10], dtype=np.int64)
    costs = np.array([5.0, 7.0])
    model = fit_cost_model(q, costs, UNIT_S)
    assert isinstance(model, LinearCostModel)
    np.testing.assert_allclose(model(q), costs, rtol=1e-12)


def test_three_convex_options_are_interpolated_by_an_exponential() -> None:
    q = np.array([12, 11, 10], dtype=np.int64)
    costs = 2.0 * np.exp(-0.3 * q) + 1.0
    model = fit_cost_model(q, costs, UNIT_S)
    assert isinstance(model, ExponentialCostModel)
    assert model.a > 0
    np.testing.assert_allclose(model(q), costs, rtol=1e-6)


def test_concave_options_still_get_a_convex_model() -> None:
    q = np.array([14, 13, 12, 11, 10], dtype=np.int64)
    costs = np.array([5.0, 5.9, 6.6, 7.1, 7.4])  # slope flattens: concave in q
    model = fit_cost_model(q, costs, UNIT_S)
    grid = np.arange(10, 15, dtype=np.int64)
    second_difference = np.diff(model(grid), 2)
    assert np.all(second_difference >= -1e-9)


def test_failed_exponential_fit_falls_back_to_a_line_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_fit(*_: object) -> ExponentialCostModel:
        raise CostModelError("no convex exponential model fits the 4 options")

    monkeypatch.setattr("perseus_planner.cost_model.fit_exponential", no_fit)
    q = np.array([13, 12, 11, 10], dtype=np.int64)
    costs = np.array([5.0, 6.0, 7.0, 8.0])
    with caplog.at_level("WARNING", logger="perseus_planner.cost_model"):
        model = fit_cost_model(q, costs, UNIT_S, label="stage 3 backward")
    assert isinstance(model, LinearCostModel)
    np.testing.assert_allclose(model(q), costs, rtol=1e-12)
    assert "stage 3 backward: no convex exponential model fits" in caplog.text


def test_cost_model_needs_two_distinct_durations() -> None:
    with pytest.raises(CostModelError, match="at least two distinct durations"):
        fit_cost_model(np.array([10], dtype=np.int64), np.array([1.0]), UNIT_S)


def _pairwise_pareto(
    rows: list[tuple[float, float, int]], noise_factor: float
) -> list[tuple[float, float, int]]:
    """The O(n^2) filter the planner used until issue 18 (the artifact's own), for reference."""
    return [
        r
        for r in rows
        if not any(o[0] < r[0] * noise_factor and o[1] < r[1] * noise_factor for o in rows)
    ]


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("noise_factor", [1.0, SOFT_FILTER_TOLERANCE])
def test_fast_pareto_filter_keeps_exactly_the_rows_of_the_pairwise_one(
    seed: int, noise_factor: float
) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    # Few distinct values, so that equal times, equal energies and whole equal rows (ties)
    # are common; sometimes exact multiples of the noise factor as well.
    times = rng.choice(rng.uniform(0.01, 0.02, size=max(n // 4, 1)), size=n)
    energies = rng.choice(rng.uniform(5.0, 10.0, size=max(n // 4, 1)), size=n)
    if seed % 5 == 0:
        times[: n // 2] = times[n // 2 : 2 * (n // 2)] * noise_factor
    rows = [
        (float(t), float(e), 1000 + i) for i, (t, e) in enumerate(zip(times, energies, strict=True))
    ]
    rows.sort(key=lambda r: r[0], reverse=True)
    assert pareto_filter(rows, noise_factor) == _pairwise_pareto(rows, noise_factor)


def test_pareto_filter_edge_cases() -> None:
    assert pareto_filter([], 1.0) == []
    same = [(0.1, 5.0, 1), (0.1, 5.0, 2)]
    assert pareto_filter(same, 1.0) == same  # ties dominate nothing
    assert pareto_filter([(0.2, 6.0, 1), (0.1, 5.0, 2)], 1.0) == [(0.1, 5.0, 2)]


def test_options_of_many_clocks_are_those_of_the_pairwise_filter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the whole recipe (both filters, quantization, dedupe) on 600 noisy clocks."""
    rng = np.random.default_rng(7)
    n = 600
    freqs = np.arange(n, dtype=np.int64) + 500
    times = 10.0 / freqs + rng.normal(0, 1e-4, n)
    energies = 5.0 + 1e-3 * freqs + rng.normal(0, 0.05, n)
    m = measurements(list(zip(freqs.tolist(), times.tolist(), energies.tolist(), strict=True)))
    fast = build_options(m, 1e-4, 80.0)
    monkeypatch.setattr(options_module, "pareto_filter", _pairwise_pareto)
    slow = build_options(m, 1e-4, 80.0)
    assert len(fast.quant_times) > 10
    for name in ("quant_times", "energies_j", "costs_j", "frequencies_mhz"):
        assert getattr(fast, name).tolist() == getattr(slow, name).tolist()
