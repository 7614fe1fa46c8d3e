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
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_cli import CliError
from perseus_cli.arguments import non_negative_float, positive_float, positive_int
from perseus_cli.node_plans import (
    build_node_plans,
    node_plan_file_name,
    parse_gpu_list,
    place_ranks,
    read_rank_file,
)
from perseus_cli.outputs import Output, write_together
from perseus_cli.progress import Progress
from perseus_cli.schedules import add_schedule_arguments, schedule_profile_for, write_dag_json
from perseus_cli.solver_cache import solver_compiled

# The planner pulls in numpy, scipy and numba (most of a second); it is imported inside
# ``run`` so that building the parser, and so ``perseus --help``, stays instant.
if TYPE_CHECKING:
    from perseus_api import PipelinePlan, PlanEstimate
    from perseus_api.node_plan import NodePlan
    from perseus_cli.node_plans import RankGpu
    from perseus_planner import Baseline, Choice, Frontier, FrontierProblem, Profile

log = logging.getLogger(__name__)

FRONTIER_CSV = "frontier.csv"
PLAN_JSON = "plan.json"
FRONTIER_PNG = "frontier.png"
DEFAULT_OUT = Path("out/plan")
DEFAULT_JOB = "training"

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
    output.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help="directory to write into (default: %(default)s)",
    )
    output.add_argument(
        "--force", action="store_true", help="write into DIR even if it is not empty"
    )
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


