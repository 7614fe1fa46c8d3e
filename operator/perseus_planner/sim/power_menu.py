"""One job of a power-budget simulation: what each clock assignment costs in time and watts.

A job is one bundled profile's pipeline (its frontier solved as ``perseus plan`` does) run on
``replicas`` data-parallel pipelines. Every clock assignment is measured by the simulator on the
profile's own rows (:mod:`perseus_planner.sim.engine`), never on the planner's fitted energies:
its iteration time and the average power of all the job's GPUs over it (computations at their
measured energy, blocking power while a GPU waits).

The job's *menu*, the points the allocation may choose from:

- the frontier's points, replayed (a sample of them: all near ``T_min``, where budgets first
  bite, and evenly spaced beyond);
- every GPU at its highest clock (the planner floors times to its unit, so its ``T_min`` plan
  runs a few tenths of a percent slower than all-max on some profiles);
- past ``T_max``: the frontier ends where slowing any computation further stops saving energy
  over an iteration's blocking, which leaves the slowest clocks out. Deep budgets need them, so
  ``T_max``'s clocks capped at every lower clock, and every GPU locked at one clock, are added:
  slower, but fewer watts.

The baselines' assignments come from here too: a per-GPU power cap (each computation at the
highest profiled clock whose power fits the cap, as the GPU's firmware does) and one locked clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perseus_planner.errors import PlannerError
from perseus_planner.sim.engine import FloatArray, IntArray, makespans_s
from perseus_planner.sim.methods import SimSetup

FRONTIER_SAMPLE = 240
"""Frontier points replayed per job, beside the last ``NEAR_T_MIN`` ones."""
NEAR_T_MIN = 60


@dataclass(frozen=True)
class SimJob:
    """One job of the mix.

    Attributes:
        profile: Bundled profile name (model + GPU).
        microbatches: Per iteration of one pipeline.
        replicas: Data-parallel pipelines (the job has ``replicas x stages`` GPUs).
        weight: How much its slowdown counts.
    """

    profile: str
    microbatches: int
    replicas: int
    weight: float = 1.0

    @property
    def name(self) -> str:
        return f"{self.profile}/M{self.microbatches}x{self.replicas}"


@dataclass(frozen=True)
class Measured:
    """Iteration time (s) and average power of all the job's GPUs (W), per assignment."""

    times_s: FloatArray
    powers_w: FloatArray


