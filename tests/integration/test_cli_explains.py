"""``perseus`` output that explains itself: labels, hints, the first solve's compile, --version
on every console script, default outputs and loopback defaults, and what the pictures say."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from perseus_api import PipelinePlan
from perseus_cli.main import main

REPO = Path(__file__).resolve().parents[2]
M = 8


def _plan(capsys: pytest.CaptureFixture[str], out: Path, *extra: str) -> tuple[str, str]:
    assert main(["plan", "--microbatches", str(M), "--out", str(out), *extra]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.lstrip().startswith(start))


def test_the_summary_labels_fitted_and_replayed_energies_and_the_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = _plan(capsys, tmp_path / "o", "--no-plot")
    plan = PipelinePlan.model_validate_json((tmp_path / "o" / "plan.json").read_text())
    assert "(energies of the solver's fitted cost model; times on its grid of one unit)" in out
    assert "Replayed on the profile's measured rows, saved vs all max clock" in out
    assert _line(out, "T*").endswith("least energy")
    assert _line(out, "T_min").endswith("fastest, the default target")
    # The bundled profile's all-max iteration (measured times) is longer than T_min (floored to
    # the 1 ms grid); the line says so, with all max clock's time on that grid: T_min itself.
    assert plan.baseline_iteration_time_s > plan.t_min_s
    note = _line(out, "slower than T_min only because")
    assert note.endswith(f"on that grid all max clock takes {plan.t_min_s:.3f} s")
    assert "hint" not in out  # instruction granularity saves at T_min


def test_a_granularity_that_saves_nothing_gets_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = _plan(capsys, tmp_path / "o", "--no-plot", "--granularity", "stage")
    plan = PipelinePlan.model_validate_json((tmp_path / "o" / "plan.json").read_text())
    assert plan.stage_estimate.savings_ratio < 0.0005  # what the hint is for
    percent = f"{100 * plan.instruction_estimate.savings_ratio:.2f} %"
    assert _line(out, "stage ").endswith("saved 0.0 J (0.00 %)")
    assert _line(out, "hint:").strip() == (
        "hint: stage granularity saves nothing here: one clock per GPU cannot slow a stage "
        f"whose computations are on the critical path; try --granularity instruction ({percent}) "
        "or a slowdown budget (e.g. --max-slowdown 0.02)"
    )
    # With a slowdown budget stage clocks save: no hint.
    out, _ = _plan(capsys, tmp_path / "o", "--no-plot", "--force", "--granularity", "stage",
                   "--max-slowdown", "0.05")  # fmt: skip
    assert "hint" not in out


def test_plan_writes_to_out_plan_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--microbatches", str(M), "--no-plot"]) == 0
    assert "out/plan/plan.json" in capsys.readouterr().out
    assert (tmp_path / "out" / "plan" / "plan.json").is_file()


def _perseus(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "perseus_cli.main", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_first_solve_says_it_compiles_the_solver_and_later_ones_do_not(
    tmp_path: Path,
) -> None:
    # An empty numba cache: what a fresh installation has.
    env = {**os.environ, "PYTHONPATH": str(REPO / "operator"), "NUMBA_CACHE_DIR": str(tmp_path)}
    args = ["plan", "--microbatches", str(M), "--no-plot", "--force", "--out", "o"]
    first = _perseus(args, env, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "perseus: first run: compiling the solver, once per installation" in first.stderr
    assert "(most of it compiling the solver: first run only)" in first.stdout
    second = _perseus(args, env, tmp_path)
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stderr + second.stdout


def test_without_numba_the_solver_runs_as_plain_python_with_the_same_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `make demo` does (it installs no numba): the same frontier and plan, byte for byte,
    as the compiled kernels give, and one line saying why."""
    _plan(capsys, tmp_path / "compiled", "--no-plot")
    hide_numba = (
        "import runpy, sys; sys.modules['numba'] = None; "
        "runpy.run_module('perseus_cli.main', run_name='__main__')"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "operator")}
    args = ["plan", "--microbatches", str(M), "--no-plot", "--out", str(tmp_path / "plain")]
    plain = subprocess.run(
        [sys.executable, "-c", hide_numba, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr.splitlines() == [
        "perseus: numba is not installed: the solver runs as plain Python (same results, "
        "slower on large problems)"
    ]
    for name in ("frontier.csv", "plan.json"):
        compiled = (tmp_path / "compiled" / name).read_bytes()
        assert (tmp_path / "plain" / name).read_bytes() == compiled, name


@pytest.mark.parametrize(
    ("module", "prog"),
    [
        ("perseus_cli.main", "perseus"),
        ("perseus_operator.main", "perseus-operator"),
        ("perseus_agent.main", "perseus-node-agent"),
    ],
)
def test_every_console_script_has_a_version(module: str, prog: str, tmp_path: Path) -> None:
    from importlib import metadata

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"),
                                                        str(REPO / "node_agent")])}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{prog} {metadata.version('perseus-k8s')}\n"


def test_agent_metrics_listen_on_loopback_unless_asked() -> None:
    from perseus_agent.main import build_parser as agent_parser

    assert agent_parser().parse_args([]).metrics_address == "127.0.0.1"
    assert agent_parser().parse_args(["--metrics-address=0.0.0.0"]).metrics_address == "0.0.0.0"


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """Every figure saved while the test runs (and still written)."""
    saved: list[Figure] = []
    real = Figure.savefig

    def record(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def _texts(fig: Figure) -> list[str]:
    ax = fig.axes[0]
    return [t.get_text() for t in ax.texts] + [t.get_text() for t in fig.legends[0].get_texts()]


def test_the_frontier_picture_shows_the_savings_and_names_its_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], figures: list[Figure]
) -> None:
    _plan(capsys, tmp_path / "o", "--max-slowdown", "0.05")
    plan = PipelinePlan.model_validate_json((tmp_path / "o" / "plan.json").read_text())
    (fig,) = figures
    texts = "\n".join(_texts(fig))
    percent = f"{100 * plan.instruction_estimate.savings_ratio:.1f} %"
    assert f"saves {percent} per iteration\nvs all max clock (Instruction plan)" in texts
    assert "T_min (fastest)" in texts and "T* (least energy)" in texts and "chosen" in texts
    assert "baseline: all GPUs at max clock" in texts
    # The baseline starts at its own iteration time: all max clock cannot run faster.
    baseline = next(line for line in fig.axes[0].lines if line.get_label().startswith("baseline"))
    assert min(baseline.get_xdata()) == pytest.approx(plan.baseline_iteration_time_s)


def test_the_simulation_picture_keeps_every_method_visible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], figures: list[Figure]
) -> None:
    args = ["simulate", "--microbatches", str(M), "--iterations", "6", "--out", str(tmp_path)]
    assert main([*args, "--force"]) == 0
    (fig,) = figures
    points, energy = fig.axes[0], fig.axes[1]
    firsts = [line for line in points.lines if not line.get_label().startswith("_")][1:]
    methods = [line.get_label() for line in firsts]
    assert len(methods) == 6
    # Several methods share a point (all at max clock before the straggler): each has its own
    # marker, drawn smaller than the one before and above it, so that every one shows.
    assert len({line.get_marker() for line in firsts}) == len(methods)
    sizes = [line.get_markersize() for line in firsts]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    curves = [line for line in energy.lines if line.get_label() in methods]
    assert len({(str(c.get_linestyle()), c.get_linewidth()) for c in curves}) == len(methods)
