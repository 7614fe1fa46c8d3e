"""``perseus simulate``: compare clock assignments on a simulated data-parallel pipeline job.

Solves the frontier of one pipeline (as ``perseus plan`` does), then simulates ``--replicas``
pipelines for ``--iterations`` iterations under each method, with one replica slowed by
``--straggler-factor`` from ``--straggler-onset`` on. Outputs, in the ``--out`` directory:

- ``simulate.csv``: ``method,iteration,time_s,energy_j,baseline_energy_j`` per iteration
  (energy of every GPU of the job; the baseline is all GPUs at max clock stretched to the same
  iteration time);
- ``simulate.png``: the frontier with each method's operating points, and the iteration
  energy of each method over the run.

``--scale GPUS`` emulates the paper's large-scale runs (1,024-8,192 GPUs, see
:mod:`perseus_planner.sim.emulation`): it sets the microbatches and replicas of that layout,
puts the straggler at max clock under every method (the paper's accounting) unless
``--straggler-clocks`` says otherwise, and reports times x10 and energies x80 (8-way tensor
parallel stages of a 175B model). One pipeline is planned and simulated; the replicas share it.

``--power-budget`` simulates something else: a cluster power budget on a mix of jobs, met by
choosing each job's frontier point and by what operators do today
(:mod:`perseus_cli.power_budget_command`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_cli import CliError, power_budget_command
from perseus_cli.arguments import (
    at_least_one,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from perseus_cli.outputs import add_out_dir_arguments, prepare_out_dir, write_together
from perseus_cli.plan_command import (
    _resolve_source,
    check_pipeline,
    prepare,
    solve_with_progress,
)
from perseus_cli.schedules import add_schedule_arguments, schedule_profile_for

if TYPE_CHECKING:
    from perseus_planner.sim import MethodRun, Scenario, SimSetup, StragglerClocks, Summary
    from perseus_planner.sim.emulation import ScaleConfig

log = logging.getLogger(__name__)

SIMULATE_CSV = "simulate.csv"
SIMULATE_PNG = "simulate.png"
DEFAULT_OUT = Path("out/simulate")
DEFAULT_ITERATIONS = 20
DEFAULT_MICROBATCHES = 24
DEFAULT_REPLICAS = 4
DEFAULT_SCHEDULE = "1f1b"
_J_PER_KJ = 1000.0
_METHOD_STYLES = (("o", "-"), ("s", "--"), ("D", "-."), ("^", ":"), ("v", (0, (5, 1))), ("P", "-"))
"""Marker and dash of each method in simulate.png, in the order drawn."""
_CLOCKS_WORDS = {"own": "at its own clocks", "max": "at max clock under every method"}
_SCALE_CONFLICTS = ("profile", "microbatches", "replicas", "schedule")
"""Options that ``--scale`` sets itself (the paper's bundled 175B profiles, its layout, 1F1B)."""


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
        type=positive_float,
        metavar="SECONDS",
        help="planner time step (default: the bundled profile's, else 0.001)",
    )
    parser.add_argument(
        "--blocking-power",
        type=non_negative_float,
        metavar="WATTS",
        help="power of a waiting GPU (required with --profile)",
    )
    add_schedule_arguments(parser.add_argument_group("schedule"), default=None)
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        metavar="M",
        help=f"microbatches per iteration (default: {DEFAULT_MICROBATCHES})",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        metavar="R",
        help=f"data-parallel pipelines (default: {DEFAULT_REPLICAS})",
    )
    parser.add_argument(
        "--scale",
        type=positive_int,
        metavar="GPUS",
        help="emulate the paper's large-scale runs on GPUS GPUs (1024, 2048, 4096 or 8192: "
        "96, 48, 24 or 12 microbatches on 16, 32, 64 or 128 pipelines of 8 stages x TP 8) "
        "with a bundled profile; sets --microbatches and --replicas",
    )
    parser.add_argument(
        "--iterations",
        type=positive_int,
        default=DEFAULT_ITERATIONS,
        metavar="I",
        help="iterations simulated (default: %(default)s)",
    )
    parser.add_argument(
        "--straggler-factor",
        type=at_least_one,
        default=1.2,
        metavar="F",
        help="T'/T of the straggler replica, 1 for none (default: %(default)s)",
    )
    parser.add_argument(
        "--straggler-onset",
        type=non_negative_int,
        metavar="K",
        help="first slow iteration (default: 0 with --scale, as in the paper's Figure 7; "
        "else the middle of the run)",
    )
    parser.add_argument(
        "--straggler-clocks",
        choices=("own", "max"),
        help="from the onset the straggler keeps its method's clocks (own) or runs at max "
        "clock under every method (max: the paper's accounting) (default: max with --scale, "
        "else own)",
    )
    parser.add_argument(
        "--methods",
        metavar="A,B,...",
        help="comma-separated methods (default: all): max, perseus-instruction, "
        "perseus-stage, zeus-global, zeus-per-stage, envpipe; perseus and zeus name both "
        "of their kind",
    )
    add_out_dir_arguments(parser, DEFAULT_OUT)
    power_budget_command.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Execute ``perseus simulate``."""
    if args.power_budget:
        return power_budget_command.run(args)
    from perseus_planner import Schedule, max_frequency_baseline
    from perseus_planner.sim import METHODS, Scenario, run_method, sim_setup, summarize
    from perseus_planner.sim.emulation import ENERGY_FACTOR, TIME_FACTOR

    methods = _parse_methods(args.methods, tuple(METHODS))
    scale = _scale_config(args)
    if scale is None:
        microbatches = DEFAULT_MICROBATCHES if args.microbatches is None else args.microbatches
        replicas = DEFAULT_REPLICAS if args.replicas is None else args.replicas
    else:
        microbatches, replicas = scale.num_microbatches, scale.num_pipelines
    clocks: StragglerClocks = args.straggler_clocks or ("own" if scale is None else "max")
    if args.straggler_onset is not None:
        onset = args.straggler_onset
    else:  # Figure 7's straggler is there from the start: its numbers, not half of them
        onset = 0 if scale is not None else args.iterations // 2
    scenario = Scenario(
        replicas, args.iterations, args.straggler_factor, onset, straggler_clocks=clocks
    )
    source = _resolve_source(args)
    schedule = Schedule.parse(args.schedule or DEFAULT_SCHEDULE)
    args.stages = None  # the profile's; simulate has no --stages
    shaped = schedule_profile_for(
        args, schedule.value, source.profile, bundled=args.profile is None
    )
    source = replace(source, profile=shaped.profile)
    num_stages, virtual_stages = shaped.num_stages, shaped.virtual_stages
    check_pipeline(schedule.value, num_stages, microbatches, virtual_stages)
    out_dir: Path = args.out
    # Checked before the solve so that a long run cannot end in a refusal to write.
    prepare_out_dir(out_dir, force=args.force)

    problem = prepare(source, schedule.value, num_stages, microbatches, None, virtual_stages)
    dag = problem.dag
    frontier = solve_with_progress(problem, source.name, quiet=False)
    setup = sim_setup(frontier, max_frequency_baseline(problem))
    runs = [run_method(setup, m, scenario) for m in methods]

    units = _Units() if scale is None else _Units(TIME_FACTOR, ENERGY_FACTOR)
    csv_path, png_path = out_dir / SIMULATE_CSV, out_dir / SIMULATE_PNG
    layout = (
        f"{dag.num_stages} stages, M={microbatches}, {replicas} replicas"
        if scale is None
        else scale.label + f", M={microbatches}"
    )
    title = (
        f"{source.name}: {dag.schedule.value}, {layout}, straggler x{args.straggler_factor:g} "
        f"from iteration {onset} {_CLOCKS_WORDS[clocks]}"
    )
    # Replaced together, like perseus plan's outputs: never a new CSV beside an old picture.
    write_together(
        [
            (csv_path, lambda tmp: tmp.write_text(runs_csv(runs, units))),
            (png_path, lambda tmp: plot_simulation(tmp, setup, scenario, runs, title, units)),
        ]
    )
    print(title)
    print(summary_table([summarize(setup, r) for r in runs], units))
    if scale is not None and clocks == "max":
        print(figure7_line(setup, replicas, args.straggler_factor))
    print("Wrote\n  " + "\n  ".join(str(p) for p in (csv_path, png_path)))
    return 0


@dataclass(frozen=True)
class _Units:
    """Factors from the simulated pipeline to what is reported (the emulated TP=8 stages)."""

    time_factor: float = 1.0
    energy_factor: float = 1.0


def _scale_config(args: argparse.Namespace) -> ScaleConfig | None:
    """The ``--scale`` layout, after checking the options it cannot be combined with."""
    from perseus_planner.sim.emulation import SCALE_PROFILES, scale_config

    if args.scale is None:
        return None
    given = [f"--{name}" for name in _SCALE_CONFLICTS if getattr(args, name) is not None]
    if given:
        raise CliError(
            f"--scale sets the profile family, microbatches, replicas and schedule itself; "
            f"drop {', '.join(given)}"
        )
    if args.bundled is not None and args.bundled not in SCALE_PROFILES:
        raise CliError(
            f"--scale emulates the paper's 175B models; --bundled must be one of "
            f"{', '.join(SCALE_PROFILES)}, got {args.bundled!r}"
        )
    return scale_config(args.scale)


def figure7_line(setup: SimSetup, replicas: int, factor: float) -> str:
    """Perseus's total savings in the planner's accounting, the README's Figure 7 table's."""
    from perseus_planner.sim.emulation import perseus_job_energy

    job = perseus_job_energy(setup.frontier, setup.baseline, replicas, factor)
    return (
        f"Figure 7 accounting (planner's frontier, the README table's): Perseus saves "
        f"{100 * job.savings_ratio:.2f}%; the simulated perseus-instruction row above runs "
        "every computation at its measured time"
    )


def _parse_methods(text: str | None, known: tuple[str, ...]) -> list[str]:
    """Method names, each also by its kind (``perseus``: every ``perseus-*`` method)."""
    if text is None:
        return list(known)
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if not names:
        raise CliError(f"--methods: no method in {text!r}; choose from {', '.join(known)}")
    chosen: list[str] = []
    for name in names:
        matches = [name] if name in known else [k for k in known if k.startswith(name + "-")]
        if not matches:
            raise CliError(
                f"--methods: unknown method {name!r}; choose from {', '.join(known)} "
                "(perseus and zeus name both of their kind)"
            )
        chosen += matches
    return list(dict.fromkeys(chosen))


def runs_csv(runs: list[MethodRun], units: _Units | None = None) -> str:
    """Per-iteration rows of every run, floats as ``repr`` (exact round trip)."""
    u = units or _Units()
    lines = ["method,iteration,time_s,energy_j,baseline_energy_j"]
    for r in runs:
        rows = zip(
            (u.time_factor * r.result.times_s).tolist(),
            (u.energy_factor * r.result.energies_j).tolist(),
            (u.energy_factor * r.baseline_energies_j).tolist(),
            strict=True,
        )
        lines += [f"{r.method},{i},{t!r},{e!r},{b!r}" for i, (t, e, b) in enumerate(rows)]
    return "\n".join(lines) + "\n"


def summary_table(summaries: list[Summary], units: _Units | None = None) -> str:
    """One line per method: mean iteration time and energy, savings, slowdown vs ``T_min``."""
    u = units or _Units()
    header = f"{'method':<22}{'time (s)':>10}{'energy (kJ)':>14}{'saved':>9}{'slowdown':>10}"
    lines = [header, "-" * len(header)]
    for s in summaries:
        time_s, energy_kj = u.time_factor * s.iteration_time_s, u.energy_factor * s.energy_j
        lines.append(
            f"{s.method:<22}{time_s:>10.4f}{energy_kj / _J_PER_KJ:>14.2f}"
            f"{100 * s.savings_ratio:>8.2f}%{100 * s.slowdown_ratio:>9.2f}%"
        )
    return "\n".join(lines)


def plot_simulation(
    path: Path,
    setup: SimSetup,
    scenario: Scenario,
    runs: list[MethodRun],
    title: str,
    units: _Units | None = None,
) -> None:
    """Frontier with each method's per-pipeline points, and iteration energy over the run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    u = units or _Units()
    kj = u.energy_factor / _J_PER_KJ
    fig = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    frontier = setup.frontier
    left.plot(
        u.time_factor * frontier.times_s,
        kj * frontier.energies_j,
        color="tab:blue",
        label="Perseus frontier (planner)",
    )
    p_w, gpus = setup.blocking_power_w, setup.num_stages
    for k, r in enumerate(runs):
        # Methods often share a point (all at max clock before a straggler) or a curve: each
        # has its own marker, size and dash, the first drawn largest, so none hides another.
        style = _METHOD_STYLES[k % len(_METHOD_STYLES)]
        color = f"C{(k + 1) % 10}"
        for j, a in enumerate(r.assignments):
            energy_kj = kj * (a.busy_energy_j + p_w * (gpus * a.time_s - a.busy_time_s))
            left.plot(
                [u.time_factor * a.time_s],
                [energy_kj],
                marker=style[0],
                markersize=max(13 - 1.6 * k, 4),
                markerfacecolor=color if j == 0 else "none",
                markeredgewidth=1.5,
                color=color,
                linestyle="none",
                label=r.method if j == 0 else None,
                zorder=3 + k,
            )
        right.plot(
            range(scenario.num_iterations),
            kj * r.result.energies_j,
            color=color,
            linestyle=style[1],
            linewidth=max(3.2 - 0.45 * k, 1.0),
            label=r.method,
            zorder=3 + k,
        )
    left.set_xlabel("Iteration time of one pipeline (s)")
    left.set_ylabel("Energy per iteration of one pipeline (kJ)")
    left.set_title(
        "Operating points (filled: before the straggler, hollow: after; own time)", fontsize=9
    )
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
