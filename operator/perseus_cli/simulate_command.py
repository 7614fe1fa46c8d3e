"""``perseus simulate``: compare clock assignments on a simulated data-parallel pipeline job.

Solves the frontier of one pipeline (as ``perseus plan`` does), then simulates ``--replicas``
pipelines for ``--iterations`` iterations under each method, with one replica slowed by
``--straggler-factor`` from ``--straggler-onset`` on. Outputs, in the ``--out`` directory:

- ``simulate.csv``: ``method,iteration,time_s,energy_j,baseline_energy_j`` per iteration
  (energy of every GPU of the job; the baseline is all GPUs at max clock stretched to the same
  iteration time);
- ``simulate.png``: the frontier with each method's operating points, and the iteration
  energy of each method over the run.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_cli import CliError
from perseus_cli.plan_command import (
    _non_negative_float,
    _positive_float,
    _positive_int,
    _prepare_out_dir,
    _resolve_source,
    write_atomically,
)

if TYPE_CHECKING:
    from perseus_planner.sim import MethodRun, Scenario, SimSetup, Summary

log = logging.getLogger(__name__)

SIMULATE_CSV = "simulate.csv"
SIMULATE_PNG = "simulate.png"
DEFAULT_OUT = Path("out/simulate")
DEFAULT_ITERATIONS = 20
_J_PER_KJ = 1000.0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``simulate`` and its options."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a data-parallel pipeline job under Perseus and other clock assignments",
        description=(
            "Simulate data-parallel x pipeline-parallel training from a GPU frequency profile "
            "under several clock assignments (Perseus, all max clock, Zeus-like, EnvPipe-like), "
            "with a straggler replica, and report iteration time, energy and savings."
        ),
    )
    parser.set_defaults(handler=run)
    source = parser.add_argument_group("profile (one of)").add_mutually_exclusive_group()
    source.add_argument("--profile", type=Path, metavar="FILE.csv", help="measured profile")
    source.add_argument(
        "--bundled", metavar="NAME", help="profile shipped with perseus (default: the default one)"
    )
    parser.add_argument(
        "--unit-time",
        type=_positive_float,
        metavar="SECONDS",
        help="planner time step (default: the bundled profile's, else 0.001)",
    )
    parser.add_argument(
        "--blocking-power",
        type=_non_negative_float,
        metavar="WATTS",
        help="power of a waiting GPU (required with --profile)",
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        metavar="{1f1b,gpipe}",
        help="pipeline schedule (default: %(default)s)",
    )
    parser.add_argument(
        "--microbatches",
        type=_positive_int,
        default=24,
        metavar="M",
        help="microbatches per iteration (default: %(default)s)",
    )
    parser.add_argument(
        "--replicas",
        type=_positive_int,
        default=4,
        metavar="R",
        help="data-parallel pipelines (default: %(default)s)",
    )
    parser.add_argument(
        "--iterations",
        type=_positive_int,
        default=DEFAULT_ITERATIONS,
        metavar="I",
        help="iterations simulated (default: %(default)s)",
    )
    parser.add_argument(
        "--straggler-factor",
        type=_at_least_one,
        default=1.2,
        metavar="F",
        help="T'/T of the straggler replica, 1 for none (default: %(default)s)",
    )
    parser.add_argument(
        "--straggler-onset",
        type=_non_negative_int,
        metavar="K",
        help="first slow iteration (default: the middle of the run)",
    )
    parser.add_argument(
        "--methods",
        metavar="A,B,...",
        help="comma-separated methods (default: all): max, perseus-instruction, "
        "perseus-stage, zeus-global, zeus-per-stage, envpipe",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help="directory to write into (default: %(default)s)",
    )
    parser.add_argument(
        "--force", action="store_true", help="write into DIR even if it is not empty"
    )


def run(args: argparse.Namespace) -> int:
    """Execute ``perseus simulate``."""
    from perseus_planner import (
        Schedule,
        build_pipeline_dag,
        build_problem,
        compute_frontier,
        max_frequency_baseline,
    )
    from perseus_planner.sim import METHODS, Scenario, run_method, sim_setup, summarize

    methods = _parse_methods(args.methods, tuple(METHODS))
    onset = args.iterations // 2 if args.straggler_onset is None else args.straggler_onset
    scenario = Scenario(args.replicas, args.iterations, args.straggler_factor, onset)
    source = _resolve_source(args)
    dag = build_pipeline_dag(
        Schedule.parse(args.schedule), source.profile.num_stages, args.microbatches
    )
    out_dir: Path = args.out
    _prepare_out_dir(out_dir, force=args.force)

    problem = build_problem(source.profile, dag, source.unit_time_s, source.blocking_power_w)
    frontier = compute_frontier(problem)
    setup = sim_setup(frontier, max_frequency_baseline(problem))
    runs = [run_method(setup, m, scenario) for m in methods]

    csv_path, png_path = out_dir / SIMULATE_CSV, out_dir / SIMULATE_PNG
    write_atomically(csv_path, lambda tmp: tmp.write_text(runs_csv(runs)))
    title = (
        f"{source.name}: {dag.schedule.value}, {dag.num_stages} stages, M={args.microbatches}, "
        f"{args.replicas} replicas, straggler x{args.straggler_factor:g} from iteration {onset}"
    )
    write_atomically(png_path, lambda tmp: plot_simulation(tmp, setup, scenario, runs, title))
    print(title)
    print(summary_table([summarize(setup, r) for r in runs]))
    print("Wrote\n  " + "\n  ".join(str(p) for p in (csv_path, png_path)))
    return 0


def _parse_methods(text: str | None, known: tuple[str, ...]) -> list[str]:
    if text is None:
        return list(known)
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise CliError(
            f"--methods: unknown or empty {', '.join(unknown) or repr(text)}; "
            f"choose from {', '.join(known)}"
        )
    return list(dict.fromkeys(names))


def runs_csv(runs: list[MethodRun]) -> str:
    """Per-iteration rows of every run, floats as ``repr`` (exact round trip)."""
    lines = ["method,iteration,time_s,energy_j,baseline_energy_j"]
    for r in runs:
        rows = zip(
            r.result.times_s.tolist(),
            r.result.energies_j.tolist(),
            r.baseline_energies_j.tolist(),
            strict=True,
        )
        lines += [f"{r.method},{i},{t!r},{e!r},{b!r}" for i, (t, e, b) in enumerate(rows)]
    return "\n".join(lines) + "\n"


def summary_table(summaries: list[Summary]) -> str:
    """One line per method: mean iteration time and energy, savings, slowdown vs ``T_min``."""
    header = f"{'method':<22}{'time (s)':>10}{'energy (kJ)':>14}{'saved':>9}{'slowdown':>10}"
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(
            f"{s.method:<22}{s.iteration_time_s:>10.4f}{s.energy_j / _J_PER_KJ:>14.2f}"
            f"{100 * s.savings_ratio:>8.2f}%{100 * s.slowdown_ratio:>9.2f}%"
        )
    return "\n".join(lines)


def plot_simulation(
    path: Path, setup: SimSetup, scenario: Scenario, runs: list[MethodRun], title: str
) -> None:
    """Frontier with each method's per-pipeline points, and iteration energy over the run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    frontier = setup.frontier
    left.plot(
        frontier.times_s,
        frontier.energies_j / _J_PER_KJ,
        color="tab:blue",
        label="Perseus frontier (planner)",
    )
    p_w, gpus = setup.blocking_power_w, setup.num_stages
    for k, r in enumerate(runs):
        color = f"C{(k + 1) % 10}"
        for j, a in enumerate(r.assignments):
            energy_kj = (a.busy_energy_j + p_w * (gpus * a.time_s - a.busy_time_s)) / _J_PER_KJ
            left.plot(
                [a.time_s],
                [energy_kj],
                marker="o" if j == 0 else "^",
                color=color,
                linestyle="none",
                label=r.method if j == 0 else None,
            )
        right.plot(
            range(scenario.num_iterations),
            r.result.energies_j / _J_PER_KJ,
            color=color,
            label=r.method,
        )
    left.set_xlabel("Iteration time of one pipeline (s)")
    left.set_ylabel("Energy per iteration of one pipeline (kJ)")
    left.set_title("Operating points (o: before straggler, ^: after, own time)", fontsize=9)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    if scenario.has_straggler:
        right.axvline(scenario.straggler_onset - 0.5, color="0.5", linestyle=":")
    right.set_xlabel("Iteration")
    right.set_ylabel("Energy per iteration, all GPUs (kJ)")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, format="png", dpi=110)


def _at_least_one(text: str) -> float:
    value = _positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value
