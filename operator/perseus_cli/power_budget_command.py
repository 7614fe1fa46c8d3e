"""``perseus simulate --power-budget``: a cluster power budget met four ways on a mix of jobs.

See :mod:`perseus_planner.sim.power_budget` for the methods and what is measured. Outputs, in
the ``--out`` directory:

- ``power-budget.csv``: ``fraction,budget_w,method,power_w,throughput_kept,energy_ratio,
  within_budget`` per budget and method;
- ``power-budget.png``: throughput kept and energy against the budget, one line per method.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_cli import CliError
from perseus_cli.outputs import prepare_out_dir, write_together

if TYPE_CHECKING:
    from perseus_planner.sim.power_budget import BudgetRow, PowerBudgetSim
    from perseus_planner.sim.power_menu import SimJob

POWER_CSV = "power-budget.csv"
POWER_PNG = "power-budget.png"
_CONFLICTS = ("profile", "bundled", "scale", "microbatches", "replicas", "schedule", "methods")
"""Options of the straggler simulation that a power-budget run has no use for."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("power budget (with --power-budget)")
    group.add_argument(
        "--power-budget",
        action="store_true",
        help="simulate a cluster power budget on a mix of jobs instead of one job's straggler",
    )
    group.add_argument(
        "--job",
        action="append",
        metavar="PROFILE:M:R[:W]",
        help="a job of the mix: bundled profile, microbatches, data-parallel replicas and "
        "optional weight (repeat; default: a mix of all four bundled profiles)",
    )
    group.add_argument(
        "--budgets",
        metavar="F,F,...",
        help="budgets as fractions of the mix's all-max draw (default: 1.0 down by 0.05 to "
        "the lowest the allocation meets, and the draw of the T_min plans)",
    )


def parse_job(text: str) -> SimJob:
    from perseus_planner.sim.power_menu import SimJob

    parts = text.split(":")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        weight = float(parts[3]) if len(parts) == 4 else 1.0
        return SimJob(parts[0], int(parts[1]), int(parts[2]), weight)
    except ValueError:
        raise CliError(
            f"--job {text!r}: expected PROFILE:MICROBATCHES:REPLICAS[:WEIGHT], e.g. "
            "gpt3-175b+a100_sxm:24:8:1"
        ) from None


def _parse_budgets(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"--budgets {text!r}: expected fractions such as 1,0.9,0.8") from None
    if not values or any(not 0 < v <= 1.5 for v in values):
        raise CliError(f"--budgets {text!r}: each fraction must be in (0, 1.5]")
    return values


def run(args: argparse.Namespace) -> int:
    """Execute ``perseus simulate --power-budget``."""
    from perseus_planner.sim.power_budget import DEFAULT_MIX, PowerBudgetSim, sweep
    from perseus_planner.sim.power_menu import solve_job

    given = [f"--{n.replace('_', '-')}" for n in _CONFLICTS if getattr(args, n, None) is not None]
    if given:
        raise CliError(f"--power-budget simulates its own mix of jobs; drop {', '.join(given)}")
    mix = [parse_job(j) for j in args.job] if args.job else list(DEFAULT_MIX)
    budgets = None if args.budgets is None else _parse_budgets(args.budgets)
    out_dir: Path = args.out
    prepare_out_dir(out_dir, force=args.force)
    sim = PowerBudgetSim([solve_job(spec) for spec in mix])
    rows = sweep(sim, budgets)
    csv_path, png_path = out_dir / POWER_CSV, out_dir / POWER_PNG
    title = (
        f"{len(mix)} jobs, {sim.num_gpus} GPUs, all-max draw {sim.all_max_w / 1000:.1f} kW; "
        f"T_min plans draw {100 * sim.t_min_fraction:.1f} %"
    )
    write_together(
        [
            (csv_path, lambda tmp: tmp.write_text(rows_csv(rows))),
            (png_path, lambda tmp: plot_power_budget(tmp, rows, sim, title)),
        ]
    )
    print(title)
    print(mix_table(sim))
    print(budget_table(rows))
    print("Wrote\n  " + "\n  ".join(str(p) for p in (csv_path, png_path)))
    return 0


def rows_csv(rows: list[BudgetRow]) -> str:
    lines = ["fraction,budget_w,method,power_w,throughput_kept,energy_ratio,within_budget"]
    for row in rows:
        for o in row.outcomes.values():
            lines.append(
                f"{row.fraction!r},{row.budget_w!r},{o.method},{o.power_w!r},"
                f"{o.throughput_kept!r},{o.energy_ratio!r},{str(o.within_budget).lower()}"
            )
    return "\n".join(lines) + "\n"


def mix_table(sim: PowerBudgetSim) -> str:
    lines = [f"{'job':<30}{'GPUs':>6}{'weight':>8}{'all-max W':>11}{'T_min W':>9}{'least W':>9}"]
    for j in sim.jobs:
        lines.append(
            f"{j.spec.name:<30}{j.num_gpus:>6}{j.spec.weight:>8g}{j.all_max_power_w:>11.0f}"
            f"{j.menu.powers_w[j.t_min_position]:>9.0f}{j.menu.powers_w.min():>9.0f}"
        )
    return "\n".join(lines)


def budget_table(rows: list[BudgetRow]) -> str:
    """Markdown: budget, then throughput kept (and energy) of each method; ``*`` = over budget."""
    methods = list(rows[0].outcomes) if rows else []
    header = "| budget | " + " | ".join(f"{m} throughput / energy" for m in methods) + " |"
    lines = [header, "|---:|" + "---:|" * len(methods)]
    for row in rows:
        cells = [
            f"{100 * o.throughput_kept:.2f} % / {100 * o.energy_ratio:.1f} %"
            + ("" if o.within_budget else " *")
            for o in row.outcomes.values()
        ]
        lines.append(
            f"| {100 * row.fraction:.1f} % ({row.budget_w / 1000:.1f} kW) | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def plot_power_budget(path: Path, rows: list[BudgetRow], sim: PowerBudgetSim, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    x = [100 * r.fraction for r in rows]
    for k, method in enumerate(rows[0].outcomes if rows else []):
        outcomes = [r.outcomes[method] for r in rows]
        style = {"color": f"C{k}", "marker": "o", "markersize": 3, "label": method}
        left.plot(x, [100 * o.throughput_kept for o in outcomes], **style)
        right.plot(x, [100 * o.energy_ratio for o in outcomes], **style)
        over = [(xi, o) for xi, o in zip(x, outcomes, strict=True) if not o.within_budget]
        if over:
            left.plot([xi for xi, _ in over], [100 * o.throughput_kept for _, o in over],
                      linestyle="none", marker="x", color=f"C{k}", markersize=8)  # fmt: skip
    for ax in (left, right):
        ax.axvline(100 * sim.t_min_fraction, color="0.5", linestyle=":", label="T_min plans' draw")
        ax.set_xlabel("Budget (% of all-max draw)")
        ax.invert_xaxis()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("Throughput kept (% of all-max, weighted)")
    left.set_title("Throughput (x: over budget)", fontsize=9)
    right.set_ylabel("Energy per iteration of every job (% of all-max)")
    right.set_title("Energy", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, format="png", dpi=110)
