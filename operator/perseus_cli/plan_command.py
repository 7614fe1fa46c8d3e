"""``perseus plan``: solve the time–energy frontier of one pipeline and write a plan.

Outputs, in the ``--out`` directory:

- ``frontier.csv``: ``time,energy`` per frontier point, slowest (``T_max``) first, floats
  written with ``repr`` like the Perseus artifact's CSVs so that they read back exactly;
- ``plan.json``: the ``PipelinePlan`` the operator and node agents apply;
- ``frontier.png``: the frontier with ``T_min``, ``T*``, the chosen point and the
  all-max-clock baseline (unless ``--no-plot``);
- with ``--export-dag FILE``: the DAG that was solved with its measured options, as JSON
  (:mod:`perseus_planner.dag_json`), written together with the others;
- with ``--gpus`` (and ``--node``) or ``--ranks FILE``: ``node-plan-NODE.json`` per node, the
  ``NodePlan`` a standalone node agent applies (``perseus-node-agent --standalone
  --plan-file``; see :mod:`perseus_cli.node_plans` and docs/user-guide/standalone.md).

Schedules: ``1f1b``, ``gpipe``, ``interleaved-1f1b`` (``--virtual-stages``) and ``zb-h1``;
the profile forms they need are in :mod:`perseus_cli.schedules`.

The files are replaced together: each is written to a temporary file in ``--out`` first,
and they are renamed into place only when all are complete (a full disk leaves the previous
run's set intact).

A ``--target`` faster than ``T_min`` cannot be met: the plan runs at ``T_min``, a warning
says so on stderr and ``plan.json`` records ``T_min`` as the target (what is achieved).

Input beyond what the solver can hold (see :mod:`perseus_planner.limits`) is refused before
solving, with the limit in the message; ``--max-solver-work`` raises the one on run time.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_cli import CliError
from perseus_cli.arguments import non_negative_float, positive_float, positive_int
from perseus_cli.node_plans import (
    add_node_plan_arguments,
    build_node_plans,
    node_plan_file_name,
    place_ranks,
    rank_gpus,
    standalone_hint,
)
from perseus_cli.outputs import (
    Output,
    add_out_dir_arguments,
    json_writer,
    prepare_out_dir,
    write_together,
)
from perseus_cli.plan_summary import plan_summary
from perseus_cli.progress import Progress
from perseus_cli.schedules import add_schedule_arguments, schedule_profile_for, write_dag_json
from perseus_cli.solver_cache import solver_compiled, solver_is_compiled_code

# The planner pulls in numpy, scipy and numba (most of a second); it is imported inside
# ``run`` so that building the parser, and so ``perseus --help``, stays instant.
if TYPE_CHECKING:
    from perseus_api import PipelinePlan
    from perseus_planner import Baseline, Choice, Frontier, FrontierProblem, Profile

log = logging.getLogger(__name__)

FRONTIER_CSV = "frontier.csv"
PLAN_JSON = "plan.json"
FRONTIER_PNG = "frontier.png"
DEFAULT_OUT = Path("out/plan")

DEFAULT_UNIT_TIME_S = 0.001
"""For user profiles: the unit the artifact used for A100 profiles (~1000 steps per second)."""

PROGRESS_ALWAYS_STEPS = 2000
"""Above this many solver steps a run takes long enough that logs should show progress too."""

_GRANULARITIES = ("instruction", "stage")

PROG_WARNING = "perseus: warning: "

_BLOCKING_POWER_HELP = (
    "--blocking-power is required with --profile: measure the power draw (W) of one GPU "
    "while it is blocked on communication (e.g. waiting in a NCCL send/recv) and pass it "
    "here; bundled profiles carry their own value"
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``plan`` and its options."""
    parser = subparsers.add_parser(
        "plan",
        help="solve the iteration time–energy frontier and write a frequency plan",
        description=(
            "Solve the iteration time–energy frontier of one pipeline-parallel training job "
            "from a GPU frequency profile, choose a point on it and write frontier.csv, "
            "plan.json and frontier.png to --out."
        ),
    )
    parser.set_defaults(handler=run)

    source = parser.add_argument_group("profile (one of)").add_mutually_exclusive_group()
    source.add_argument(
        "--profile",
        type=Path,
        metavar="FILE.csv",
        help="measured profile (stage,instruction,frequency,time,energy or the per-rank form)",
    )
    source.add_argument(
        "--bundled",
        metavar="NAME",
        help=(
            "profile shipped with perseus (default when --profile is not given: the package's "
            "default profile; an unknown name lists the shipped ones)"
        ),
    )

    pipeline = parser.add_argument_group("pipeline")
    pipeline.add_argument(
        "--microbatches",
        type=positive_int,
        required=True,
        metavar="M",
        help="microbatches per iteration (>= 1)",
    )
    pipeline.add_argument(
        "--stages",
        type=positive_int,
        metavar="N",
        help="pipeline stages (default: the profile's; must match it)",
    )
    add_schedule_arguments(pipeline, default="1f1b")

    solver = parser.add_argument_group("solver")
    solver.add_argument(
        "--unit-time",
        type=positive_float,
        metavar="SECONDS",
        help=(
            "time step between frontier points (default: the bundled profile's, "
            f"else {DEFAULT_UNIT_TIME_S})"
        ),
    )
    solver.add_argument(
        "--max-solver-work",
        type=positive_int,
        metavar="N",
        help=(
            "refuse a solve of more than N frontier points x computations, about N "
            "microseconds (default: 2e9)"
        ),
    )
    solver.add_argument(
        "--blocking-power",
        type=non_negative_float,
        metavar="WATTS",
        help="power of one GPU blocked on communication (default: the bundled profile's; "
        "required with --profile)",
    )

    objective = parser.add_argument_group("objective (one of; default: T_min, no slowdown)")
    exclusive = objective.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--target",
        type=positive_float,
        metavar="SECONDS",
        help=(
            "iteration time T' of the straggler this pipeline waits for (below T_min: "
            "runs at T_min, with a warning)"
        ),
    )
    exclusive.add_argument(
        "--max-slowdown",
        type=non_negative_float,
        metavar="FRACTION",
        help="least energy within (1 + FRACTION) * T_min, e.g. 0.05",
    )
    objective.add_argument(
        "--granularity",
        type=str.lower,
        choices=_GRANULARITIES,
        default="instruction",
        help="clock per forward/backward or one clock per stage (default: %(default)s)",
    )

    output = parser.add_argument_group("output")
    add_out_dir_arguments(output, DEFAULT_OUT)
    output.add_argument("--no-plot", action="store_true", help="do not draw frontier.png")
    output.add_argument(
        "--export-dag",
        type=Path,
        metavar="FILE",
        help="also write the solved DAG and its measured options as JSON (perseus-dag/v1)",
    )
    output.add_argument(
        "--quiet", action="store_true", help="print nothing on success, show no progress"
    )
    add_node_plan_arguments(parser)


