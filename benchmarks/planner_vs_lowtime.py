"""Side-by-side benchmark: this project's frontier planner against lowtime 0.3.0.

Both implementations solve the same problem in one process: the iteration
time–energy frontier of a synchronous 1F1B pipeline, from a bundled per-stage
GPU profile, by Phillips–Dessouky steps of one time unit. The script checks that
the two frontiers are identical and prints the wall-time ratio.

Each implementation is timed end to end: reading the profile CSV, building the
execution options, fitting the cost models, building the DAG and solving.

* cold: the first run in the process (for ours this includes loading, or
  compiling, the numba kernels);
* warm: the median of ``--repeat`` further runs;
* memory: one more, untimed run under ``tracemalloc`` (Python-heap peak), plus
  the process's maximum resident set size from ``getrusage``.

lowtime is driven through its public API the way the Perseus artifact drives it
(``CandidateExecutionOptions``, a softer refilter with ``noise_factor=0.95``
when three or fewer options remain, effective cost, ``ExponentialModel``, a
``Synchronous1F1B`` DAG, ``PhillipsDessouky(dag).run()``).

Run from the repository root::

    python benchmarks/planner_vs_lowtime.py            # 8 stages x 24 microbatches, A100
    python benchmarks/planner_vs_lowtime.py --large    # A40, 96 microbatches, 0.1 ms: ours only

After the comparison the default run prints how our solve time grows with the number of
microbatches (``planner_scale.py``; ``--no-growth`` skips it).

Exit status: 0 on success, 1 when the frontiers differ or the large case is too slow.
"""

from __future__ import annotations

import argparse
import csv
import gc
import importlib.util
import itertools
import logging
import os
import resource
import statistics
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]

LARGE_PROFILE = "gpt3-175b+a40"
LARGE_MICROBATCHES = 96
LARGE_UNIT_TIME_S = 0.0001
LARGE_TIME_LIMIT_S = 15.0  # issue 21's target; was 600 s when the case took 110 s
PROGRESS_EVERY = 5000

ENERGY_RTOL = 1e-9
SOFT_FILTER_NOISE = 0.95  # lowtime refilter, as the Perseus artifact does
MIN_OPTIONS_BEFORE_SOFT_FILTER = 3

MIB = 1024 * 1024


# --------------------------------------------------------------------------- setup


def import_planner() -> tuple[ModuleType, float]:
    """Import ``perseus_planner`` (from ``<repo>/operator`` if not installed)."""
    if importlib.util.find_spec("perseus_planner") is None:
        sys.path.insert(0, str(REPO / "operator"))
    start = time.perf_counter()
    import perseus_planner

    return perseus_planner, time.perf_counter() - start


def import_lowtime() -> tuple[dict[str, Any], float]:
    """Import the parts of lowtime's public API the benchmark uses, quietly."""
    os.environ.setdefault("MPLBACKEND", "Agg")  # lowtime.cost_model imports pyplot
    start = time.perf_counter()
    try:
        import networkx as nx
        from lowtime import __version__
        from lowtime.cost_model import ExponentialModel
        from lowtime.graph_utils import DependencyResolver, add_sink_node, add_source_node
        from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
        from lowtime.perseus.instruction import (
            Backward,
            Forward,
            Instruction,
            backward_dep,
            forward_dep,
        )
        from lowtime.perseus.schedule import Synchronous1F1B
        from lowtime.solver import PhillipsDessouky
    except ImportError as exc:
        raise SystemExit(
            f"error: cannot import lowtime ({exc}); install it with "
            "`pip install lowtime==0.3.0` or run with --skip-lowtime"
        ) from exc
    elapsed = time.perf_counter() - start
    logging.getLogger("lowtime").setLevel(logging.ERROR)
    api = {
        "version": __version__,
        "nx": nx,
        "ExponentialModel": ExponentialModel,
        "DependencyResolver": DependencyResolver,
        "add_sink_node": add_sink_node,
        "add_source_node": add_source_node,
        "CandidateExecutionOptions": CandidateExecutionOptions,
        "ExecutionOption": ExecutionOption,
        "OperationSpec": OperationSpec,
        "Backward": Backward,
        "Forward": Forward,
        "Instruction": Instruction,
        "backward_dep": backward_dep,
        "forward_dep": forward_dep,
        "Synchronous1F1B": Synchronous1F1B,
        "PhillipsDessouky": PhillipsDessouky,
    }
    return api, elapsed


