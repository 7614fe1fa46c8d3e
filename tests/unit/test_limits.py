"""Finite but extreme input is refused up front, with the limit, by the CLI and the planner.

Each case here used to end in a traceback (pydantic, OverflowError, NaN), a silently wrong
frontier (negative energy), an attempt to allocate tens of gigabytes or a solve that never
finished (issue 18, item 7 and 8).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from perseus_api.profile import MAX_ENERGY_J, parse_profile
from perseus_cli.main import main
from perseus_planner import (
    BUNDLED_PROFILES,
    DEFAULT_PROFILE,
    LimitError,
    PlannerError,
    PlannerLimits,
    Profile,
    bundled_profile,
    prepare_problem,
)
from perseus_planner import limits as limits_module
from perseus_planner.limits import MAX_CUT_ENERGY_J, expected_frontier_points

BUNDLED = bundled_profile(DEFAULT_PROFILE)
STAGES = 8


def _edited_profile(tmp_path: Path, column: str, value: str, row: int = 0) -> Path:
    """The bundled profile with one cell of data row ``row`` (file line ``row + 2``) set."""
    with BUNDLED.path.open(newline="") as f:
        rows = list(csv.reader(f))
    rows[row + 1][rows[0].index(column)] = value
    path = tmp_path / f"{column}-{value}.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def _profile_args(path: Path) -> list[str]:
    return ["--profile", str(path), "--blocking-power", str(BUNDLED.blocking_power_w)]


CliCase = Callable[[Path], list[str]]

CLI_REFUSALS: dict[str, tuple[CliCase, str]] = {
    "energy 1e9 J in one row": (
        lambda tmp: _profile_args(_edited_profile(tmp, "energy", "1e9")),
        r"line 2: energy 1e9 J is above the 7\.04e\+07 J the planner can count",
    ),
    "energy 1e300 J": (
        lambda tmp: _profile_args(_edited_profile(tmp, "energy", "1e300")),
        r"line 2: energy 1e300 J is above",
    ),
    "energy 1e308 J": (
        lambda tmp: _profile_args(_edited_profile(tmp, "energy", "1e308")),
        r"line 2: energy 1e308 J is above",
    ),
    "an outlier the cost model turns into negative energy": (
        lambda tmp: _profile_args(_edited_profile(tmp, "energy", "1000")),
        r"stage 0 forward: the cost model .* gives -\d.* J .* \(energy must be finite and "
        r"positive\)",
    ),
    "time 1e300 s": (
        lambda tmp: _profile_args(_edited_profile(tmp, "time", "1e300")),
        r"stage 0 forward takes up to 1e\+300 s, .* at most 2\*\*53 units",
    ),
    "--unit-time 1e-12": (
        lambda tmp: ["--unit-time", "1e-12"],
        r"unit time 1e-12 s gives more than 2,000,000 duration steps .* at least 3\.\d+e-07 s",
    ),
    "--blocking-power 1e12": (
        lambda tmp: ["--blocking-power", "1e12"],
        r"energy bound is 1\.\d+e\+13 J .* blocking power 1e\+12 W .* limit of 7\.04e\+07 J",
    ),
    "--target 1e308 --granularity stage": (
        lambda tmp: ["--target", "1e308", "--granularity", "stage"],
        r"target iteration time 1e\+308 s is more than 2\*\*53 time units of 0\.001 s; "
        r"at most 9\.0072e\+12 s",
    ),
    "--max-slowdown 1e308": (
        lambda tmp: ["--max-slowdown", "1e308"],
        r"max slowdown 1e\+308 puts the deadline beyond 2\*\*53 time units",
    ),
    "--microbatches 1000000": (
        lambda tmp: ["--microbatches", "1000000"],
        r"8 stages x 1000000 microbatches make 16,000,000 forwards and backwards .* "
        r"limit of 500,000",
    ),
    "--max-solver-work below the estimate": (
        lambda tmp: ["--max-solver-work", "1000"],
        r"the frontier would have about 504 points over 128 computations "
        r"\(64,512 point-computations, .*\), above the planner's limit of 1,000;",
    ),
}


@pytest.mark.parametrize("case", CLI_REFUSALS, ids=list(CLI_REFUSALS))
def test_cli_refuses_extreme_input_with_the_limit(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_args, message = CLI_REFUSALS[case]
    args = ["plan", "--microbatches", str(STAGES), *make_args(tmp_path)]
    assert main([*args, "--out", str(tmp_path / "out"), "--no-plot", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("perseus: error: "), err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err

    assert re.search(message, err), err
    assert not (tmp_path / "out" / "plan.json").exists()


def test_a_million_microbatches_are_refused_before_the_dag_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory stays bounded: nothing proportional to the microbatches is allocated."""

    def must_not_build(*_: object) -> None:
        raise AssertionError("the DAG was built")

    monkeypatch.setattr(limits_module, "build_pipeline_dag", must_not_build)
    with pytest.raises(LimitError, match="16,000,000 forwards and backwards"):
        prepare_problem(BUNDLED.load(), "1f1b", STAGES, 1_000_000, BUNDLED.unit_time_s, 83.64)


def test_the_solver_work_limit_is_configurable() -> None:
    profile = BUNDLED.load()
    args = (profile, "1f1b", STAGES, STAGES, BUNDLED.unit_time_s, BUNDLED.blocking_power_w)
    problem = prepare_problem(*args)
    work = expected_frontier_points(problem) * problem.dag.num_nodes
    assert prepare_problem(*args, PlannerLimits(max_solver_work=work)).dag.num_nodes == 128
    with pytest.raises(LimitError, match=f"limit of {work - 1:,};"):
        prepare_problem(*args, PlannerLimits(max_solver_work=work - 1))
    with pytest.raises(LimitError, match="max_computations must be a positive integer"):
        PlannerLimits(max_computations=0)


def test_limit_errors_are_planner_errors() -> None:
    assert issubclass(LimitError, PlannerError)


def test_profile_row_limit_is_the_planner_limit() -> None:
    # Defined twice because perseus_api (shared with the node agent) must not import the
    # planner; the two must not drift apart.
    assert MAX_ENERGY_J == MAX_CUT_ENERGY_J
    text = f"stage,instruction,frequency,time,energy\n0,forward,1410,0.1,{MAX_ENERGY_J!r}\n"
    text += "0,forward,1395,0.11,1\n0,backward,1410,0.1,1\n0,backward,1395,0.11,1\n"
    assert isinstance(parse_profile(text, "at-the-limit.csv"), Profile)


@pytest.mark.parametrize("name", sorted(BUNDLED_PROFILES))
def test_shipped_profiles_are_within_every_limit(name: str) -> None:
    bundled = bundled_profile(name)
    profile = bundled.load()
    for microbatches in (profile.num_stages, 4 * profile.num_stages):
        prepare_problem(
            profile,
            "1f1b",
            profile.num_stages,
            microbatches,
            bundled.unit_time_s,
            bundled.blocking_power_w,
        )
