"""The paper's large-scale settings and its job-level accounting with a straggler, by hand."""

from __future__ import annotations

import pytest

from conftest import GPU_SETTINGS, NUM_STAGES, REPO_ROOT, profile_path
from perseus_api.profile import load_profile
from perseus_planner import PlannerError, build_pipeline_dag, build_problem, max_frequency_baseline
from perseus_planner.frontier import Baseline
from perseus_planner.sim.emulation import (
    ENERGY_FACTOR,
    GPUS_PER_PIPELINE,
    SUPPORTED_GPU_COUNTS,
    TIME_FACTOR,
    OperatingPoint,
    job_energy,
    parse_envpipe_results,
    scale_config,
)

ENVPIPE_RESULTS = REPO_ROOT / "tests" / "data" / "perseus-sosp24" / "envpipe_result.csv"

# Two stages, 5 W blocking; all-max: 9 s iteration, 12 s of computation, 120 J.
BASELINE = Baseline(
    time_s=9.0, busy_time_s=12.0, busy_energy_j=120.0, num_stages=2, blocking_power_w=5.0
)


@pytest.mark.parametrize(
    ("gpus", "microbatches", "pipelines"),
    [(1024, 96, 16), (2048, 48, 32), (4096, 24, 64), (8192, 12, 128)],
)
def test_layouts_keep_the_global_batch(gpus: int, microbatches: int, pipelines: int) -> None:
    config = scale_config(gpus)
    assert (config.num_microbatches, config.num_pipelines) == (microbatches, pipelines)
    assert config.num_pipelines * GPUS_PER_PIPELINE == gpus
    assert config.num_microbatches * config.num_pipelines == 1536
    assert config.label.startswith(f"{gpus:,} GPUs = {pipelines} pipelines x 8 stages x TP 8")


@pytest.mark.parametrize("gpus", [0, 512, 1000, 16384])
def test_unsupported_gpu_counts_list_the_supported_ones(gpus: int) -> None:
    with pytest.raises(PlannerError, match="supported GPU counts: 1024, 2048, 4096, 8192"):
        scale_config(gpus)
    assert SUPPORTED_GPU_COUNTS == (1024, 2048, 4096, 8192)


def test_job_energy_without_a_straggler_is_every_pipeline_at_its_own_time() -> None:
    # 4 pipelines running a 8 s / 100 J point; all-max compared at 8 s: 120 J + 5 W x (16 - 12)
    # s of blocking = 140 J per pipeline.
    job = job_energy(OperatingPoint(8.0, 100.0), BASELINE, 4, None)
    assert (job.iteration_time_s, job.energy_j, job.baseline_energy_j) == (8.0, 400.0, 560.0)
    assert job.savings_ratio == pytest.approx(1 - 400 / 560, rel=1e-15)


def test_job_energy_with_a_straggler_counts_it_as_all_max() -> None:
    # T' = 12 s. Each of the 3 others: 100 J + 2 GPUs x 5 W x (12 - 8) s = 140 J. The straggler
    # and every baseline pipeline: 120 J + 5 W x (2 x 12 - 12) s = 180 J.
    job = job_energy(OperatingPoint(8.0, 100.0), BASELINE, 4, 12.0)
    assert job.iteration_time_s == 12.0
    assert job.energy_j == 3 * 140.0 + 180.0
    assert job.baseline_energy_j == 4 * 180.0
    # A point slower than T' sets the iteration time: everybody waits for it instead.
    slow = job_energy(OperatingPoint(13.0, 100.0), BASELINE, 4, 12.0)
    assert slow.iteration_time_s == 13.0
    assert slow.energy_j == 3 * 100.0 + (120.0 + 5.0 * (26.0 - 12.0))
    assert slow.baseline_energy_j == 4 * (120.0 + 5.0 * (26.0 - 12.0))


@pytest.mark.parametrize(
    ("pipelines", "straggler_s", "message"),
    [(0, None, "at least one pipeline"), (1, 12.0, "at least two"), (4, 0.0, "must be > 0")],
)
def test_job_energy_rejects_impossible_jobs(
    pipelines: int, straggler_s: float | None, message: str
) -> None:
    with pytest.raises(PlannerError, match=message):
        job_energy(OperatingPoint(8.0, 100.0), BASELINE, pipelines, straggler_s)


def test_published_envpipe_results_parse_and_scale_back() -> None:
    results = parse_envpipe_results(ENVPIPE_RESULTS.read_text())
    assert len(results) == 16
    point = results[("gpt3-175b", "a100_sxm", 96)]
    assert point.num_pipelines == 16
    assert point.point.time_s == pytest.approx(156.794 / TIME_FACTOR, rel=1e-15)
    assert point.point.energy_j == pytest.approx(3760454.915 / ENERGY_FACTOR, rel=1e-15)
    assert {(p.num_microbatches, p.num_pipelines) for p in results.values()} == {
        (scale_config(n).num_microbatches, scale_config(n).num_pipelines)
        for n in SUPPORTED_GPU_COUNTS
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model,device\n", "need the columns"),
        (
            "model,device,num_microbatches,num_pipelines,iteration_time,energy\n"
            "bloom,a40,12,128,x,1\n",
            "line 2",
        ),
        (
            "model,device,num_microbatches,num_pipelines,iteration_time,energy\n"
            "bloom,a40,12,64,1,1\n",
            "not one of the emulated layouts",
        ),
    ],
)
def test_bad_envpipe_results_are_rejected(text: str, message: str) -> None:
    with pytest.raises(PlannerError, match=message):
        parse_envpipe_results(text)


@pytest.mark.parametrize("gpu", ["a100_sxm", "a40"])
@pytest.mark.parametrize("model", ["gpt3-175b", "bloom"])
def test_published_envpipe_keeps_the_all_max_iteration_time(model: str, gpu: str) -> None:
    # EnvPipe slows only computations off the critical path. Its published times, divided by
    # the emulation's x10, are our all-max iteration times (to the file's 1 ms rounding): the
    # factor and the profiles are the ones the paper used.
    results = parse_envpipe_results(ENVPIPE_RESULTS.read_text())
    profile = load_profile(profile_path(model, gpu))
    unit_time_s, blocking_power_w = GPU_SETTINGS[gpu]
    for microbatches in (12, 24, 48, 96):
        dag = build_pipeline_dag("1f1b", NUM_STAGES, microbatches)
        baseline = max_frequency_baseline(
            build_problem(profile, dag, unit_time_s, blocking_power_w)
        )
        published = results[(model, gpu, microbatches)].point
        assert published.time_s == pytest.approx(baseline.time_s, abs=0.0005 / TIME_FACTOR)
        assert 0 < baseline.savings_ratio(published.energy_j, published.time_s) < 0.15