@dataclass(frozen=True)
class Case:
    """What both implementations solve."""

    profile_name: str
    path: Path
    num_stages: int
    microbatches: int
    unit_time_s: float
    blocking_power_w: float

    def describe(self) -> str:
        return (
            f"{self.profile_name} ({self.path.name}): {self.num_stages} stages x "
            f"{self.microbatches} microbatches, 1F1B, unit {self.unit_time_s:g} s, "
            f"blocking power {self.blocking_power_w:g} W"
        )


@dataclass
class Run:
    """One timed run: wall times and the frontier it produced."""

    setup_s: float
    solve_s: float
    times_s: list[float]
    energies_j: list[float]

    @property
    def total_s(self) -> float:
        return self.setup_s + self.solve_s


@dataclass
class Result:
    """Everything measured for one implementation."""

    name: str
    cold: Run
    warm: list[Run]
    tracemalloc_peak_b: int | None
    max_rss_b: int

    @property
    def frontier(self) -> Run:
        return self.cold

    def warm_median(self, attr: str) -> float | None:
        if not self.warm:
            return None
        return float(statistics.median(float(getattr(r, attr)) for r in self.warm))


# ----------------------------------------------------------------------- the runs


def run_ours(pp: ModuleType, case: Case, on_point: Callable[[Any], None] | None = None) -> Run:
    """This project: profile -> options -> fit -> tables (``build_problem``), then solve."""
    start = time.perf_counter()
    profile = pp.load_profile(case.path)
    dag = pp.build_pipeline_dag("1f1b", case.num_stages, case.microbatches)
    problem = pp.build_problem(profile, dag, case.unit_time_s, case.blocking_power_w)
    mid = time.perf_counter()
    frontier = pp.compute_frontier(problem, on_point)
    end = time.perf_counter()
    return Run(mid - start, end - mid, frontier.times_s.tolist(), frontier.energies_j.tolist())


def _read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