def add_node_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpus``/``--node``, ``--ranks`` and ``--job``: node plans for standalone agents."""
    group = parser.add_argument_group(
        "node plans for standalone agents (perseus-node-agent --standalone; one of)",
        "rank r of a P-stage pipeline is stage r %% P of replica r // P unless --ranks says",
    )
    mapping = group.add_mutually_exclusive_group()
    mapping.add_argument(
        "--gpus",
        metavar="I,J,...",
        help="this node's GPUs (indices or UUIDs), one per training rank in rank order; "
        "writes node-plan-NODE.json",
    )
    mapping.add_argument(
        "--ranks",
        type=Path,
        metavar="FILE.csv",
        help="one row per rank: rank,node,gpu[,stage,dp_rank,tp_rank]; writes "
        "node-plan-NODE.json per node",
    )
    group.add_argument(
        "--node",
        metavar="NAME",
        help="node of --gpus, as the agent's --node-name (default: $NODE_NAME, else the host name)",
    )
    group.add_argument(
        "--job",
        default=DEFAULT_JOB,
        metavar="NAME",
        help="job name in the node plans and the agent's metrics (default: %(default)s)",
    )


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
    _prepare_out_dir(out_dir, force=args.force)

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
        (out_dir / node_plan_file_name(node), _json_writer(node_plan))
        for node, node_plan in sorted(node_plans.items())
    ]
    written = _write_outputs(
        out_dir, frontier, baseline, choice, plan, title, args.no_plot, args.export_dag, extra
    )
    if not args.quiet:
        summary = _summary(source, frontier, baseline, choice, plan, solve_s, written, compiled)
        print(summary)
        if shaped.derived:
            print(f"Profile used   {shaped.profile.source}")
        if node_plans:
            print(standalone_hint(out_dir, sorted(node_plans)))
    return 0


def rank_gpus(args: argparse.Namespace) -> list[RankGpu] | None:
    """The rank-to-GPU mapping of ``--gpus``/``--node`` or ``--ranks``; None without one."""
    if args.node is not None and args.gpus is None:
        raise CliError("--node goes with --gpus (a --ranks file names each rank's node)")
    if args.ranks is not None:
        return read_rank_file(args.ranks)
    if args.gpus is not None:
        node = args.node or os.environ.get("NODE_NAME") or socket.gethostname()
        return parse_gpu_list(args.gpus, node)
    return None


def standalone_hint(out_dir: Path, nodes: list[str]) -> str:
    """How to run the agent on the node plans just written."""
    node = nodes[0]
    path = out_dir / node_plan_file_name(node)
    more = f" (and likewise on {', '.join(nodes[1:])})" if len(nodes) > 1 else ""
    return (
        f"Standalone     on {node}{more}: perseus-node-agent --standalone --node-name {node} "
        f"--plan-file {path}"
    )


def announce_compile(*, quiet: bool) -> bool | None:
    """Say on stderr, before the first solve, that it compiles the solver; returns whether the
    solver was compiled already (None: cannot tell)."""
    compiled = solver_compiled()
    if compiled is False and not quiet:
        print(
            "perseus: first run: compiling the solver, once per installation (about 30 s on 2 "
            "cores, longer when they are busy; later runs reuse it)",
            file=sys.stderr,
            flush=True,
        )
    return compiled


def _json_writer(model: NodePlan) -> Callable[[Path], object]:
    return lambda tmp: tmp.write_text(model.model_dump_json(indent=2) + "\n")


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


def _prepare_out_dir(out_dir: Path, *, force: bool) -> None:
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise CliError(f"--out {out_dir} exists and is not a directory")
        if out_dir.is_dir() and not force and any(out_dir.iterdir()):
            raise CliError(
                f"output directory {out_dir} is not empty; pass --force to write into it "
                "(existing frontier.csv, plan.json and frontier.png are replaced)"
            )
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot use output directory {out_dir}: {exc.strerror or exc}") from exc


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
        (out_dir / PLAN_JSON, lambda tmp: tmp.write_text(plan.model_dump_json(indent=2) + "\n")),
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


def _summary(
    source: _Source,
    frontier: Frontier,
    baseline: Baseline,
    choice: Choice,
    plan: PipelinePlan,
    solve_s: float,
    written: list[Path],
    compiled: bool | None = None,
) -> str:
    digits = _time_digits(source.unit_time_s)

    def point(time_s: float, energy_j: float) -> str:
        return f"{time_s:.{digits}f} s  {energy_j:12,.1f} J"

    def at(index: int) -> str:
        return point(float(frontier.times_s[index]), float(frontier.energies_j[index]))

    def saved(est: PlanEstimate) -> str:
        shown = point(est.iteration_time_s, est.energy_j)
        saved_j, percent = _saved(est)
        return f"{shown}  saved {saved_j:,.1f} J ({percent:.2f} %)"

    objective = plan.objective.value
    if plan.target_iteration_time_s is not None:
        what = "T'" if objective == "Straggler" else "deadline"
        objective += f", {what} {plan.target_iteration_time_s:.{digits}f} s"
    stages = frontier.problem.num_stages
    dag = frontier.problem.dag
    if dag.virtual_stages > 1:
        stages_shown = f"{stages} stages x {dag.virtual_stages} virtual"
    else:
        stages_shown = f"{stages} stages"
    compile_note = " (most of it compiling the solver: first run only)" if compiled is False else ""
    lines = [
        f"Profile        {source.name}: {stages_shown}, {dag.schedule.value}, "
        f"{dag.num_microbatches} microbatches, unit {source.unit_time_s:g} s, "
        f"blocking {source.blocking_power_w:g} W",
        f"Frontier       {len(frontier)} points, solved in {solve_s:.2f} s{compile_note}",
        "  (energies of the solver's fitted cost model; times on its grid of one unit)",
        f"  T_max        {at(0)}  slowest point",
        f"  T*           {at(frontier.t_star_index)}  least energy",
        f"  T_min        {at(frontier.t_min_index)}  fastest, the default target",
        f"All max clock  {point(baseline.time_s, baseline.energy_j())}  the baseline",
        *_baseline_note(frontier, baseline, digits),
        f"Chosen         {at(choice.index)}  ({objective})",
        "Replayed on the profile's measured rows, saved vs all max clock at the same "
        "iteration time:",
        f"  instruction  {saved(plan.instruction_estimate)}",
        f"  stage        {saved(plan.stage_estimate)}",
        f"Plan applies   {plan.granularity.value} granularity",
        *_granularity_hint(plan),
        "Wrote",
        *(f"  {path}" for path in written),
    ]
    return "\n".join(lines)


_NOTHING_SAVED_RATIO = 0.0005
"""Below 0.05 % a plan saves nothing worth its clock changes: the summary says why."""


def _saved(est: PlanEstimate) -> tuple[float, float]:
    """Joules and percent saved, as in plan.json (rounded; never "-0.0")."""
    # The baseline energy is recovered from the plan's own ratio rather than recomputed, so
    # the numbers shown are exactly those in plan.json (a straggler target moves the
    # comparison to T', which the planner accounts for).
    saved_j = est.energy_j * est.savings_ratio / (1.0 - est.savings_ratio)
    # Adding 0.0 turns the "-0.0" of rounding noise (no saving at all) into "0.0".
    return round(saved_j, 1) + 0.0, round(100.0 * est.savings_ratio, 2) + 0.0


def _baseline_note(frontier: Frontier, baseline: Baseline, digits: int) -> list[str]:
    """Why all max clock can read slower than ``T_min``: the grid, not the clocks."""
    t_min_s = float(frontier.times_s[frontier.t_min_index])
    if baseline.time_s <= t_min_s:
        return []
    unit_s = frontier.problem.unit_time_s
    return [
        f"  slower than T_min only because the solver rounds each computation down to its "
        f"{unit_s:g} s unit: on that grid all max clock takes {_grid_time_s(frontier):.{digits}f} s"
    ]


def _grid_time_s(frontier: Frontier) -> float:
    """The all-max-clock iteration time with every computation floored to the unit time."""
    import numpy as np

    problem = frontier.problem
    unit_s = problem.unit_time_s
    times_s = np.empty(problem.dag.num_nodes, dtype=np.float64)
    for i, comp in enumerate(problem.dag.computations):
        m = problem.profile.get(comp.stage, comp.instruction)
        fastest = int(np.argmax(m.frequencies_mhz))
        times_s[i] = math.floor(float(m.times_s[fastest]) / unit_s + 1e-9) * unit_s
    return problem.real_makespan_s(times_s)


def _granularity_hint(plan: PipelinePlan) -> list[str]:
    """What to try when the plan's granularity saves nothing at the chosen target."""
    from perseus_api import Granularity, PlanObjective

    if plan.granularity is Granularity.STAGE:
        applied, other, other_name = plan.stage_estimate, plan.instruction_estimate, "instruction"
    else:
        applied, other, other_name = plan.instruction_estimate, plan.stage_estimate, "stage"
    if applied.savings_ratio >= _NOTHING_SAVED_RATIO:
        return []
    name = plan.granularity.value.lower()
    why = (
        "one clock per GPU cannot slow a stage whose computations are on the critical path"
        if plan.granularity is Granularity.STAGE
        else "every computation is on the critical path at this target"
    )
    tries = []
    if other.savings_ratio >= _NOTHING_SAVED_RATIO:
        tries.append(f"--granularity {other_name} ({_saved(other)[1]:.2f} %)")
    if plan.objective is PlanObjective.MIN_TIME:
        tries.append("a slowdown budget (e.g. --max-slowdown 0.02)")
    hint = f"  hint: {name} granularity saves nothing here: {why}"
    return [hint + (f"; try {' or '.join(tries)}" if tries else "")]


def _time_digits(unit_time_s: float) -> int:
    """Decimals that show one unit time (at least milliseconds)."""
    return max(3, math.ceil(-math.log10(unit_time_s) - 1e-9))
