"""Our frontiers against the ones the Perseus artifact published (SOSP 2024, 8 stages, 1F1B).

A published file lists the frontier from one unit below ``T_max`` down to ``T_min``; our
frontier also contains the ``T_max`` starting point, so it is compared from index 1 on.
"""

from __future__ import annotations

import csv

import numpy as np
import pytest

from conftest import GPU_SETTINGS, PUBLISHED_FRONTIERS_DIR, SolveFrontier
from perseus_planner.bundled import BUNDLED_PROFILES

# The A100 files are reproduced to ~4e-8 relative energy; 1e-6 leaves room but no more.
A100_RTOL = 1e-6
# The A40 files are not reproduced as closely by the artifact's own solver: lowtime 0.3.0, run on
# bloom+a40 mb12, misses the published energies by 1.595e-6 relative on the machine of earlier
# rounds and by 3.375e-6 on a fresh one of the same kind (AMD EPYC, AVX2, no AVX-512; same numpy
# 2.4.6 and scipy 1.17.1), where our frontier equals lowtime's to 2.9e-9 and misses the files by
# 3.375e-6 (mb12) and 3.672e-6 (mb24). curve_fit's convergence on these profiles moves with the
# CPU's floating-point kernels (SIMD exp, BLAS), so the tolerance is the worst of those, ~1.4x.
A40_RTOL = 5e-6


def read_published(gpu: str, model: str, microbatches: int) -> tuple[list[float], list[float]]:
    path = PUBLISHED_FRONTIERS_DIR / gpu / f"{model}_bf16_mb{microbatches}.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [float(r["time"]) for r in rows], [float(r["energy"]) for r in rows]


CASES = [
    pytest.param("gpt3-175b", "a100_sxm", 12, A100_RTOL, id="gpt3-a100-mb12"),
    pytest.param("gpt3-175b", "a100_sxm", 24, A100_RTOL, id="gpt3-a100-mb24"),
    pytest.param("bloom", "a100_sxm", 12, A100_RTOL, id="bloom-a100-mb12"),
    pytest.param("bloom", "a100_sxm", 24, A100_RTOL, id="bloom-a100-mb24"),
    pytest.param("gpt3-175b", "a40", 12, A40_RTOL, id="gpt3-a40-mb12"),
    pytest.param("gpt3-175b", "a40", 24, A40_RTOL, id="gpt3-a40-mb24", marks=pytest.mark.slow),
    pytest.param("bloom", "a40", 12, A40_RTOL, id="bloom-a40-mb12"),
    pytest.param("bloom", "a40", 24, A40_RTOL, id="bloom-a40-mb24", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("model", "gpu", "microbatches", "rtol"), CASES)
def test_matches_published_frontier(
    solved_frontier: SolveFrontier, model: str, gpu: str, microbatches: int, rtol: float
) -> None:
    frontier = solved_frontier(model, gpu, microbatches)
    times, energies = read_published(gpu, model, microbatches)
    assert len(frontier) == len(times) + 1
    # Exact: same quantized times, and the same float product quant_time * unit_time_s.
    assert frontier.times_s[1:].tolist() == times
    np.testing.assert_allclose(frontier.energies_j[1:], energies, rtol=rtol, atol=0)

    unit_time_s, _ = GPU_SETTINGS[gpu]
    assert frontier.quant_times.tolist() == list(
        range(frontier.quant_times[0], frontier.quant_times[0] - len(frontier), -1)
    )
    assert frontier.times_s.tolist() == (frontier.quant_times * unit_time_s).tolist()
    problem = frontier.problem
    assert frontier.quant_times[-1] == problem.makespan(problem.fastest_durations)
    assert frontier.quant_times[0] == problem.makespan(problem.slowest_durations)


@pytest.mark.parametrize("gpu", sorted(GPU_SETTINGS))
@pytest.mark.parametrize("model", ["gpt3-175b", "bloom"])
def test_bundled_settings_match_the_published_ones(model: str, gpu: str) -> None:
    bundled = BUNDLED_PROFILES[f"{model}+{gpu}"]
    assert (bundled.unit_time_s, bundled.blocking_power_w) == GPU_SETTINGS[gpu]
    assert bundled.path.name == f"{model}+{gpu}_bf16.csv"
    assert bundled.path.is_file()
