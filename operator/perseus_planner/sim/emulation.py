"""The Perseus paper's large-scale emulation: 1,024-8,192 GPUs, with and without a straggler.

Settings (the paper's artifact, ml-energy/zeus branch ``kronos``, ``sosp24_data/``): GPT-3 175B
or Bloom 176B in 8 pipeline stages, each stage 8-way tensor parallel (TP). Every stage was
profiled on one GPU, so a TP=8 stage of the 175B model is emulated with times x10 and energies
x10 x TP (per stage: 8 GPUs, each for 10x as long). Those factors multiply every time and energy
alike (blocking power included: 8 GPUs wait where one did), so savings and ``T'/T`` do not change
and the frontier is the same one scaled (the solver's unit scales with it); they are applied
only to what is shown. The global batch is fixed, so more GPUs means more pipelines with fewer
microbatches each: ``(microbatches, pipelines)`` = (12, 128), (24, 64), (48, 32), (96, 16) for
8,192, 4,096, 2,048 and 1,024 GPUs (a pipeline is 8 stages x TP 8 = 64 GPUs). One pipeline is
planned and simulated; the others run the same assignment, so nothing is done per GPU.

Job energy with one straggler (the paper's Figure 7, intrinsic + extrinsic savings). For
``T'/T = f`` on ``N`` pipelines:

- ``T`` is the frontier's ``T_min`` (the iteration time of the job before the straggler, as in
  Table 6) and the straggler's iteration takes ``T' = f * T``.
- Every pipeline's iteration ends at the gradient synchronization, when the slowest one does:
  ``t = max(T', the non-stragglers' own time)``; a GPU that is done earlier blocks until ``t``
  at the blocking power.
- The ``N - 1`` non-stragglers run the method's operating point (one pipeline's own iteration
  time and energy) and block until ``t``. Perseus: the frontier point ``choose_point`` picks for
  ``T'``, the least energy including that blocking. A frontier point's energy is its computation
  cost plus blocking over its own time, and the cost only falls as the point gets slower, so
  that is the slowest point that ends by ``T'`` (``T_max`` once ``T'`` is past it), not
  ``min(T', T*)``: running slower costs less than waiting at the blocking power. EnvPipe: its
  published (time, energy) from the artifact (``envpipe_result.csv``); it does not react to
  stragglers.
- The straggler's energy is the same under every method and in the baseline: what an all-max
  pipeline draws in ``t`` (its computations at max clock, blocking for the rest; the simulator
  stretches them instead, which moves savings by under 0.1 points). What slows it is outside
  the job's control, so no method is credited or charged for it.
- Baseline: all ``N`` pipelines at max clock, blocking until ``t``. Savings are
  ``1 - job energy / baseline energy``.
- ``f = 1`` means no straggler: every pipeline runs the method's own point and the baseline is
  compared at the same iteration time (Table 6 for Perseus's ``T_min``).

How this was settled (1,024 GPUs, ``T'/T = 1.2``; ours minus the paper, percentage points, for
GPT-3 A100 / Bloom A100 / GPT-3 A40 / Bloom A40): as above, Perseus -0.18 / -0.04 / +0.01 /
+0.16 and EnvPipe -0.27 / +0.54 / +0.07 / +0.71. Leaving the straggler out of the job: Perseus
+1.6 to +2.0 in every cell. Letting it keep its own Perseus ``T_min`` clocks (what the operator
does, and the simulator's default): +0.47 / +0.07 / +0.32 / +0.08. Healthy pipelines at
``min(T', T*)`` instead of the least-energy point: -0.69 / -0.04 / -0.45 / +0.01. ``T`` = the
all-max iteration time instead of ``T_min`` moves a cell by at most 0.36. The Bloom EnvPipe
cells stay 0.4-0.8 above the paper under every variant: EnvPipe's published Bloom points save
only 1.70 % (A100) and 0.98 % (A40) with no straggler at all, and a straggler can only dilute
that (the same joules over a longer iteration).

The simulator (:func:`perseus_planner.sim.straggler_sweep` with ``straggler_clocks="max"``)
applies the same accounting to measured times and energies instead of the planner's model; its
Perseus is 0.2-0.4 points above the planner's on A100 and 1.7 above on A40, where the
exponential cost fits overestimate the energy of the slowest clocks by 2.4 %.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from perseus_planner.errors import PlannerError
from perseus_planner.frontier import Baseline, Frontier
from perseus_planner.plan import choose_point

NUM_STAGES = 8
TENSOR_PARALLEL = 8
TIME_FACTOR = 10.0
"""A TP=8 stage of a 175B model computes for 10x as long as the profiled one-GPU stage."""
ENERGY_FACTOR = TIME_FACTOR * TENSOR_PARALLEL
"""... on 8 GPUs: 80x the energy."""
GPUS_PER_PIPELINE = NUM_STAGES * TENSOR_PARALLEL

# Total GPUs -> (microbatches per iteration, pipelines): the global batch is 1,536 microbatches.
_LAYOUTS: dict[int, tuple[int, int]] = {
    8192: (12, 128),
    4096: (24, 64),
    2048: (48, 32),
    1024: (96, 16),
}
SUPPORTED_GPU_COUNTS: tuple[int, ...] = tuple(sorted(_LAYOUTS))
SCALE_PROFILES = ("gpt3-175b+a100_sxm", "bloom+a100_sxm", "gpt3-175b+a40", "bloom+a40")
"""Bundled profiles the emulation applies to (the 175B / 176B models it was published for)."""


PAPER_FIGURE7_PERCENT: dict[tuple[str, str], tuple[float, float]] = {
    ("gpt3-175b", "a100_sxm"): (27.0, 12.0),
    ("bloom", "a100_sxm"): (29.9, 1.0),
    ("gpt3-175b", "a40"): (23.6, 7.8),
    ("bloom", "a40"): (21.1, 0.16),
}
"""(model, gpu) -> total savings in percent of (Perseus, EnvPipe), 1,024 GPUs, ``T'/T = 1.2``,
as published in the paper (Figure 7)."""
FIGURE7_GPUS = 1024
FIGURE7_FACTOR = 1.2


@dataclass(frozen=True)
class ScaleConfig:
    """One emulated cluster size.

    Attributes:
        num_gpus: GPUs of the whole job.
        num_microbatches: Microbatches per iteration of each pipeline.
        num_pipelines: Data-parallel pipelines (replicas).
    """

    num_gpus: int
    num_microbatches: int
    num_pipelines: int

    @property
    def label(self) -> str:
        return (
            f"{self.num_gpus:,} GPUs = {self.num_pipelines} pipelines x {NUM_STAGES} stages x "
            f"TP {TENSOR_PARALLEL} (times x{TIME_FACTOR:g}, energies x{ENERGY_FACTOR:g})"
        )


def scale_config(num_gpus: int) -> ScaleConfig:
    """The paper's layout for ``num_gpus``.

    Raises:
        PlannerError: Not one of the emulated sizes.
    """
    try:
        microbatches, pipelines = _LAYOUTS[num_gpus]
    except KeyError:
        supported = ", ".join(str(n) for n in SUPPORTED_GPU_COUNTS)
        raise PlannerError(
            f"cannot emulate {num_gpus} GPUs; supported GPU counts: {supported}"
        ) from None
    return ScaleConfig(num_gpus, microbatches, pipelines)


@dataclass(frozen=True)
class OperatingPoint:
    """One pipeline's iteration at its own pace (one emulated-unscaled pipeline of 8 GPUs).

    Attributes:
        time_s: Its own iteration time.
        energy_j: Energy of its GPUs over ``time_s``, blocking included.
    """

    time_s: float
    energy_j: float

    def energy_until_j(self, until_s: float, num_stages: int, blocking_power_w: float) -> float:
        """Energy when the iteration lasts ``until_s``: its GPUs block for the rest."""
        return self.energy_j + num_stages * blocking_power_w * (until_s - self.time_s)


def frontier_point(frontier: Frontier, target_s: float | None) -> OperatingPoint:
    """Perseus's operating point: ``T_min`` without a straggler, else the point for ``T'``."""
    index = choose_point(frontier, target_s=target_s).index
    return OperatingPoint(float(frontier.times_s[index]), float(frontier.energies_j[index]))


@dataclass(frozen=True)
class JobEnergy:
    """Energy of one iteration of the whole job (every pipeline) and of the all-max baseline.

    Attributes:
        iteration_time_s: When the gradient synchronization ends the iteration.
        energy_j: Every GPU of the job under the method.
        baseline_energy_j: Every GPU at max clock, over the same iteration time.
    """

    iteration_time_s: float
    energy_j: float
    baseline_energy_j: float

    @property
    def savings_ratio(self) -> float:
        return 1.0 - self.energy_j / self.baseline_energy_j


def job_energy(
    point: OperatingPoint,
    baseline: Baseline,
    num_pipelines: int,
    straggler_time_s: float | None,
) -> JobEnergy:
    """Energy of ``num_pipelines`` pipelines, all but the straggler running ``point``.

    Args:
        point: The method's operating point for the non-straggler pipelines.
        baseline: The all-max pipeline (also the straggler's energy; see the module docstring).
        num_pipelines: Pipelines of the job, the straggler included.
        straggler_time_s: ``T'``; ``None`` for no straggler (every pipeline runs ``point``).

    Raises:
        PlannerError: Fewer than two pipelines with a straggler, or a non-positive ``T'``.
    """
    if num_pipelines < 1:
        raise PlannerError(f"need at least one pipeline, got {num_pipelines}")
    stages, power_w = baseline.num_stages, baseline.blocking_power_w
    if straggler_time_s is None:
        t = point.time_s
        return JobEnergy(t, num_pipelines * point.energy_j, num_pipelines * baseline.energy_j(t))
    if num_pipelines < 2:
        raise PlannerError("a straggler needs at least two pipelines (it and one that waits)")
    if not straggler_time_s > 0:
        raise PlannerError(f"straggler iteration time must be > 0 s, got {straggler_time_s}")
    t = max(straggler_time_s, point.time_s)
    others_j = (num_pipelines - 1) * point.energy_until_j(t, stages, power_w)
    return JobEnergy(t, others_j + baseline.energy_j(t), num_pipelines * baseline.energy_j(t))


def straggler_time_s(frontier: Frontier, factor: float) -> float | None:
    """``T' = factor * T_min``, or ``None`` when ``factor`` is 1 (no straggler).

    Raises:
        PlannerError: ``factor`` below 1 or not finite.
    """
    if not factor >= 1.0 or factor == float("inf"):
        raise PlannerError(f"T'/T must be a finite number >= 1, got {factor}")
    if factor == 1.0:
        return None
    return factor * float(frontier.times_s[frontier.t_min_index])


def perseus_job_energy(
    frontier: Frontier, baseline: Baseline, num_pipelines: int, factor: float
) -> JobEnergy:
    """Perseus on the whole job at ``T'/T = factor`` (the planner's frontier, as the paper)."""
    target_s = straggler_time_s(frontier, factor)
    return job_energy(frontier_point(frontier, target_s), baseline, num_pipelines, target_s)


def static_job_energy(
    point: OperatingPoint,
    frontier: Frontier,
    baseline: Baseline,
    num_pipelines: int,
    factor: float,
) -> JobEnergy:
    """A method that keeps ``point`` whatever the straggler does (EnvPipe), at ``T'/T``."""
    return job_energy(point, baseline, num_pipelines, straggler_time_s(frontier, factor))