class JobModel:
    """A job's simulator tables, its all-max point and its menu."""

    def __init__(self, spec: SimJob, setup: SimSetup) -> None:
        self.spec = spec
        self.setup = setup
        table = setup.table
        self._sorted_freqs: list[IntArray] = []
        self._rows: list[IntArray] = []
        for freqs in table.frequencies_mhz:
            order = np.argsort(freqs, kind="stable")
            self._sorted_freqs.append(np.asarray(freqs[order], dtype=np.int64))
            self._rows.append(np.asarray(order, dtype=np.int64))
        self.all_max_clocks = table.max_frequencies_mhz()
        all_max = self.measure([self.all_max_clocks])
        self.all_max_time_s = float(all_max.times_s[0])
        self.all_max_power_w = float(all_max.powers_w[0])
        self.menu_clocks = self._menu_clocks()
        self.menu = self.measure(self.menu_clocks)

    @property
    def num_gpus(self) -> int:
        return self.setup.num_stages * self.spec.replicas

    def snapped(self, clocks_mhz: IntArray) -> IntArray:
        """Each node's highest profiled clock at or below the one asked (its lowest if none)."""
        out = np.empty(len(clocks_mhz), dtype=np.int64)
        for v, f in enumerate(np.asarray(clocks_mhz).tolist()):
            freqs = self._sorted_freqs[v]
            k = int(np.searchsorted(freqs, f, side="right")) - 1
            out[v] = freqs[max(k, 0)]
        return out

    def measure(self, assignments: list[IntArray]) -> Measured:
        """Time and whole-job power of each assignment (clocks profiled for every node)."""
        clocks = np.asarray(assignments, dtype=np.int64)
        k, n = clocks.shape
        table = self.setup.table
        times = np.empty((k, n))
        energies = np.empty((k, n))
        for v in range(n):
            pos = np.searchsorted(self._sorted_freqs[v], clocks[:, v])
            pos = np.minimum(pos, len(self._sorted_freqs[v]) - 1)
            if np.any(self._sorted_freqs[v][pos] != clocks[:, v]):
                raise PlannerError(f"computation {v}: a clock asked for is not profiled")
            rows = self._rows[v][pos]
            times[:, v] = table.times_s[v][rows]
            energies[:, v] = table.energies_j[v][rows]
        spans = makespans_s(self.setup.graph, times)
        stages, blocking_w = self.setup.num_stages, self.setup.blocking_power_w
        pipeline_j = energies.sum(axis=1) + blocking_w * (stages * spans - times.sum(axis=1))
        return Measured(spans, self.spec.replicas * pipeline_j / spans)

    def capped_clocks(self, cap_w: float) -> IntArray:
        """Each computation at its highest profiled clock whose power fits ``cap_w`` per GPU
        (its lowest clock when none does: the firmware can throttle no further here)."""
        table = self.setup.table
        out = np.empty(len(table.frequencies_mhz), dtype=np.int64)
        for v, freqs in enumerate(table.frequencies_mhz):
            power = table.energies_j[v] / table.times_s[v]
            fits = np.flatnonzero(power <= cap_w)
            out[v] = freqs[fits[np.argmax(freqs[fits])]] if len(fits) else freqs.min()
        return out

    def locked_clocks(self, clock_mhz: int) -> IntArray:
        """Every GPU locked at ``clock_mhz`` (at its highest clock if that is lower)."""
        return self.snapped(np.full(len(self.all_max_clocks), clock_mhz, dtype=np.int64))

    def clock_grid(self) -> list[int]:
        """Every profiled clock of any computation, highest first."""
        return sorted({int(f) for fs in self._sorted_freqs for f in fs.tolist()}, reverse=True)

    def _menu_clocks(self) -> list[IntArray]:
        frontier = self.setup.frontier
        last = frontier.t_min_index
        sample = np.linspace(0, last, FRONTIER_SAMPLE).astype(np.int64)
        near = np.arange(max(0, last - NEAR_T_MIN + 1), last + 1)
        indices = np.unique(np.concatenate([sample, near]))
        menu = [frontier.frequencies_at(int(i)) for i in indices.tolist()]
        self.t_min_position = len(menu) - 1  # the frontier's own T_min plan
        menu.append(self.all_max_clocks)
        t_max = menu[0]
        for f in self.clock_grid():
            if f < int(t_max.max()):
                menu.append(self.snapped(np.minimum(t_max, f)))
            menu.append(self.locked_clocks(f))
        return menu


def solve_job(spec: SimJob) -> JobModel:
    """Plan ``spec``'s bundled profile (1F1B, the artifact's unit time and blocking power,
    within the planner's limits) and prepare its menu."""
    from perseus_planner.bundled import bundled_profile
    from perseus_planner.frontier import compute_frontier, max_frequency_baseline
    from perseus_planner.limits import prepare_problem
    from perseus_planner.sim.methods import sim_setup

    if spec.replicas < 1 or spec.microbatches < 1 or not spec.weight > 0:
        raise PlannerError(f"{spec.name}: replicas and microbatches >= 1 and weight > 0")
    bundled = bundled_profile(spec.profile)
    profile = bundled.load()
    problem = prepare_problem(
        profile,
        "1f1b",
        profile.num_stages,
        spec.microbatches,
        bundled.unit_time_s,
        bundled.blocking_power_w,
    )
    frontier = compute_frontier(problem)
    return JobModel(spec, sim_setup(frontier, max_frequency_baseline(problem)))
