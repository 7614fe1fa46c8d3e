"""End to end on one node: agent + emulated training rank + a real Prometheus.

The agent runs standalone over an emulated GPU, an emulated training rank calls
it through ``perseus_client`` on every step and computation, and Prometheus
scrapes the agent. When the plan lowers the GPU's clock, the energy per
iteration that Prometheus sees drops by what the real profile predicts.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perseus_api.profile import load_profile
from perseus_api.schedule import Schedule, stage_instruction_order
from support.agent_process import PROFILE, Agent, run_emulated_rank, wait_for, write_atomically
from support.factories import pipeline_plan_fields
from support.prometheus_server import PROMETHEUS, Prometheus, running_prometheus

BLOCKING_POWER_W = 83.64
STAGES, MICROBATCHES, STAGE = 8, 4, 0
TIME_SCALE = 0.1  # the rank sleeps 10% of the measured times: quick, same power
PHASE_S = 7.0
SCRAPE_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def _prometheus_installed() -> None:
    if PROMETHEUS is None:
        message = "prometheus is not installed (apt-get install prometheus)"
        if os.environ.get("PERSEUS_REQUIRE_E2E") == "1":
            pytest.fail(message)  # CI installs it: a missing binary is a broken setup
        pytest.skip(message)


def stage_plan(clock_mhz: int, revision: int) -> dict[str, Any]:
    plan = pipeline_plan_fields(num_stages=STAGES, num_microbatches=MICROBATCHES)
    for stage in plan["stages"]:
        stage["frequency_mhz"] = clock_mhz
    return {
        "node": "n1",
        "namespace": "ml",
        "job": "gpt3",
        "revision": revision,
        "granularity": "Stage",
        "plans": {"main": plan},
        "assignments": [{"gpu_index": 0, "plan": "main", "stage": STAGE, "rank": 0}],
    }


def busy_time_and_energy(clock_mhz: int) -> tuple[float, float]:
    """Seconds and joules the GPU computes per (scaled) iteration, from the profile."""
    profile = load_profile(PROFILE)
    order = stage_instruction_order(Schedule.ONE_F_ONE_B, STAGES, MICROBATCHES, STAGE)
    time_s = energy_j = 0.0
    for instruction, _ in order:
        m = profile.get(STAGE, instruction)
        k = list(m.frequencies_mhz).index(clock_mhz)
        time_s += float(m.times_s[k])
        energy_j += float(m.energies_j[k])
    return time_s * TIME_SCALE, energy_j * TIME_SCALE


def expected_energy_j(clock_mhz: int, iteration_s: float, busy_s: float) -> float:
    """``busy_s`` at the profile's busy power for the clock, blocking power for the rest of
    the iteration."""
    profile_s, profile_j = busy_time_and_energy(clock_mhz)
    return busy_s * profile_j / profile_s + BLOCKING_POWER_W * (iteration_s - busy_s)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="pe2e-"))
    agent = Agent(tmp_path, socket_dir / "run", num_gpus=1)
    yield agent
    agent.kill_if_running()
    shutil.rmtree(socket_dir, ignore_errors=True)


def run_rank(agent: Agent, seconds: float) -> tuple[float, float, float]:
    """Train for about ``seconds``; return the wall-clock window it ran in and the seconds the
    GPU computed per iteration (as the rank measured it: its sleeps overshoot under load)."""
    steps = max(10, int(seconds / busy_time_and_energy(1410)[0]))
    start = time.time()
    run = run_emulated_rank(
        agent,
        stage=STAGE,
        stages=STAGES,
        microbatches=MICROBATCHES,
        steps=steps,
        time_scale=TIME_SCALE,
        blocking_power_w=BLOCKING_POWER_W,
    )
    return start, time.time(), float(run["busy_s"]) / steps


def per_iteration(prom: Prometheus, start: float, end: float) -> tuple[float, float]:
    """Joules and seconds per iteration, from two scrapes inside the window."""
    a, b = start + 2 * SCRAPE_S, end - SCRAPE_S

    def delta(promql: str) -> float:
        return prom.scalar(promql, b) - prom.scalar(promql, a)

    iterations = delta('sum(perseus_iteration_seconds_count{gpu="0"})')
    assert iterations > 20, f"too few iterations scraped in the window: {iterations}"
    energy_j = delta('perseus_gpu_energy_joules_total{gpu="0"}') / iterations
    return energy_j, delta('sum(perseus_iteration_seconds_sum{gpu="0"})') / iterations


def test_energy_per_iteration_in_prometheus_drops_when_the_plan_lowers_clocks(
    agent: Agent, tmp_path: Path
) -> None:
    write_atomically(agent.plan_file, json.dumps(stage_plan(1410, revision=1)))
    agent.start()
    assert agent.port is not None
    with running_prometheus(tmp_path, [f"127.0.0.1:{agent.port}"], SCRAPE_S) as prom:
        prom.wait_for("perseus_gpu_energy_joules_total")
        wait_for(lambda: agent.metric("perseus_gpu_sm_clock_hertz") == [1410e6], "1410 MHz", agent)
        fast = run_rank(agent, PHASE_S)

        write_atomically(agent.plan_file, json.dumps(stage_plan(1005, revision=2)))
        wait_for(lambda: agent.metric("perseus_gpu_sm_clock_hertz") == [1005e6], "1005 MHz", agent)
        slow = run_rank(agent, PHASE_S)
        time.sleep(2 * SCRAPE_S)  # let the last in-window scrapes land

        fast_j, fast_s = per_iteration(prom, *fast[:2])
        slow_j, slow_s = per_iteration(prom, *slow[:2])
        target = prom.query('perseus_gpu_target_sm_clock_hertz{gpu="0"}')

    assert slow_j < 0.9 * fast_j
    assert slow_s > fast_s
    # The emulated GPU computes at the profile's power for as long as the rank kept it busy
    # (the profile's scaled times plus sleep overshoot) and idles at blocking power in between:
    # what Prometheus saw must add up to that.
    runs = ((fast_j, 1410, fast_s, fast[2]), (slow_j, 1005, slow_s, slow[2]))
    for measured_j, clock_mhz, iteration_s, busy_s in runs:
        assert busy_s >= busy_time_and_energy(clock_mhz)[0]
        expected_j = expected_energy_j(clock_mhz, iteration_s, busy_s)
        assert expected_j * 0.95 <= measured_j <= expected_j * 1.05, (clock_mhz, measured_j)
    assert [float(s["value"][1]) for s in target] == [1005e6]
    assert agent.stop() == 0
