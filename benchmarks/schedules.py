"""Pipeline schedules side by side: intrinsic savings, solve time and peak memory.

For the bundled A100 profiles (GPT-3 175B and Bloom 176B, bf16, 8 stages; the Perseus
artifact's measurements, Apache-2.0, see ``perseus_planner/profiles/``) and each schedule,
1F1B, interleaved 1F1B with 2 virtual stages and ZB-H1, the script plans ``T_min`` and
reports what the "Pipeline schedules" table of docs/user-guide/planning.md shows: the intrinsic
energy savings at ``T_min`` vs. every GPU at max clock at the same iteration time, per granularity.
The interleaved and zero-bubble profiles are derived from the per-GPU ones exactly as
``perseus plan`` derives them (:mod:`perseus_planner.model_stages`: each stage split into 2
virtual stages of half its time and energy; each backward split into equal input and weight
halves).

Then it times the whole planning path (derive profile, build the DAG and the problem, solve
the frontier) and measures its peak traced Python memory (``tracemalloc``) for every schedule
at the same sizes, each beside 1F1B as a ratio. Run from the repository root::

    python benchmarks/schedules.py                      # savings table + benchmark, 24 and 48 MB
    python benchmarks/schedules.py --table-only         # the user guide's table only
    python benchmarks/schedules.py --microbatches 24 96 --repeat 3
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from dataclasses import dataclass

from perseus_api.plan import Granularity
from perseus_planner import (
    build_plan,
    bundled_profile,
    choose_point,
    compute_frontier,
    derive_profile,
    max_frequency_baseline,
    prepare_problem,
)

PROFILES = ("gpt3-175b+a100_sxm", "bloom+a100_sxm")
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))
NUM_STAGES = 8
TABLE_MICROBATCHES = 24  # a multiple of 8, as interleaved 1F1B needs


@dataclass(frozen=True)
class Outcome:
    """One planned schedule."""

    profile: str
    schedule: str
    virtual_stages: int
    microbatches: int
    computations: int
    frontier_points: int
    t_min_s: float
    all_max_s: float
    instruction_savings: float
    stage_savings: float
    seconds: float
    peak_mib: float


def plan(profile_name: str, schedule: str, virtual: int, microbatches: int) -> Outcome:
    """Derive, solve and plan ``T_min``; time and trace the derive-and-solve part."""
    bundled = bundled_profile(profile_name)
    measured = bundled.load()
    gc.collect()
    tracemalloc.start()
    start_s = time.perf_counter()
    problem = prepare_problem(
        derive_profile(measured, schedule, virtual),
        schedule,
        NUM_STAGES,
        microbatches,
        bundled.unit_time_s,
        bundled.blocking_power_w,
        virtual_stages=virtual,
    )
    frontier = compute_frontier(problem)
    seconds = time.perf_counter() - start_s
    _, peak_b = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    baseline = max_frequency_baseline(problem)
    result = build_plan(frontier, baseline, choose_point(frontier), Granularity.INSTRUCTION)
    return Outcome(
        profile=profile_name,
        schedule=schedule,
        virtual_stages=virtual,
        microbatches=microbatches,
        computations=problem.dag.num_nodes,
        frontier_points=len(frontier),
        t_min_s=result.t_min_s,
        all_max_s=baseline.time_s,
        instruction_savings=result.instruction_estimate.savings_ratio,
        stage_savings=result.stage_estimate.savings_ratio,
        seconds=seconds,
        peak_mib=peak_b / 2**20,
    )


def _name(schedule: str, virtual: int) -> str:
    return f"{schedule} (V={virtual})" if virtual > 1 else schedule


def savings_table() -> str:
    """The user guide's table (markdown), computed now."""
    lines = [
        "| profile | schedule | T_min (s) | all max clock (s) | saved, Instruction | "
        "saved, Stage |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for profile_name in PROFILES:
        for schedule, virtual in SCHEDULES:
            o = plan(profile_name, schedule, virtual, TABLE_MICROBATCHES)
            lines.append(
                f"| {profile_name} | {_name(schedule, virtual)} | {o.t_min_s:.3f} | "
                f"{o.all_max_s:.3f} | {100 * o.instruction_savings:.2f} % | "
                f"{100 * o.stage_savings:.2f} % |"
            )
    return "\n".join(lines)


def benchmark(microbatches: list[int], repeat: int) -> str:
    """Best-of-``repeat`` time and peak memory per schedule, each beside 1F1B's."""
    header = (
        f"{'profile':<20}{'M':>4} {'schedule':<22}{'nodes':>6}{'points':>7}"
        f"{'time (s)':>10}{'x 1F1B':>8}{'peak MiB':>10}{'x 1F1B':>8}"
    )
    lines = [header, "-" * len(header)]
    for profile_name in PROFILES:
        for m in microbatches:
            reference: Outcome | None = None
            for schedule, virtual in SCHEDULES:
                runs = [plan(profile_name, schedule, virtual, m) for _ in range(repeat)]
                best = min(runs, key=lambda o: o.seconds)
                peak = max(o.peak_mib for o in runs)
                reference = reference or best
                lines.append(
                    f"{profile_name:<20}{m:>4} {_name(schedule, virtual):<22}"
                    f"{best.computations:>6}{best.frontier_points:>7}{best.seconds:>10.2f}"
                    f"{best.seconds / reference.seconds:>8.2f}{peak:>10.1f}"
                    f"{peak / reference.peak_mib:>8.2f}"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table-only", action="store_true", help="print the savings table only")
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        default=[24, 48],
        help="benchmark sizes (multiples of 8; default: 24 48)",
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs per case (best time kept)")
    args = parser.parse_args()
    print(f"Intrinsic savings at T_min, {NUM_STAGES} stages, {TABLE_MICROBATCHES} microbatches:")
    print(savings_table())
    if not args.table_only:
        print("\nPlanning time (derive + DAG + problem + frontier) and tracemalloc peak:")
        print(benchmark(args.microbatches, args.repeat))


if __name__ == "__main__":
    main()
