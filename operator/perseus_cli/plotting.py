"""Picture of a solved frontier, for people deciding which point to run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from perseus_planner import Baseline, Choice, Frontier

_J_PER_KJ = 1000.0


def plot_frontier(
    path: Path, frontier: Frontier, baseline: Baseline, choice: Choice, title: str
) -> None:
    """Write a PNG of energy (kJ) against iteration time (s) to ``path``.

    Marks ``T_min``, ``T*`` and the chosen point, and draws the energy of every GPU at its
    highest clock stretched to the same iteration times (blocking power while it waits), the
    comparison the savings are quoted against. ``path`` is written in place; callers that
    need an atomic file write to a temporary name and rename it.
    """
    # Imported here: matplotlib takes longer to load than everything else the CLI needs.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    times_s = frontier.times_s
    energies_kj = frontier.energies_j / _J_PER_KJ
    t_min_s = float(times_s[frontier.t_min_index])
    t_max_s = float(times_s[0])

    # A Figure on its own canvas rather than pyplot: no global state and no GUI backend.
    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(times_s, energies_kj, color="tab:blue", linewidth=1.5, label="Perseus frontier")
    ax.plot(
        [t_min_s, t_max_s],
        [baseline.energy_j(t_min_s) / _J_PER_KJ, baseline.energy_j(t_max_s) / _J_PER_KJ],
        color="tab:gray",
        linestyle="--",
        linewidth=1.2,
        label="all GPUs at max clock",
    )
    ax.plot(
        [baseline.time_s],
        [baseline.energy_j() / _J_PER_KJ],
        marker="x",
        color="tab:gray",
        linestyle="none",
        label="all GPUs at max clock, own iteration time",
    )

    # T_min and the chosen point coincide by default; one marker with both names reads better
    # than two labels drawn over each other.
    names: dict[int, list[str]] = {}
    for index, name in (
        (frontier.t_min_index, "T_min"),
        (frontier.t_star_index, "T*"),
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
            # Above the point: the frontier is convex, so the space above it is free.
            xytext=(6, 24),
            textcoords="offset points",
            fontsize=8,
            arrowprops={"arrowstyle": "-", "color": "0.4", "linewidth": 0.8},
        )

    ax.set_xlabel("Iteration time (s)")
    ax.set_ylabel("Energy per iteration (kJ)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    fig.savefig(path, format="png", dpi=120)
