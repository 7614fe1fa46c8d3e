"""Picture of a solved frontier, for people deciding which point to run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from perseus_planner import Baseline, Choice, Frontier

_J_PER_KJ = 1000.0


@dataclass(frozen=True)
class Savings:
    """What the plan saves per iteration against all GPUs at max clock (plan.json's estimate,
    replayed on the profile's measured rows)."""

    ratio: float
    granularity: str


def plot_frontier(
    path: Path,
    frontier: Frontier,
    baseline: Baseline,
    choice: Choice,
    title: str,
    savings: Savings | None = None,
) -> None:
    """Write a PNG of energy (kJ) against iteration time (s) to ``path``.

    Marks ``T_min`` (fastest), ``T*`` (least energy) and the chosen point, and draws the
    baseline: every GPU at its highest clock, from its own iteration time on (it cannot run
    faster) stretched to longer ones at blocking power, the comparison savings are quoted
    against. With ``savings`` an arrow from the baseline down to the chosen point carries the
    plan's saving. ``path`` is written in place; callers that need an atomic file write to a
    temporary name and rename it.
    """
    # Imported here: matplotlib takes longer to load than everything else the CLI needs.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    times_s = frontier.times_s
    energies_kj = frontier.energies_j / _J_PER_KJ
    t_max_s = float(times_s[0])

    # A Figure on its own canvas rather than pyplot: no global state and no GUI backend.
    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(
        times_s,
        energies_kj,
        color="tab:blue",
        linewidth=1.5,
        label="Perseus frontier: least energy for each iteration time (fitted)",
    )
    start_s = baseline.time_s
    ax.plot(
        [start_s, max(t_max_s, start_s)],
        [baseline.energy_j(start_s) / _J_PER_KJ, baseline.energy_j(t_max_s) / _J_PER_KJ],
        color="tab:gray",
        linestyle="--",
        linewidth=1.2,
        label="baseline: all GPUs at max clock, waiting at blocking power when stretched",
    )
    ax.plot(
        [baseline.time_s],
        [baseline.energy_j() / _J_PER_KJ],
        marker="x",
        markersize=9,
        color="tab:gray",
        linestyle="none",
        label=f"all GPUs at max clock: {baseline.time_s:.4g} s (measured times, not the grid)",
    )

    # T_min and the chosen point coincide by default; one marker with both names reads better
    # than two labels drawn over each other.
    names: dict[int, list[str]] = {}
    for index, name in (
        (frontier.t_min_index, "T_min (fastest)"),
        (frontier.t_star_index, "T* (least energy)"),
        (choice.index, "chosen"),
    ):
        names.setdefault(index, []).append(name)
    for index, labels in names.items():
        is_chosen = index == choice.index
        t_s = float(times_s[index])
        e_kj = float(energies_kj[index])
        ax.plot(
            [t_s],
            [e_kj],
            marker="*" if is_chosen else "o",
            markersize=12 if is_chosen else 7,
            color="tab:red" if is_chosen else "tab:orange",
            linestyle="none",
            zorder=3,
        )
        ax.annotate(
            f"{' = '.join(labels)}\n{t_s:.4g} s, {e_kj:.4g} kJ",
            xy=(t_s, e_kj),
            # The chosen point's label below it (the savings arrow comes from above), the others
            # above theirs (the frontier is convex: the space above it is free).
            xytext=(8, -34) if is_chosen else (8, 18),
            textcoords="offset points",
            fontsize=8,
            arrowprops={"arrowstyle": "-", "color": "0.4", "linewidth": 0.8},
        )

    if savings is not None:
        _draw_savings(ax, frontier, baseline, choice, savings)

    ax.set_xlabel("Iteration time (s)")
    ax.set_ylabel("Energy per iteration, one pipeline (kJ)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    # Under the axes: inside, it would cover the savings arrow or a point wherever it went.
    fig.legend(loc="outside lower center", fontsize=8, ncols=1, frameon=False)
    ax.margins(y=0.12)
    fig.savefig(path, format="png", dpi=120)


def _draw_savings(
    ax: Axes, frontier: Frontier, baseline: Baseline, choice: Choice, savings: Savings
) -> None:
    """An arrow from the baseline down to the chosen point, with the plan's saving."""
    t_s = float(frontier.times_s[choice.index])
    e_kj = float(frontier.energies_j[choice.index]) / _J_PER_KJ
    # The baseline cannot run faster than its own time: a point faster than that (T_min on
    # the solver's grid) is compared with it there.
    base_kj = baseline.energy_j(max(t_s, baseline.time_s)) / _J_PER_KJ
    ax.annotate(
        "",
        xy=(t_s, e_kj),
        xytext=(t_s, base_kj),
        arrowprops={"arrowstyle": "->", "color": "tab:green", "linewidth": 2},
        zorder=4,
    )
    ax.annotate(
        f"saves {100 * savings.ratio:.1f} % per iteration\nvs all max clock "
        f"({savings.granularity} plan)",
        xy=(t_s, (e_kj + base_kj) / 2),
        xytext=(10, 0),
        textcoords="offset points",
        va="center",
        fontsize=9,
        fontweight="bold",
        color="tab:green",
    )
