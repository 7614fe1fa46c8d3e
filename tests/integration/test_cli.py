"""Tests for the ``perseus`` command line: ``perseus plan`` end to end, its errors, progress."""

from __future__ import annotations

import csv
import io
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from perseus_api import Granularity, PipelinePlan, PlanObjective
from perseus_cli import plan_command
from perseus_cli.main import main
from perseus_cli.progress import Progress, format_duration
from perseus_planner import (
    DEFAULT_PROFILE,
    build_pipeline_dag,
    build_problem,
    bundled_profile,
    compute_frontier,
)

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
M = 8  # microbatches (1F1B needs >= stages): 504 frontier points, solved in well under a second


def _plan(out: Path, *extra: str, microbatches: int = M) -> int:
    return main(["plan", "--microbatches", str(microbatches), "--out", str(out), *extra])


def _read_frontier(path: Path) -> tuple[list[str], list[tuple[float, float]]]:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(float(t), float(e)) for t, e in rows[1:]]


def _read_plan(out: Path) -> PipelinePlan:
    return PipelinePlan.model_validate_json((out / "plan.json").read_text())


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One run of the defaults (bundled profile, 1f1b, T_min), shared by read-only tests."""
    out = tmp_path_factory.mktemp("default") / "plan"
    stdout = io.StringIO()
    saved, sys.stdout = sys.stdout, stdout
    try:
        assert _plan(out) == 0
    finally:
        sys.stdout = saved
    return out, stdout.getvalue()


def test_default_run_writes_all_outputs(default_run: tuple[Path, str]) -> None:
    out, stdout = default_run
    assert sorted(p.name for p in out.iterdir()) == ["frontier.csv", "frontier.png", "plan.json"]
    for word in ("T_min", "T*", "T_max", "All max", "Chosen", "instruction", "stage", "saved"):
        assert word in stdout
    for name in ("frontier.csv", "plan.json", "frontier.png"):
        assert str(out / name) in stdout


def test_frontier_csv_matches_solver_one_unit_per_row(default_run: tuple[Path, str]) -> None:
    out, _ = default_run
    header, rows = _read_frontier(out / "frontier.csv")
    assert header == ["time", "energy"]

    bundled = bundled_profile(DEFAULT_PROFILE)
    problem = build_problem(
        bundled.load(),
        build_pipeline_dag("1f1b", 8, M),
        bundled.unit_time_s,
        bundled.blocking_power_w,
    )
    t_max_s = problem.makespan(problem.slowest_durations) * bundled.unit_time_s
    assert rows[0][0] == t_max_s
    for (t_prev, _), (t_next, _) in itertools.pairwise(rows):
        assert t_prev - t_next == pytest.approx(bundled.unit_time_s, abs=1e-9)
    # repr round-trips: the file holds exactly the solver's floats.
    frontier = compute_frontier(problem)
    assert [t for t, _ in rows] == frontier.times_s.tolist()
    assert [e for _, e in rows] == frontier.energies_j.tolist()


def test_plan_json_round_trips(default_run: tuple[Path, str]) -> None:
    out, _ = default_run
    plan = _read_plan(out)
    assert plan.num_stages == 8
    assert plan.num_microbatches == M
    assert plan.granularity is Granularity.INSTRUCTION
    assert plan.objective is PlanObjective.MIN_TIME
    assert [s.stage for s in plan.stages] == list(range(8))
    assert all(len(s.instructions) == 2 * M for s in plan.stages)
    assert plan.instruction_estimate.iteration_time_s == plan.t_min_s


def test_png_is_written(default_run: tuple[Path, str]) -> None:
    out, _ = default_run
    assert (out / "frontier.png").read_bytes().startswith(PNG_MAGIC)


def test_target_picks_a_point_no_slower_than_it(tmp_path: Path) -> None:
    target_s = 2.5  # between T_min (2.21 s) and T_max (2.71 s) at M = 8
    assert _plan(tmp_path / "out", "--target", str(target_s), "--quiet") == 0
    plan = _read_plan(tmp_path / "out")
    assert plan.objective is PlanObjective.STRAGGLER
    assert plan.target_iteration_time_s == target_s
    assert plan.t_min_s < plan.instruction_estimate.iteration_time_s <= target_s


def test_max_slowdown_stays_within_budget(tmp_path: Path) -> None:
    assert _plan(tmp_path / "out", "--max-slowdown", "0.05", "--no-plot", "--quiet") == 0
    plan = _read_plan(tmp_path / "out")
    assert plan.objective is PlanObjective.MAX_SLOWDOWN
    assert plan.instruction_estimate.iteration_time_s <= 1.05 * plan.t_min_s + 1e-12
    _, rows = _read_frontier(tmp_path / "out" / "frontier.csv")
    assert plan.instruction_estimate.energy_j < rows[-1][1]  # cheaper than T_min


def test_stage_granularity_and_gpipe(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("--granularity", "STAGE", "--schedule", "GPipe", "--no-plot", "--quiet")
    assert _plan(out, *args, microbatches=3) == 0
    plan = _read_plan(out)
    assert plan.granularity is Granularity.STAGE
    assert plan.schedule == "gpipe"
    assert plan.stage_estimate.iteration_time_s <= plan.instruction_estimate.iteration_time_s
    assert all(len(s.instructions) == 6 for s in plan.stages)


def test_profile_file_matches_bundled(tmp_path: Path, default_run: tuple[Path, str]) -> None:
    bundled = bundled_profile(DEFAULT_PROFILE)
    copy = tmp_path / "measured.csv"
    shutil.copyfile(bundled.path, copy)
    out = tmp_path / "out"
    power = repr(bundled.blocking_power_w)
    args = ("--profile", str(copy), "--blocking-power", power, "--stages", "8", "--quiet")
    assert _plan(out, *args) == 0
    default_out, _ = default_run
    assert (out / "frontier.csv").read_text() == (default_out / "frontier.csv").read_text()
    assert _read_plan(out) == _read_plan(default_out)


def test_force_replaces_outputs_and_no_plot_drops_stale_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _plan(out, "--quiet", microbatches=8) == 0
    (out / "notes.txt").write_text("kept")
    assert _plan(out, "--force", "--no-plot", "--quiet", microbatches=9) == 0
    assert _read_plan(out).num_microbatches == 9
    assert sorted(p.name for p in out.iterdir()) == ["frontier.csv", "notes.txt", "plan.json"]


def test_progress_is_shown_for_long_runs_unless_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(plan_command, "PROGRESS_ALWAYS_STEPS", 10)
    assert _plan(tmp_path / "a", "--no-plot", microbatches=8) == 0
    err = capsys.readouterr().err
    assert "frontier: 504/504 steps 100.0%" in err

    assert _plan(tmp_path / "b", "--no-plot", "--quiet", microbatches=8) == 0
    assert capsys.readouterr() == ("", "")


def _corrupt_profile(tmp_path: Path) -> list[str]:
    path = tmp_path / "broken-profile.csv"
    path.write_text("stage,instruction,frequency,time,energy\n0,forward,fast,0.1,20\n")
    return ["--profile", str(path), "--blocking-power", "80"]


def _full_out_dir(tmp_path: Path) -> list[str]:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("x")
    return []


def _out_is_a_file(tmp_path: Path) -> list[str]:
    (tmp_path / "out").write_text("x")
    return []


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (
            lambda p: ["--profile", str(bundled_profile(DEFAULT_PROFILE).path)],
            "blocked on communication",
        ),
        (lambda p: ["--target", "2", "--max-slowdown", "0.1"], "not allowed with"),
        (lambda p: ["--schedule", "zigzag"], "unknown schedule 'zigzag'"),
        (lambda p: ["--microbatches", "0"], "--microbatches: must be an integer >= 1"),
        (_corrupt_profile, "broken-profile.csv"),
        (_full_out_dir, "is not empty; pass --force"),
        (_out_is_a_file, "not a directory"),
        (lambda p: ["--stages", "4"], "--stages 4 does not match"),
        (lambda p: ["--bundled", "gpt5+h100"], "no bundled profile 'gpt5+h100'"),
        (lambda p: ["--unit-time", "nan"], "--unit-time: must be a number > 0"),
    ],
)
def test_errors_exit_2_with_message(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make_args: Callable[[Path], list[str]],
    message: str,
) -> None:
    extra = make_args(tmp_path)
    assert _plan(tmp_path / "out", "--no-plot", *extra) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "error:" in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_planner_errors_are_reported_as_perseus_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _plan(tmp_path / "out", "--bundled", "nope") == 2
    assert capsys.readouterr().err.startswith("perseus: error: no bundled profile 'nope'")
    assert not (tmp_path / "out").exists()  # inputs are checked before anything is created


def test_interrupt_exits_130_and_leaves_no_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import perseus_planner

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(perseus_planner, "compute_frontier", interrupted)
    assert _plan(tmp_path / "out") == 130
    assert "interrupted" in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []


def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "plan" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("perseus ")


def test_module_entry_point_in_a_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "operator")}
    out = tmp_path / "out"
    command = [sys.executable, "-m", "perseus_cli.main", "plan", "--microbatches", "8"]
    done = subprocess.run(
        [*command, "--out", str(out), "--no-plot"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "T_min" in done.stdout
    assert _read_plan(out).num_microbatches == 8

    failed = subprocess.run(
        [*command, "--out", str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert failed.returncode == 2
    assert failed.stderr.startswith("perseus: error: output directory")
    assert "Traceback" not in failed.stderr


class _FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_one_line_at_most_every_interval() -> None:
    clock = _FakeClock()
    stream = _Terminal()
    with Progress(100, stream, "solve", interval_s=0.1, clock=clock) as progress:
        for step in range(1, 101):
            clock.now_s = step * 0.01  # 100 steps/s: a redraw every 10 steps
            progress.update(step)
    text = stream.getvalue()
    assert text.count("\r") == 11  # ten throttled redraws and the final one
    assert "\n" not in text[:-1] and text.endswith("\n")
    assert text.rstrip().endswith("solve: 100/100 steps 100.0% elapsed 0:01 100 steps/s")


def test_progress_in_a_log_writes_whole_lines_and_grows_its_total() -> None:
    clock = _FakeClock()
    stream = io.StringIO()
    progress = Progress(10, stream, clock=clock)
    for step in range(1, 16):
        clock.now_s = step * 1.0
        progress.update(step)
    progress.close()
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[-1] == "15/15 steps 100.0% elapsed 0:15 1 steps/s"
    assert len(lines) == 4  # at t = 1, 6 and 11 s, then the close (only once)


def test_format_duration() -> None:
    assert format_duration(0.4) == "0:00"
    assert format_duration(75) == "1:15"
    assert format_duration(3 * 3600 + 61) == "3:01:01"


# -- issue 18: outputs replaced together, unreachable targets, the CRD's schedule rule ----------


def test_a_failed_write_replaces_no_output_and_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert _plan(out, "--no-plot", "--quiet") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_write_text = Path.write_text

    def disk_full_on_plan(self: Path, *args: object, **kwargs: object) -> int:
        if self.name.startswith(f".{plan_command.PLAN_JSON}."):
            raise OSError(28, "No space left on device")
        return real_write_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", disk_full_on_plan)
    assert _plan(out, "--force", "--no-plot", "--quiet", "--max-slowdown", "0.1") == 2
    err = capsys.readouterr().err
    assert f"cannot write {out / 'plan.json'}: No space left on device" in err
    assert "no output" in err and "was replaced" in err
    # The old frontier.csv is still beside the old plan.json, and no temporary file is left.
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_failed_plot_leaves_the_previous_set_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert _plan(out, "--quiet") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def no_space(path: Path, *_: object) -> None:
        path.write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    import perseus_cli.plotting

    monkeypatch.setattr(perseus_cli.plotting, "plot_frontier", no_space)
    assert _plan(out, "--force", "--quiet", "--target", "2.5") == 2
    assert f"cannot write {out / 'frontier.png'}" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_target_below_t_min_warns_and_records_t_min(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _plan(tmp_path / "out", "--target", "0.5", "--no-plot", "--quiet") == 0
    err = capsys.readouterr().err
    assert err.startswith("perseus: warning: --target 0.5 s is faster than this pipeline")
    plan = _read_plan(tmp_path / "out")
    assert plan.objective is PlanObjective.STRAGGLER
    assert plan.target_iteration_time_s == plan.t_min_s
    assert f"T_min {plan.t_min_s:g} s" in err
    assert plan.instruction_estimate.iteration_time_s == plan.t_min_s


def test_1f1b_with_fewer_microbatches_than_stages_is_refused_as_the_crd_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from perseus_api.job import PARALLELISM_RULES, Parallelism

    assert _plan(tmp_path / "out", "--no-plot", microbatches=7) == 2
    err = capsys.readouterr().err
    crd_message = PARALLELISM_RULES[0][1]
    assert f"{crd_message} (got 7 microbatches for 8 stages)" in err
    assert "--microbatches 8 or more, or --schedule gpipe" in err
    with pytest.raises(ValueError, match=r"\(got 7 microbatches for 8 stages\)"):
        Parallelism.model_validate({"pipelineStages": 8, "microbatches": 7})
    assert (
        _plan(tmp_path / "gpipe", "--no-plot", "--schedule", "gpipe", "--quiet", microbatches=7)
        == 0
    )
