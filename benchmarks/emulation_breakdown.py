"""Where the end-to-end test's savings and time go: the same job, from an ideal agent up.

The end-to-end test (``tests/e2e/test_cluster_training.py``) runs an emulated 2 replicas x 4
stages 1F1B job (8 microbatches, the bundled GPT-3 / A100 profile's first four stages at its
own times) under real node agents, the operator and a real API server, and compares the
savings it measures with those the planner predicted from the profile the agents measured.
This script takes the parts out of that chain one at a time, in one process and one run, so
that each row differs from the one before it by one thing:

1. **ideal**: GPUs in memory; the planned clock set by the rank itself as each computation
   begins (no hook, no agent, no latency);
2. **shared state**: the same, with the GPUs in state files (as agent and training share them);
3. **late clock**: as 2, with every clock change landing ``--lag-ms`` after the hook that
   asks for it (the agent's latency; the e2e's records measure it: ``clock_lag_s`` per
   change), the next computation's clock asked for as the previous one ends, as the agent does.

Each row: the iteration time (median replica time) against the planner's ``T_min``, and the
savings at the same throughput (the e2e's formula) as a share of the planner's prediction.
The plan is the operator's (``perseus_operator.jobs.planning``) from the emulated GPUs' own profile
on the clocks the e2e profiles (1050-1410 MHz every 30), with the true blocking power: what
is left between prediction and measurement here is the emulation's, not the profiling's.

Run from the repository root (about 3 minutes)::

    python benchmarks/emulation_breakdown.py
    python benchmarks/emulation_breakdown.py --iterations 6 --time-scale 0.5

Information only (exit status 0): the numbers go into the README's end-to-end section.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _root, _package in ((REPO / "operator", "perseus_api"), (REPO / "node_agent", "perseus_agent")):
    if importlib.util.find_spec(_package) is None:
        sys.path.insert(0, str(_root))

from perseus_agent.gpu.emulated import EmulatedBackend  # noqa: E402
from perseus_api.job import Granularity, Policy, ScheduleName  # noqa: E402
from perseus_api.plan import PipelinePlan  # noqa: E402
from perseus_api.profile import Profile, parse_profile  # noqa: E402
from perseus_emulation.job import (  # noqa: E402
    EmulatedJob,
    IterationRecord,
    NodeSpec,
    RankClient,
    RankInfo,
)
from perseus_operator.jobs.planning import PlanningInput, choose_plan, solve_frontier  # noqa: E402
from perseus_planner.bundled import DEFAULT_PROFILE, bundled_profile  # noqa: E402

STAGES, REPLICAS, MICROBATCHES, GPUS_PER_NODE = 4, 2, 8, 4
BLOCKING_W = 83.64
CLOCKS_MHZ = range(1050, 1411, 30)  # the e2e's profiling sweep


def e2e_profile(time_scale: float) -> tuple[Profile, str]:
    """The emulated GPUs' profile (first four stages) and its e2e clocks, times scaled, as CSV."""
    lines = bundled_profile(DEFAULT_PROFILE).path.read_text().strip().splitlines()
    header = [c.strip() for c in lines[0].split(",")]
    rows = ["stage,instruction,frequency,time,energy"]
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=True))
        stage, clock = int(row["stage"]), int(float(row["frequency"]))
        if stage < STAGES and clock in CLOCKS_MHZ:
            time_s, energy_j = float(row["time"]) * time_scale, float(row["energy"]) * time_scale
            rows.append(f"{stage},{row['instruction']},{clock},{time_s},{energy_j}")
    csv = "\n".join(rows) + "\n"
    return parse_profile(csv, "e2e-truth"), csv


def plan_for(csv: str) -> PipelinePlan:
    frontier = solve_frontier(
        PlanningInput(csv, "e2e-truth", ScheduleName.ONE_F_ONE_B, STAGES, MICROBATCHES, BLOCKING_W)
    )
    return choose_plan(frontier, Policy(granularity=Granularity.INSTRUCTION))