def run_lowtime(lt: dict[str, Any], case: Case) -> Run:
    """lowtime 0.3.0 through its public API, set up as the Perseus artifact does."""
    start = time.perf_counter()
    rows = _read_rows(case.path)
    forward, backward = lt["Forward"], lt["Backward"]
    spec_map: dict[int, dict[type, Any]] = {s: {} for s in range(case.num_stages)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # curve_fit covariance / exp overflow chatter
        for instruction in (forward, backward):
            name = instruction.__name__.lower()
            for stage in range(case.num_stages):
                options = [
                    lt["ExecutionOption"](
                        real_time=float(r["time"]),
                        unit_time=case.unit_time_s,
                        cost=float(r["energy"]),
                        knob=int(r["frequency"]),
                    )
                    for r in rows
                    if int(r["stage"]) == stage and r["instruction"].strip().lower() == name
                ]
                cand = lt["CandidateExecutionOptions"](options=options)
                if len(cand.options) <= MIN_OPTIONS_BEFORE_SOFT_FILTER:
                    cand = lt["CandidateExecutionOptions"](
                        options=options, noise_factor=SOFT_FILTER_NOISE
                    )
                for option in cand.options:  # effective energy
                    option.cost -= case.blocking_power_w * option.quant_time * option.unit_time
                model = lt["ExponentialModel"](cand)
                spec_map[stage][instruction] = lt["OperationSpec"](options=cand, cost_model=model)

    nx = lt["nx"]
    dag = nx.DiGraph()
    node_id = 2  # 0 and 1 are the source and sink
    for stage in range(case.num_stages):
        stage_nodes: list[int] = []
        for inst in lt["Synchronous1F1B"](
            num_stages=case.num_stages,
            num_micro_batches=case.microbatches,
            stage_id=stage,
            operation_spec_map=spec_map[stage],
        ):
            dag.add_node(node_id, op=inst)
            stage_nodes.append(node_id)
            node_id += 1
        for u, v in itertools.pairwise(stage_nodes):
            dag.add_edge(u, v)
    resolver = lt["DependencyResolver"](
        dependency_rules=[lt["forward_dep"], lt["backward_dep"]], node_type=lt["Instruction"]
    )
    insts = list(dag.nodes(data=True))
    for (id1, data1), (id2, data2) in itertools.product(insts, insts):
        if resolver.is_dependent(data1["op"], data2["op"]):
            dag.add_edge(id1, id2)
    lt["add_source_node"](dag, 0)
    lt["add_sink_node"](dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1
    mid = time.perf_counter()

    times: list[float] = []
    energies: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for result in lt["PhillipsDessouky"](dag).run():
            times.append(float(result.real_time))
            energy = result.cost + case.num_stages * result.real_time * case.blocking_power_w
            energies.append(float(energy))
    end = time.perf_counter()
    return Run(mid - start, end - mid, times, energies)


@contextmanager
def traced() -> Iterator[list[int]]:
    """Trace Python allocations in the block; yields a list that receives the peak (bytes)."""
    peak: list[int] = []
    gc.collect()
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def max_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def measure(
    name: str,
    run: Callable[[], Run],
    repeat: int,
    memory: bool,
    after_cold: Callable[[], None] | None = None,
) -> Result:
    """Cold run, ``repeat`` warm runs, then an untimed tracemalloc run."""
    gc.collect()
    log(f"{name}: cold run ...")
    cold = run()
    log(f"{name}: cold {cold.total_s:.3f} s, {len(cold.times_s)} points")
    if after_cold is not None:
        after_cold()
    warm: list[Run] = []
    for i in range(repeat):
        gc.collect()
        r = run()
        warm.append(r)
        log(f"{name}: warm run {i + 1}/{repeat}: {r.total_s:.3f} s")
        if r.times_s != cold.times_s or r.energies_j != cold.energies_j:
            raise SystemExit(f"error: {name} is not deterministic: warm run {i + 1} differs")
    peak: int | None = None
    if memory:
        log(f"{name}: memory run (tracemalloc, untimed) ...")
        with traced() as box:
            run()
        peak = box[0]
    return Result(name, cold, warm, peak, max_rss_bytes())


# ---------------------------------------------------------------------- checking


def compare(ours: Run, theirs: Run) -> list[str]:
    """Problems found comparing our frontier (minus its T_max start point) with lowtime's."""
    ot, oe = ours.times_s[1:], ours.energies_j[1:]
    lt_t, lt_e = theirs.times_s, theirs.energies_j
    problems: list[str] = []
    if len(ot) != len(lt_t):
        problems.append(
            f"point count differs: ours has {len(ot)} after its T_max start point, "
            f"lowtime has {len(lt_t)}"
        )
    for i, (a, b) in enumerate(zip(ot, lt_t, strict=False)):
        if a != b:
            problems.append(f"first time mismatch at point {i + 1}: ours {a!r} s, lowtime {b!r} s")
            break
    worst, worst_i = 0.0, -1
    for i, (a, b) in enumerate(zip(oe, lt_e, strict=False)):
        rel = abs(a - b) / max(abs(a), abs(b), 1e-300)
        if rel > worst:
            worst, worst_i = rel, i
    if worst > ENERGY_RTOL:
        problems.append(
            f"energy differs beyond rtol {ENERGY_RTOL:g}: worst at point {worst_i + 1}: "
            f"ours {oe[worst_i]!r} J, lowtime {lt_e[worst_i]!r} J (rel {worst:.3g})"
        )
    return problems


def max_energy_rel_diff(ours: Run, theirs: Run) -> float:
    pairs = zip(ours.energies_j[1:], theirs.energies_j, strict=False)
    return max((abs(a - b) / max(abs(a), abs(b), 1e-300) for a, b in pairs), default=0.0)


# ---------------------------------------------------------------------- reporting


def kernel_modules() -> list[ModuleType]:
    """The planner's numba-compiled modules: the reference step and the warm-started one."""
    from perseus_planner import _costs, _kept_cut, _kernel, _source_side, _warm

    return [_kernel, _warm, _source_side, _kept_cut, _costs]


def numba_cache_on_disk() -> str:
    """Say whether compiled kernels are already cached on disk (before the first call)."""
    modules = kernel_modules()
    cache_dir = os.environ.get("NUMBA_CACHE_DIR")
    where = Path(cache_dir) if cache_dir else Path(modules[0].__file__ or "").parent / "__pycache__"
    names = [m.__name__.rsplit(".", 1)[-1] for m in modules]
    found = [f for n in names for f in sorted(where.rglob(f"{n}.*.nbi"))] if where.is_dir() else []
    if found:
        return f"numba cache: {len(found)} kernel index file(s) already on disk in {where}"
    return f"numba cache: none on disk in {where} (the cold run compiles the kernels)"


def numba_cache_stats() -> str:
    hits = misses = 0
    kernels = {id(o): o for m in kernel_modules() for o in vars(m).values()}  # some import others'
    for obj in kernels.values():
        stats = getattr(obj, "stats", None)
        if stats is not None and hasattr(stats, "cache_hits"):
            hits += sum(stats.cache_hits.values())
            misses += sum(stats.cache_misses.values())
    return (
        f"numba after the cold run: {hits} kernel(s) loaded from the disk cache, "
        f"{misses} compiled (cache miss)"
    )


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def fmt_mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(
        h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(headers)
    )
    print(line)
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(
            "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
        )


def result_row(res: Result, note: str = "") -> list[str]:
    f = res.frontier
    return [
        res.name + note,
        str(len(f.times_s)),
        f"{min(f.times_s):.4f}" if f.times_s else "-",
        f"{max(f.times_s):.4f}" if f.times_s else "-",
        fmt_s(res.cold.total_s),
        fmt_s(res.warm_median("total_s")),
        fmt_mib(res.tracemalloc_peak_b),
        fmt_mib(res.max_rss_b),
    ]


TABLE_HEADERS = (
    "implementation",
    "points",
    "T_min s",
    "T_max s",
    "cold s",
    "warm s",
    "tracemalloc peak MiB",
    "max RSS MiB",
)


def print_breakdown(ours: Result) -> None:
    points = max(len(ours.frontier.times_s) - 1, 1)  # solver steps after the start point
    print("\nWhere our time goes (setup = load_profile + build_pipeline_dag + build_problem,")
    print("solve = compute_frontier):")
    rows = [
        [
            "cold",
            fmt_s(ours.cold.setup_s),
            fmt_s(ours.cold.solve_s),
            f"{ours.cold.solve_s / points * 1e6:.0f}",
        ]
    ]
    if ours.warm:
        setup, solve = ours.warm_median("setup_s"), ours.warm_median("solve_s")
        assert setup is not None and solve is not None
        rows.append(
            [
                f"warm (median of {len(ours.warm)})",
                fmt_s(setup),
                fmt_s(solve),
                f"{solve / points * 1e6:.0f}",
            ]
        )
    print_table(("run", "setup s", "solve s", "solve µs/point"), rows)


def print_lowtime_breakdown(res: Result) -> None:
    points = max(len(res.frontier.times_s), 1)
    if res.warm:
        label = f"warm, median of {len(res.warm)}"
        setup, solve = res.warm_median("setup_s"), res.warm_median("solve_s")
        assert setup is not None and solve is not None
    else:
        label, setup, solve = "cold", res.cold.setup_s, res.cold.solve_s
    print(
        f"{res.name} ({label}): setup {setup:.3f} s (CSV, options, fits, DAG), "
        f"solve {solve:.3f} s, {solve / points * 1e6:.0f} µs/point"
    )


# ---------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None, profile_names: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run this project's frontier planner and lowtime 0.3.0 on the same "
        "inputs, check the frontiers are identical and compare wall time.",
    )
    parser.add_argument(
        "--profile",
        choices=profile_names,
        default=None,
        help="bundled profile (default gpt3-175b+a100_sxm; gpt3-175b+a40 with --large)",
    )
    parser.add_argument(
        "--microbatches", type=int, default=None, help="default 24 (96 with --large)"
    )
    parser.add_argument(
        "--unit-time", type=float, default=None, help="seconds; default: the profile's setting"
    )
    parser.add_argument(
        "--blocking-power", type=float, default=None, help="W; default: the profile's setting"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="warm runs per implementation (not with --large)"
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help=f"A40 GPT-3, {LARGE_MICROBATCHES} microbatches, unit {LARGE_UNIT_TIME_S:g} s "
        f"(~65,000 points); ours only, must finish within {LARGE_TIME_LIMIT_S:.0f} s",
    )
    parser.add_argument(
        "--with-lowtime", action="store_true", help="with --large: run lowtime too (hours)"
    )
    parser.add_argument("--skip-lowtime", action="store_true", help="run only ours")
    parser.add_argument(
        "--no-growth",
        action="store_true",
        help="skip the solve time vs microbatches table (planner_scale.py)",
    )
    parser.add_argument(
        "--no-tracemalloc", action="store_true", help="skip the extra tracemalloc run"
    )
    args = parser.parse_args(argv)
    if args.repeat < 0:
        parser.error("--repeat must be >= 0")
    if args.microbatches is not None and args.microbatches < 1:
        parser.error("--microbatches must be >= 1")
    if args.with_lowtime and args.skip_lowtime:
        parser.error("--with-lowtime and --skip-lowtime contradict each other")
    return args


def resolve_case(pp: ModuleType, args: argparse.Namespace) -> Case:
    name = args.profile or (LARGE_PROFILE if args.large else pp.DEFAULT_PROFILE)
    bundled = pp.bundled_profile(name)
    unit = args.unit_time
    if unit is None:
        unit = LARGE_UNIT_TIME_S if args.large else bundled.unit_time_s
    power = args.blocking_power if args.blocking_power is not None else bundled.blocking_power_w
    microbatches = args.microbatches or (LARGE_MICROBATCHES if args.large else 24)
    num_stages = pp.load_profile(bundled.path).num_stages
    return Case(name, bundled.path, num_stages, microbatches, unit, power)


def log(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    pp, planner_import_s = import_planner()
    args = parse_args(argv, sorted(pp.BUNDLED_PROFILES))
    case = resolve_case(pp, args)
    run_lt = args.with_lowtime if args.large else not args.skip_lowtime
    memory = not args.no_tracemalloc

    print(f"Case: {case.describe()}")
    print(
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPU(s); import perseus_planner "
        f"{planner_import_s:.2f} s"
    )
    print(numba_cache_on_disk())
    if args.large:
        return main_large(pp, case, args, run_lt, memory)

    print(
        f"Timing: cold = first run in this process, warm = median of {args.repeat} more; "
        "both include CSV parsing, options, fits and the solve."
    )
    ours = measure(
        "ours",
        lambda: run_ours(pp, case),
        args.repeat,
        memory,
        after_cold=lambda: log(numba_cache_stats()),
    )
    theirs: Result | None = None
    if run_lt:
        lt, lt_import_s = import_lowtime()
        log(f"imported lowtime {lt['version']} in {lt_import_s:.2f} s")
        theirs = measure(
            f"lowtime {lt['version']}", lambda: run_lowtime(lt, case), args.repeat, memory
        )
    status = report(ours, theirs, memory)
    if not args.no_growth:
        import planner_scale  # next to this script, on sys.path when it runs

        status = max(status, planner_scale.run_growth(pp))
    return status


def report(ours: Result, theirs: Result | None, memory: bool) -> int:
    status = 0
    print()
    if theirs is not None:
        problems = compare(ours.frontier, theirs.frontier)
        if problems:
            print("FRONTIERS DIFFER:")
            for p in problems:
                print(f"  - {p}")
            status = 1
        else:
            worst = max_energy_rel_diff(ours.frontier, theirs.frontier)
            print(
                f"Frontiers identical: {len(theirs.frontier.times_s)} points (ours minus its "
                f"T_max start point), times exactly equal, energies within rtol "
                f"{ENERGY_RTOL:g} (max rel diff {worst:.1e})."
            )
    print()
    rows = [result_row(ours, " (incl. T_max start)" if theirs is not None else "")]
    if theirs is not None:
        rows.append(result_row(theirs))
    print_table(TABLE_HEADERS, rows)
    print(
        "max RSS is the process high-water mark when that implementation finished (ours ran first);"
    )
    print(
        "tracemalloc sees the Python heap and numpy arrays, not numba's or Rust's own allocations."
        if memory
        else "tracemalloc run skipped (--no-tracemalloc)."
    )
    if theirs is not None:
        print()
        ow, tw = ours.warm_median("total_s"), theirs.warm_median("total_s")
        if ow is not None and tw is not None:
            print(f"speedup (lowtime / ours), warm: {tw / ow:.1f}x  ({tw:.3f} s / {ow:.3f} s)")
        print(
            f"speedup (lowtime / ours), cold: {theirs.cold.total_s / ours.cold.total_s:.1f}x  "
            f"({theirs.cold.total_s:.3f} s / {ours.cold.total_s:.3f} s)"
        )
    print_breakdown(ours)
    if theirs is not None:
        print_lowtime_breakdown(theirs)
    return status


def main_large(
    pp: ModuleType, case: Case, args: argparse.Namespace, run_lt: bool, memory: bool
) -> int:
    problem = pp.build_problem(
        pp.load_profile(case.path),
        pp.build_pipeline_dag("1f1b", case.num_stages, case.microbatches),
        case.unit_time_s,
        case.blocking_power_w,
    )
    t_max = problem.makespan(problem.slowest_durations)
    t_min = problem.makespan(problem.fastest_durations)
    del problem
    print(
        f"Large case: T_max {t_max} units, all-fastest makespan {t_min} units, so at most "
        f"{t_max - t_min + 1:,} points."
    )
    print(
        "One run of ours (first call in the process, includes numba kernel loading), "
        f"progress every {PROGRESS_EVERY:,} points:"
    )

    start = time.perf_counter()

    def progress(point: Any) -> None:
        if point.iteration % PROGRESS_EVERY == 0 and point.iteration:
            elapsed = time.perf_counter() - start
            log(
                f"{point.iteration:>7,} points  T = {point.time_s:.4f} s  "
                f"E = {point.energy_j:.1f} J  {elapsed:7.1f} s"
            )

    gc.collect()
    run = run_ours(pp, case, progress)
    rss_after = max_rss_bytes()
    log(f"done: {len(run.times_s):,} points in {run.total_s:.1f} s")
    log(numba_cache_stats())

    peak: int | None = None
    if memory:
        log("memory run (tracemalloc, untimed) ...")
        with traced() as box:
            run_ours(pp, case)
        peak = box[0]
    ours = Result("ours", run, [], peak, max(rss_after, max_rss_bytes()))

    theirs: Result | None = None
    if run_lt:
        lt, lt_import_s = import_lowtime()
        log(f"imported lowtime {lt['version']} in {lt_import_s:.2f} s; running (this takes hours)")
        theirs = measure(f"lowtime {lt['version']}", lambda: run_lowtime(lt, case), 0, False)
    status = report(ours, theirs, memory)
    points = len(run.times_s)
    print(
        f"\nLarge case: {points:,} points in {run.total_s:.1f} s wall "
        f"({run.solve_s / max(points - 1, 1) * 1e6:.0f} µs/point), "
        f"tracemalloc peak {fmt_mib(peak)} MiB, max RSS {fmt_mib(ours.max_rss_b)} MiB"
    )
    if run.total_s >= LARGE_TIME_LIMIT_S:
        print(
            f"FAIL: the large case took {run.total_s:.1f} s, over the "
            f"{LARGE_TIME_LIMIT_S:.0f} s limit"
        )
        return 1
    print(f"OK: under the {LARGE_TIME_LIMIT_S:.0f} s limit.")
    return status


if __name__ == "__main__":
    sys.exit(main())
