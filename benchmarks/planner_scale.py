"""How the frontier planner's solve time grows with the pipeline (issue 21).

Three measurements, each of ours in one process:

* growth (printed by ``make bench``): ``gpt3-175b+a100_sxm``, 8 stages, 1F1B, 1 ms unit,
  24 / 48 / 96 / 192 microbatches. Solve time (``compute_frontier`` alone: the problem is
  built and the kernels loaded before) and its ratio to 24 microbatches, medians over
  interleaved rounds, in wall and process CPU time (the ratio is taken on CPU time, which
  the other processes of a shared machine disturb less), beside the numbers issue 21
  measured before the solver kept its flow and cut from step to step. The old algorithm
  (``iterate_frontier(..., keep_flow=False)``) runs too, on the sizes where it takes
  seconds, and must give the same frontier.
* 16 stages x 128 microbatches (``--large``): no bundled profile has 16 stages, so one is
  derived from ``gpt3-175b+a100_sxm``: each stage ``s`` becomes stages ``2s`` and
  ``2s + 1``, each with half the time and half the energy of ``s`` at every clock (the
  same model split in two). Blocking power stays per GPU. Wall time must stay within the
  operator's default planner time limit; memory is reported as the tracemalloc peak of
  the solve and the process's maximum RSS. The old algorithm then solves it too (~20 s) and
  must give the same frontier.

Run from the repository root::

    python benchmarks/planner_scale.py            # the growth table
    python benchmarks/planner_scale.py --large    # 16 stages x 128 microbatches

Exit status: 1 when a frontier differs from the old algorithm's or from the point counts
the issue measured, or when the 16-stage case exceeds the time limit; 0 otherwise. The
growth target (192 within 10x of 24) is reported, not enforced: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROFILE = "gpt3-175b+a100_sxm"
NUM_STAGES = 8
MICROBATCHES = (24, 48, 96, 192)
REFERENCE_UP_TO = 48  # the old algorithm's 96 and 192 take 5-40 s more here
GROWTH_TARGET = 10.0

# Issue 21: `perseus plan`, bundled GPT-3 A100 profile, 8 stages, 1 ms, before this change.
ISSUE_TODAY = {24: (1048, 0.70), 48: (1864, 2.99), 96: (3496, 11.3), 192: (6760, 36.5)}

SPLIT_STAGES = 16
SPLIT_MICROBATCHES = 128
PLANNER_TIME_LIMIT_S = 600.0  # the operator's default PERSEUS_OPERATOR_PLANNER_TIMEOUT_S
MIB = 1024 * 1024


def import_planner() -> ModuleType:
    """Import ``perseus_planner`` (from ``<repo>/operator`` if not installed)."""
    if importlib.util.find_spec("perseus_planner") is None:
        sys.path.insert(0, str(REPO / "operator"))
    import perseus_planner

    return perseus_planner


@dataclass
class Row:
    microbatches: int
    points: int
    solve_s: float  # median wall time
    cpu_s: float  # median process CPU time
    reference_s: float | None


ROUNDS = 7  # every size once a round, rounds interleaved: load shifts hit all sizes alike
SMALL_REPEAT = 3  # runs a round for sizes that take well under a second


def timed(run: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall and process CPU time of one run, and its result."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def frontier_key(points: Sequence[Any]) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """What must agree point for point: time, energy to the micro-joule, the cut."""
    return [
        (p.quant_time, round(p.energy_j * 1e6), tuple(p.sped_up.tolist()), tuple(p.slowed_down))
        for p in points
    ]


def growth(pp: ModuleType) -> tuple[list[Row], list[str]]:
    """Solve every size; return the rows and the problems found."""
    bundled = pp.bundled_profile(PROFILE)
    profile = pp.load_profile(bundled.path)
    problems: list[str] = []
    # Load the numba kernels first, so that no size pays for them.
    warmup = pp.build_problem(
        profile, pp.build_pipeline_dag("1f1b", NUM_STAGES, 2), bundled.unit_time_s, 0.0
    )
    pp.compute_frontier(warmup)
    list(pp.iterate_frontier(warmup, keep_flow=False))
    built = {
        mb: pp.build_problem(
            profile,
            pp.build_pipeline_dag("1f1b", NUM_STAGES, mb),
            bundled.unit_time_s,
            bundled.blocking_power_w,
        )
        for mb in MICROBATCHES
    }
    walls: dict[int, list[float]] = {mb: [] for mb in MICROBATCHES}
    cpus: dict[int, list[float]] = {mb: [] for mb in MICROBATCHES}
    points: dict[int, int] = {}
    for _ in range(ROUNDS):
        for mb, problem in built.items():
            for _ in range(SMALL_REPEAT if mb <= 48 else 1):
                wall, cpu, frontier = timed(lambda p=problem: pp.compute_frontier(p))
                walls[mb].append(wall)
                cpus[mb].append(cpu)
                points[mb] = len(frontier)
    rows: list[Row] = []
    for mb, problem in built.items():
        ref_s: float | None = None
        if mb <= REFERENCE_UP_TO:
            ref_s, _, ref_points = timed(
                lambda p=problem: list(pp.iterate_frontier(p, keep_flow=False))
            )
            ours = frontier_key(list(pp.iterate_frontier(problem)))
            if ours != frontier_key(ref_points):
                problems.append(f"{mb} microbatches: the frontier differs from the old algorithm's")
        expected = ISSUE_TODAY[mb][0]
        if points[mb] != expected:
            problems.append(f"{mb} microbatches: {points[mb]} points, the issue had {expected}")
        row = Row(mb, points[mb], statistics.median(walls[mb]), statistics.median(cpus[mb]), ref_s)
        rows.append(row)
        log(
            f"{mb} microbatches: {row.points:,} points in {row.solve_s:.3f} s wall, "
            f"{row.cpu_s:.3f} s CPU (medians of {len(walls[mb])})"
        )
    return rows, problems


def print_growth(rows: Sequence[Row]) -> float:
    """Print the growth table; return the 192/24 solve-time ratio (CPU time medians)."""
    base = rows[0]
    print(
        f"\nSolve time vs pipeline size ({PROFILE}, {NUM_STAGES} stages, 1F1B, 1 ms): "
        f"compute_frontier alone (problem built, kernels loaded), medians over {ROUNDS} "
        f"interleaved rounds ({SMALL_REPEAT} runs a round up to 48 microbatches); ratios of "
        "process CPU time, which other processes on a shared machine disturb less than wall time:"
    )
    headers = (
        "microbatches",
        "points",
        "wall s",
        "CPU s",
        "ratio to 24 (CPU)",
        "ratio (wall)",
        "old algorithm s (here)",
        "issue 21: points",
        "issue 21: s",
        "issue 21: ratio",
    )
    table = []
    for r in rows:
        today_points, today_s = ISSUE_TODAY[r.microbatches]
        table.append(
            [
                str(r.microbatches),
                f"{r.points:,}",
                f"{r.solve_s:.3f}",
                f"{r.cpu_s:.3f}",
                f"{r.cpu_s / base.cpu_s:.1f}x",
                f"{r.solve_s / base.solve_s:.1f}x",
                "-" if r.reference_s is None else f"{r.reference_s:.3f}",
                f"{today_points:,}",
                f"{today_s:.2f}",
                f"{today_s / ISSUE_TODAY[base.microbatches][1]:.1f}x",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    last = rows[-1]
    ratio = last.cpu_s / base.cpu_s
    points = last.points / base.points
    print(
        f"{last.microbatches} vs {base.microbatches} microbatches: {points:.2f}x the points, "
        f"{ratio:.1f}x the CPU time ({last.solve_s / base.solve_s:.1f}x wall; "
        f"{last.cpu_s / last.points * 1e6:.0f} vs {base.cpu_s / base.points * 1e6:.0f} µs/point)."
    )
    verdict = "met" if ratio <= GROWTH_TARGET else "NOT met"
    print(
        f"Target {last.microbatches} within {GROWTH_TARGET:.0f}x of {base.microbatches}: {verdict}."
    )
    for r in rows:
        if r.reference_s is not None:
            print(
                f"{r.microbatches} microbatches: old algorithm {r.reference_s:.3f} s, now "
                f"{r.solve_s:.3f} s ({r.reference_s / r.solve_s:.1f}x faster), same frontier."
            )
    return ratio


def split_profile(pp: ModuleType, name: str) -> Any:
    """A ``2S``-stage profile from an ``S``-stage one: each stage halved in time and energy."""
    bundled = pp.bundled_profile(name)
    lines = Path(bundled.path).read_text(encoding="utf-8-sig").splitlines()
    header = [c.strip() for c in lines[0].split(",")]
    col = {c: i for i, c in enumerate(header)}
    out = [lines[0]]
    for line in lines[1:]:
        if not line.strip():
            continue
        cells = line.split(",")
        stage = int(cells[col["stage"]])
        for half in (0, 1):
            new = list(cells)
            new[col["stage"]] = str(2 * stage + half)
            new[col["time"]] = repr(float(cells[col["time"]]) / 2)
            new[col["energy"]] = repr(float(cells[col["energy"]]) / 2)
            out.append(",".join(new))
    return pp.parse_profile("\n".join(out) + "\n", f"{bundled.path.name}, stages split in two")


def max_rss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss if sys.platform == "darwin" else rss * 1024) / MIB


def main_large(pp: ModuleType) -> int:
    bundled = pp.bundled_profile(PROFILE)
    profile = split_profile(pp, PROFILE)
    print(
        f"{SPLIT_STAGES} stages x {SPLIT_MICROBATCHES} microbatches, 1F1B, 1 ms, "
        f"{bundled.blocking_power_w:g} W: {PROFILE} with each stage split into two stages of "
        "half its time and energy."
    )
    start = time.perf_counter()
    dag = pp.build_pipeline_dag("1f1b", SPLIT_STAGES, SPLIT_MICROBATCHES)
    problem = pp.build_problem(profile, dag, 0.001, bundled.blocking_power_w)
    mid = time.perf_counter()
    frontier = pp.compute_frontier(problem)
    end = time.perf_counter()
    rss = max_rss_mib()
    log(f"{len(frontier):,} points; setup {mid - start:.3f} s, solve {end - mid:.3f} s")
    log("memory run (tracemalloc, untimed) ...")
    gc.collect()
    tracemalloc.start()
    pp.compute_frontier(pp.build_problem(profile, dag, 0.001, bundled.blocking_power_w))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    wall = end - start
    print(
        f"\n{SPLIT_STAGES}x{SPLIT_MICROBATCHES}: {dag.num_nodes:,} computations, "
        f"{len(frontier):,} points, {wall:.2f} s wall (first run in the process: setup, loading "
        f"the numba kernels, {end - mid:.2f} s solve, "
        f"{(end - mid) / len(frontier) * 1e6:.0f} µs/point); "
        f"tracemalloc peak {peak / MIB:.1f} MiB, max RSS {max(rss, max_rss_mib()):.1f} MiB"
    )
    log("the old algorithm (keep_flow=False) on the same problem ...")
    ref_start = time.perf_counter()
    reference = frontier_key(list(pp.iterate_frontier(problem, keep_flow=False)))
    ref_s = time.perf_counter() - ref_start
    same = reference == frontier_key(list(pp.iterate_frontier(problem)))
    print(
        f"old algorithm: {ref_s:.2f} s solve ({ref_s / (end - mid):.1f}x the time), "
        + ("same frontier." if same else "FRONTIER DIFFERS.")
    )
    status = 0 if same else 1
    if wall > PLANNER_TIME_LIMIT_S:
        print(f"FAIL: over the planner time limit of {PLANNER_TIME_LIMIT_S:.0f} s")
        return 1
    print(f"OK: within the planner time limit of {PLANNER_TIME_LIMIT_S:.0f} s.")
    return status


def run_growth(pp: ModuleType) -> int:
    """The growth table with its checks; what ``make bench`` adds after the lowtime comparison."""
    rows, problems = growth(pp)
    print_growth(rows)
    for p in problems:
        print(f"FRONTIER MISMATCH: {p}")
    return 1 if problems else 0


def log(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--large",
        action="store_true",
        help=f"{SPLIT_STAGES} stages x {SPLIT_MICROBATCHES} microbatches, not the growth table",
    )
    args = parser.parse_args(argv)
    pp = import_planner()
    if args.large:
        return main_large(pp)
    return run_growth(pp)


if __name__ == "__main__":
    sys.exit(main())
