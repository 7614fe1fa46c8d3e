"""``perseus profile-plan``: node plans that make standalone agents measure a job's profile.

Outside Kubernetes nothing schedules profiling: this writes, per node, a ``NodePlan`` whose
``profiling`` asks the node's agent (``perseus-node-agent --standalone --plan-file``) to lock
each clock of the sweep in turn, highest first, while the training job runs with the
``perseus_client`` hooks, and to measure each computation's time and energy. When every GPU
is done the agent writes ``node-plan-NODE.profile.csv`` beside the plan file: the profile
``perseus plan --profile`` reads (docs/user-guide/standalone.md).

The plan's pipeline part only says which computations each stage runs, in the schedule's
order (the agent matches the hooks against it); its clocks are not applied.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from perseus_cli import CliError
from perseus_cli.arguments import non_negative_int, positive_int
from perseus_cli.node_plans import (
    add_node_plan_arguments,
    build_node_plans,
    node_plan_file_name,
    place_ranks,
    rank_gpus,
    standalone_hint,
)
from perseus_cli.outputs import add_out_dir_arguments, json_writer, prepare_out_dir, write_together
from perseus_cli.plan_command import check_pipeline

DEFAULT_OUT = Path("out/profiling")
DEFAULT_MAX_MHZ = 2100
"""As the operator's sweep without a clamp: above any current GPU's top clock (the agent
measures each clock at the nearest supported one and skips repeats)."""
DEFAULT_MIN_MHZ = 1050
DEFAULT_STEP_MHZ = 15
DEFAULT_ITERATIONS = 5
DEFAULT_WARMUP = 2
_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``profile-plan`` and its options."""
    parser = subparsers.add_parser(
        "profile-plan",
        help="write node plans that make standalone agents measure a profile",
        description=(
            "Write node-plan-NODE.json per node: the standalone node agent applied to it "
            "sweeps the GPUs' clocks while the training job runs (with the perseus_client "
            "hooks) and writes node-plan-NODE.profile.csv, the profile perseus plan reads."
        ),
    )
    parser.set_defaults(handler=run, no_plot=True)  # no matplotlib needed
    pipeline = parser.add_argument_group("pipeline (as the training job runs it)")
    pipeline.add_argument("--stages", type=positive_int, required=True, metavar="N")
    pipeline.add_argument("--microbatches", type=positive_int, required=True, metavar="M")
    pipeline.add_argument(
        "--schedule",
        type=str.lower,
        choices=_SCHEDULES,
        default="1f1b",
        help="(default: %(default)s)",
    )
    pipeline.add_argument(
        "--virtual-stages",
        type=positive_int,
        default=1,
        metavar="V",
        help="model stages per GPU (interleaved-1f1b)",
    )
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--clocks",
        metavar="MHZ,MHZ,...",
        help="SM clocks to measure, highest first (default: --max-mhz down to --min-mhz)",
    )
    sweep.add_argument("--max-mhz", type=positive_int, default=DEFAULT_MAX_MHZ, metavar="MHZ")
    sweep.add_argument("--min-mhz", type=positive_int, default=DEFAULT_MIN_MHZ, metavar="MHZ")
    sweep.add_argument("--step-mhz", type=positive_int, default=DEFAULT_STEP_MHZ, metavar="MHZ")
    sweep.add_argument(
        "--iterations-per-frequency",
        type=positive_int,
        default=DEFAULT_ITERATIONS,
        metavar="I",
        help="measured iterations per clock (default: %(default)s)",
    )
    sweep.add_argument(
        "--warmup-iterations",
        type=non_negative_int,
        default=DEFAULT_WARMUP,
        metavar="I",
        help="iterations dropped after each clock change (default: %(default)s)",
    )
    add_out_dir_arguments(parser.add_argument_group("output"), DEFAULT_OUT)
    add_node_plan_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Execute ``perseus profile-plan``."""
    from pydantic import ValidationError

    from perseus_api.node_plan import ProfilingSpec
    from perseus_api.plan import placeholder_plan

    check_pipeline(args.schedule, args.stages, args.microbatches, args.virtual_stages)
    ranks = rank_gpus(args)
    if ranks is None:
        raise CliError("say which GPUs run the ranks: --gpus I,J,... (with --node) or --ranks")
    place_ranks(ranks, args.stages)
    clocks = sweep_clocks(args)
    try:
        profiling = ProfilingSpec(
            frequencies_mhz=clocks,
            iterations_per_frequency=args.iterations_per_frequency,
            warmup_iterations=args.warmup_iterations,
        )
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise CliError(f"--clocks: {reason}") from None
    plan = placeholder_plan(
        args.schedule, args.stages, args.microbatches, args.virtual_stages, clocks[0]
    )
    node_plans = build_node_plans(plan, ranks, args.job, profiling=profiling)
    out_dir: Path = args.out
    prepare_out_dir(out_dir, force=args.force)
    outputs = [
        (out_dir / node_plan_file_name(node), json_writer(node_plan))
        for node, node_plan in sorted(node_plans.items())
    ]
    write_together(outputs)
    per_clock = args.warmup_iterations + args.iterations_per_frequency
    print(
        f"Sweep          {len(clocks)} clocks, {clocks[0]} to {clocks[-1]} MHz, "
        f"{per_clock} iterations each ({len(clocks) * per_clock} in all; clocks a GPU lacks "
        "are measured at the nearest it has, repeats skipped)"
    )
    print("Wrote\n" + "\n".join(f"  {path}" for path, _ in outputs))
    print(standalone_hint(out_dir, sorted(node_plans)))
    print(
        "Then run the training job with the perseus_client hooks for at least that many "
        "iterations; each agent writes node-plan-NODE.profile.csv beside its plan"
    )
    return 0


def sweep_clocks(args: argparse.Namespace) -> list[int]:
    """``--clocks``, or ``--max-mhz`` down to ``--min-mhz`` in ``--step-mhz`` steps."""
    if args.clocks is not None:
        try:
            clocks = [int(c) for c in args.clocks.split(",")]
        except ValueError:
            raise CliError(f"--clocks: integers in MHz, got {args.clocks!r}") from None
        if not clocks or min(clocks) <= 0:
            raise CliError(f"--clocks: positive clocks in MHz, got {args.clocks!r}")
        return clocks
    if args.min_mhz > args.max_mhz:
        raise CliError(f"--min-mhz {args.min_mhz} is above --max-mhz {args.max_mhz}")
    clocks = list(range(args.max_mhz, args.min_mhz - 1, -args.step_mhz))
    if clocks[-1] != args.min_mhz:
        clocks.append(args.min_mhz)
    return clocks