class PlannedClocks:
    """A rank's client that locks the plan's clocks itself, as the agent does, at once or
    ``lag_s`` later (a timer): a computation's clock as it begins, and the next one's already
    when it ends (so that after a wait the clock is in place)."""

    def __init__(
        self, info: RankInfo, backend: EmulatedBackend, plan: PipelinePlan | None, lag_s: float
    ) -> None:
        self._backend, self._index, self._lag_s = backend, info.gpu_index, lag_s
        stage = None if plan is None else plan.stages[info.stage]
        self._clocks = [] if stage is None else [c.frequency_mhz for c in stage.instructions]
        self._position = 0
        self._timers: list[threading.Timer] = []

    def _lock(self, position: int) -> None:
        if position >= len(self._clocks):
            return
        clock = self._clocks[position]
        if self._lag_s <= 0:
            self._backend.lock_sm_clock(self._index, clock)
            return
        timer = threading.Timer(self._lag_s, self._backend.lock_sm_clock, (self._index, clock))
        timer.start()
        self._timers.append(timer)

    def on_step_begin(self, step: int) -> None:
        self._position = 0

    def on_step_end(self, step: int) -> None:
        self._timers = [t for t in self._timers if t.is_alive()]

    def on_instruction_begin(self, name: str, microbatch: int | None = None) -> int | None:
        self._lock(self._position)
        self._position += 1
        return None

    def on_instruction_end(self, name: str) -> None:
        self._lock(self._position)

    def close(self) -> None:
        for timer in self._timers:
            timer.join()


@dataclass(frozen=True)
class Window:
    iteration_s: float
    energy_j: float


def measure(
    profile: Profile,
    plan: PipelinePlan | None,
    *,
    time_scale: float,
    iterations: int,
    state_dir: Path | None,
    lag_s: float = 0.0,
) -> Window:
    nodes = [
        NodeSpec(
            f"node-{k}",
            GPUS_PER_NODE,
            state_file=None if state_dir is None else state_dir / f"node-{k}-{time.monotonic_ns()}",
        )
        for k in range(REPLICAS)
    ]
    backends: list[EmulatedBackend] = []

    def client(info: RankInfo) -> RankClient:
        return PlannedClocks(info, backends[info.node_rank], plan, lag_s)

    job = EmulatedJob(
        profile,
        nodes,
        blocking_power_w=BLOCKING_W,
        stages=STAGES,
        replicas=REPLICAS,
        microbatches=MICROBATCHES,
        time_scale=1.0,  # the profile is scaled already
        client_factory=client,
    )
    backends.extend(job.backends)
    records = job.run(iterations + 2).records[1:]  # the first iteration warms up
    return window(records)


def window(records: Sequence[IterationRecord]) -> Window:
    first, last = records[0], records[-1]
    n = last.iteration - first.iteration
    times = [max(r.replica_times_s) for r in records[1:]]
    return Window(statistics.median(times), (last.energy_j - first.energy_j) / n)


def savings(all_max: Window, planned: Window) -> float:
    """The e2e's: energy saved per iteration at the same throughput."""
    idle_s = max(0.0, planned.iteration_s - all_max.iteration_s)
    baseline_j = all_max.energy_j + STAGES * REPLICAS * BLOCKING_W * idle_s
    return 1 - planned.energy_j / baseline_j


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6, help="measured per row")
    parser.add_argument("--time-scale", type=float, default=1.0, help="as the e2e's")
    parser.add_argument(
        "--lag-ms", type=float, default=1.3, help="clock latency of row 3 (the e2e measured ~1.3)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    profile, csv = e2e_profile(args.time_scale)
    plan = plan_for(csv)
    predicted = plan.instruction_estimate.savings_ratio
    t_min_s = plan.t_min_s
    print(
        f"plan: T_min {t_min_s:.4f} s, predicted savings {predicted:.2%} (blocking "
        f"{BLOCKING_W} W, {len(CLOCKS_MHZ)} clocks, time scale {args.time_scale})"
    )
    rows: list[tuple[str, Callable[[PipelinePlan | None], Window]]] = []
    with tempfile.TemporaryDirectory(prefix="perseus-breakdown-") as tmp:
        state_dir = Path(tmp)
        rows = [
            ("1 ideal (in memory, clock set at once)", lambda p: measure(
                profile, p, time_scale=args.time_scale, iterations=args.iterations,
                state_dir=None)),
            ("2 shared state files", lambda p: measure(
                profile, p, time_scale=args.time_scale, iterations=args.iterations,
                state_dir=state_dir)),
            (f"3 clock {args.lag_ms:g} ms late", lambda p: measure(
                profile, p, time_scale=args.time_scale, iterations=args.iterations,
                state_dir=state_dir, lag_s=args.lag_ms / 1e3)),
        ]  # fmt: skip
        print(
            f"{'row':<40} {'all-max s':>10} {'plan s':>9} {'vs T_min':>9} {'saved':>7} "
            f"{'of predicted':>13}"
        )
        for label, run in rows:
            all_max, planned = run(None), run(plan)
            saved = savings(all_max, planned)
            print(
                f"{label:<40} {all_max.iteration_s:>10.4f} {planned.iteration_s:>9.4f} "
                f"{planned.iteration_s / t_min_s - 1:>+9.2%} {saved:>7.2%} "
                f"{saved / predicted:>13.1%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