@dataclass(frozen=True)
class _Source:
    """The profile to plan for and the solver settings that go with it."""

    name: str
    profile: Profile
    unit_time_s: float
    blocking_power_w: float


def run(args: argparse.Namespace) -> int:
    """Execute ``perseus plan``; errors propagate to ``main`` as CliError/PlannerError."""
    from perseus_api import Granularity
    from perseus_planner import Schedule, build_plan, choose_point, max_frequency_baseline

    schedule = Schedule.parse(args.schedule)
    source = _resolve_source(args)
    shaped = schedule_profile_for(
        args, schedule.value, source.profile, bundled=args.profile is None
    )
    source = replace(source, profile=shaped.profile)
    num_stages, virtual_stages = shaped.num_stages, shaped.virtual_stages
    check_pipeline(schedule.value, num_stages, args.microbatches, virtual_stages)
    ranks = rank_gpus(args)
    if ranks is not None:
        place_ranks(ranks, num_stages)
    out_dir: Path = args.out
    # Checked before the solve so that a long run cannot end in a refusal to write.
    prepare_out_dir(out_dir, force=args.force)

    # Asked before preparing: that runs some of the compiled kernels already.
    compiled = announce_compile(quiet=args.quiet)
    start_s = time.perf_counter()
    problem = prepare(
        source, schedule, num_stages, args.microbatches, args.max_solver_work, virtual_stages
    )
    frontier = solve_with_progress(problem, source.name, quiet=args.quiet)
    solve_s = time.perf_counter() - start_s
    log.info("frontier: %d points in %.2f s", len(frontier), solve_s)

    baseline = max_frequency_baseline(problem)
    choice = choose_point(frontier, target_s=args.target, max_slowdown=args.max_slowdown)
    if choice.target_unreachable:
        print(
            f"{PROG_WARNING}--target {args.target:g} s is faster than this pipeline can run "
            f"(T_min {choice.target_s:g} s): planning for T_min, recorded as the target in "
            f"{PLAN_JSON}",
            file=sys.stderr,
        )
    granularity = Granularity.STAGE if args.granularity == "stage" else Granularity.INSTRUCTION
    plan = build_plan(frontier, baseline, choice, granularity)
    node_plans = {} if ranks is None else build_node_plans(plan, ranks, args.job)

    chunks = f" x {virtual_stages} virtual" if virtual_stages > 1 else ""
    title = f"{source.name}: {schedule.value}, {num_stages}{chunks} stages, M={args.microbatches}"

    extra: list[Output] = [
        (out_dir / node_plan_file_name(node), json_writer(node_plan))
        for node, node_plan in sorted(node_plans.items())
    ]
    written = _write_outputs(
        out_dir, frontier, baseline, choice, plan, title, args.no_plot, args.export_dag, extra
    )
    if not args.quiet:
        summary = plan_summary(
            source.name, source.blocking_power_w, frontier, baseline, choice, plan, solve_s,
            written, compiled,
        )  # fmt: skip
        print(summary)
        if shaped.derived:
            print(f"Profile used   {shaped.profile.source}")
        if node_plans:
            print(standalone_hint(out_dir, sorted(node_plans)))
    return 0


