"""The power-budget simulation on the bundled profiles: the frontier allocation against what
operators do today (issue 35), and ``perseus simulate --power-budget`` end to end.

The mix is the default one (both models on both GPUs, 16 to 64 GPUs a job, one job weighted
double); its five frontiers are solved once for the module.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from perseus_cli.main import main
from perseus_planner.sim.power_budget import DEFAULT_MIX, METHODS, PowerBudgetSim, sweep
from perseus_planner.sim.power_menu import solve_job

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sim() -> PowerBudgetSim:
    return PowerBudgetSim([solve_job(spec) for spec in DEFAULT_MIX])


def test_more_throughput_than_every_baseline_at_every_budget(sim: PowerBudgetSim) -> None:
    rows = sweep(sim)
    assert rows[0].fraction == 1.0 and rows[-1].fraction == pytest.approx(sim.least_fraction)
    assert len(rows) >= 10
    for row in rows:
        ours = row.outcomes["perseus"]
        assert ours.within_budget, row.fraction
        for method in METHODS[1:]:
            theirs = row.outcomes[method]
            if not theirs.within_budget:
                continue
            if row.fraction > sim.least_fraction + 1e-9:
                assert ours.throughput_kept > theirs.throughput_kept, (row.fraction, method)
            else:  # the lowest budget: every GPU at its lowest clock, whoever decides
                assert ours.throughput_kept >= theirs.throughput_kept - 1e-12


def test_no_slowdown_down_to_the_t_min_plans_draw(sim: PowerBudgetSim) -> None:
    """Every job at least as fast as its own T_min plan while the budget covers those plans."""
    assert 0.8 < sim.t_min_fraction < 0.95  # intrinsic bloat alone frees ~12 % of the draw
    for fraction in (1.0, 0.95, sim.t_min_fraction):
        ours = sim.row(fraction).outcomes["perseus"]
        for job, time_s in zip(sim.jobs, ours.times_s, strict=True):
            assert time_s <= job.menu.times_s[job.t_min_position] * (1 + 1e-12), job.spec.name
    below = sim.row(sim.t_min_fraction - 0.01).outcomes["perseus"]
    assert below.throughput_kept < sim.row(sim.t_min_fraction).outcomes["perseus"].throughput_kept


def test_deep_budgets_reach_past_the_frontier(sim: PowerBudgetSim) -> None:
    """Below what every T_max plan draws only the points past T_max (capped or locked slowest
    clocks) fit; the allocation still meets the budget there and keeps more throughput."""
    t_max_fraction = sum(float(j.menu.powers_w[0]) for j in sim.jobs) / sim.all_max_w
    assert sim.least_fraction < t_max_fraction - 0.05
    row = sim.row((sim.least_fraction + t_max_fraction) / 2)
    ours = row.outcomes["perseus"]
    assert ours.within_budget
    assert all(ours.throughput_kept > o.throughput_kept for o in list(row.outcomes.values())[1:])


def test_command_writes_table_csv_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pb"
    jobs = ["--job", "gpt3-175b+a100_sxm:8:2", "--job", "bloom+a100_sxm:8:1:2"]
    args = ["simulate", "--power-budget", *jobs, "--budgets", "1,0.8", "--out", str(out)]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "| 80.0 %" in stdout and "gpt3-175b+a100_sxm/M8x2" in stdout
    assert (out / "power-budget.png").read_bytes().startswith(PNG_MAGIC)
    with (out / "power-budget.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == list(METHODS) * 2
    ours = [r for r in rows if r["method"] == "perseus"]
    assert all(float(r["power_w"]) <= float(r["budget_w"]) for r in ours)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--job", "gpt3-175b+a100_sxm:8"], "PROFILE:MICROBATCHES:REPLICAS"),
        (["--budgets", "1,0"], "each fraction"),
        (["--replicas", "2"], "drop --replicas"),
        (["--job", "nosuch:8:1"], "no bundled profile"),
    ],
)
def test_command_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["simulate", "--power-budget", *extra, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