@dataclass(frozen=True)
class PublishedPoint:
    """A published EnvPipe result for one emulated configuration (``envpipe_result.csv``).

    Attributes:
        model, gpu: ``gpt3-175b`` / ``bloom``, ``a100_sxm`` / ``a40``.
        num_microbatches, num_pipelines: The configuration.
        point: One pipeline's iteration, scaled back to the profiled one-GPU stages (/10, /80)
            so that it compares with the frontier and the baseline directly.
    """

    model: str
    gpu: str
    num_microbatches: int
    num_pipelines: int
    point: OperatingPoint


def parse_envpipe_results(text: str) -> dict[tuple[str, str, int], PublishedPoint]:
    """``(model, gpu, microbatches)`` -> EnvPipe's published point, from the artifact's CSV.

    Raises:
        PlannerError: Missing columns, unparsable numbers, or a layout that is not the paper's.
    """
    reader = csv.DictReader(io.StringIO(text))
    needed = {"model", "device", "num_microbatches", "num_pipelines", "iteration_time", "energy"}
    if reader.fieldnames is None or not needed <= set(reader.fieldnames):
        raise PlannerError(f"EnvPipe results need the columns {', '.join(sorted(needed))}")
    layouts = set(_LAYOUTS.values())
    results: dict[tuple[str, str, int], PublishedPoint] = {}
    for line, row in enumerate(reader, start=2):
        try:
            microbatches, pipelines = int(row["num_microbatches"]), int(row["num_pipelines"])
            time_s, energy_j = float(row["iteration_time"]), float(row["energy"])
        except ValueError as exc:
            raise PlannerError(f"EnvPipe results, line {line}: {exc}") from None
        if (microbatches, pipelines) not in layouts:
            raise PlannerError(
                f"EnvPipe results, line {line}: {microbatches} microbatches x {pipelines} "
                "pipelines is not one of the emulated layouts"
            )
        point = OperatingPoint(time_s / TIME_FACTOR, energy_j / ENERGY_FACTOR)
        key = (row["model"], row["device"], microbatches)
        results[key] = PublishedPoint(*key, pipelines, point)
    return results