def announce_compile(*, quiet: bool) -> bool | None:
    """Say on stderr, before the first solve, that it compiles the solver; returns whether the
    solver was compiled already (None: cannot tell)."""
    compiled = solver_compiled()
    if not quiet and not solver_is_compiled_code():
        print(
            "perseus: numba is not installed: the solver runs as plain Python (same results, "
            "slower on large problems)",
            file=sys.stderr,
            flush=True,
        )
    if compiled is False and not quiet:
        print(
            "perseus: first run: compiling the solver, once per installation (about 30 s on 2 "
            "cores, longer when they are busy; later runs reuse it)",
            file=sys.stderr,
            flush=True,
        )
    return compiled


def check_pipeline(
    schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> None:
    """The PerseusJob CRD's rules on schedules, so that what the CLI plans the cluster takes.

    Raises:
        CliError: 1F1B with fewer microbatches than stages; virtual stages that do not suit
            the schedule (see :func:`perseus_api.job.check_schedulable`).
    """
    from perseus_api.job import check_schedulable
    from perseus_planner import Schedule

    try:
        check_schedulable(schedule, num_stages, num_microbatches, virtual_stages)
    except ValueError as exc:
        sched = Schedule.parse(schedule)
        if sched is Schedule.INTERLEAVED_1F1B:
            hint = f"use --virtual-stages 2 or more and --microbatches a multiple of {num_stages}"
        elif virtual_stages != 1:
            hint = "--virtual-stages applies to interleaved-1f1b only"
        else:
            hint = f"use --microbatches {num_stages} or more, or --schedule gpipe"
        raise CliError(f"{exc}; {hint}") from None


def prepare(
    source: _Source,
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    max_solver_work: int | None,
    virtual_stages: int = 1,
) -> FrontierProblem:
    """The problem to solve, after the planner's limits (see ``--max-solver-work``)."""
    from perseus_planner import PlannerLimits, prepare_problem

    limits = PlannerLimits()
    if max_solver_work is not None:
        limits = PlannerLimits(max_solver_work=max_solver_work)
    return prepare_problem(
        source.profile,
        schedule,
        num_stages,
        num_microbatches,
        source.unit_time_s,
        source.blocking_power_w,
        limits,
        virtual_stages=virtual_stages,
    )


def solve_with_progress(problem: FrontierProblem, name: str, *, quiet: bool) -> Frontier:
    """``compute_frontier``, with a progress line on a terminal or for long solves."""
    from perseus_planner import compute_frontier
    from perseus_planner.limits import expected_frontier_points

    expected_steps = expected_frontier_points(problem)
    log.info(
        "solving %s: %d computations, ~%d frontier points",
        name,
        problem.dag.num_nodes,
        expected_steps,
    )
    if not quiet and (sys.stderr.isatty() or expected_steps > PROGRESS_ALWAYS_STEPS):
        with Progress(expected_steps, sys.stderr, "frontier") as progress:
            return compute_frontier(
                problem, on_point=lambda point: progress.update(point.iteration + 1)
            )
    return compute_frontier(problem)


def _resolve_source(args: argparse.Namespace) -> _Source:
    from perseus_planner import DEFAULT_PROFILE, bundled_profile, load_profile

    if args.profile is not None:
        if args.blocking_power is None:
            raise CliError(_BLOCKING_POWER_HELP)
        path: Path = args.profile
        unit_time_s = DEFAULT_UNIT_TIME_S if args.unit_time is None else args.unit_time
        return _Source(path.name, load_profile(path), unit_time_s, args.blocking_power)
    bundled = bundled_profile(args.bundled or DEFAULT_PROFILE)
    return _Source(
        bundled.name,
        bundled.load(),
        bundled.unit_time_s if args.unit_time is None else args.unit_time,
        bundled.blocking_power_w if args.blocking_power is None else args.blocking_power,
    )


def _write_outputs(
    out_dir: Path,
    frontier: Frontier,
    baseline: Baseline,
    choice: Choice,
    plan: PipelinePlan,
    title: str,
    no_plot: bool,
    export_dag: Path | None = None,
    extra: Sequence[Output] = (),
) -> list[Path]:
    outputs: list[Output] = [
        (out_dir / FRONTIER_CSV, lambda tmp: tmp.write_text(frontier_csv(frontier))),
        (out_dir / PLAN_JSON, json_writer(plan)),
        *extra,
    ]
    if export_dag is not None:
        outputs.append((export_dag, lambda tmp: write_dag_json(tmp, frontier.problem)))
    png = out_dir / FRONTIER_PNG
    if not no_plot:
        from perseus_cli.plotting import Savings, plot_frontier

        applied = (
            plan.stage_estimate if plan.granularity.value == "Stage" else plan.instruction_estimate
        )
        savings = Savings(applied.savings_ratio, plan.granularity.value)
        outputs.append(
            (png, lambda tmp: plot_frontier(tmp, frontier, baseline, choice, title, savings))
        )
    # With --force a picture from an earlier run would otherwise sit next to the new plan.
    write_together(outputs, stale=[png] if no_plot else [])
    return [path for path, _ in outputs]


def frontier_csv(frontier: Frontier) -> str:
    """``time,energy`` rows, slowest first, each float as ``repr`` (exact round trip)."""
    rows = zip(frontier.times_s.tolist(), frontier.energies_j.tolist(), strict=True)
    return "time,energy\n" + "".join(f"{t!r},{e!r}\n" for t, e in rows)
