"""End to end on one node: the agent profiles an emulated training rank over three clocks.

The agent runs standalone over an emulated GPU with a profiling plan, an emulated training
rank (another process, sharing the GPU through its state file) calls it through
``perseus_client``, and the profile the agent logs when it is done must match, within the
errors of real time and a 5 ms sampled energy counter, the profile the emulated GPU follows.
No Prometheus needed.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_api.profile import load_profile, parse_profile
from support.agent_process import (
    NODE,
    PROFILE,
    Agent,
    run_emulated_rank,
    wait_for,
    write_atomically,
)
from support.factories import pipeline_plan_fields

BLOCKING_POWER_W = 83.64  # the agent's default for the bundled profile
STAGES, MICROBATCHES, STAGE = 8, 2, 0
CLOCKS = [1410, 1200, 1005]
WARMUP, MEASURED = 1, 2
BUBBLE_S = 0.2  # idle at each iteration's start, as a stage waiting for its first input
TIME_SCALE = 1.0  # computations of 50 to 120 ms: long against the 5 ms energy sampling
DONE = re.compile(
    r"GPU 0 \(\S+\): profiling of stage 0 done: (\d+) iterations measured, (\d+) dropped, "
    r"blocking power ([0-9.]+) W"
)


def profiling_plan() -> dict[str, Any]:
    return {
        "node": NODE,
        "namespace": "ml",
        "job": "gpt3",
        "revision": 1,
        "granularity": "Instruction",
        "plans": {"main": pipeline_plan_fields(num_stages=STAGES, num_microbatches=MICROBATCHES)},
        "assignments": [{"gpu_index": 0, "plan": "main", "stage": STAGE, "rank": 0}],
        "profiling": {
            "frequencies_mhz": CLOCKS,
            "iterations_per_frequency": MEASURED,
            "warmup_iterations": WARMUP,
        },
    }


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="pprof-"))
    agent = Agent(tmp_path, socket_dir / "run", num_gpus=1)
    yield agent
    agent.kill_if_running()
    shutil.rmtree(socket_dir, ignore_errors=True)


def logged_profile(log: str) -> str:
    """The CSV the agent logged after its 'profiling ... done' line."""
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if DONE.search(line)) + 1
    assert lines[start] == "stage,instruction,frequency,time,energy", lines[start]
    rows = [lines[start]]
    for line in lines[start + 1 :]:
        if not re.fullmatch(r"\d+,(forward|backward),\d+,[0-9.e-]+,[0-9.e-]+", line):
            break
        rows.append(line)
    return "\n".join(rows) + "\n"


def test_agent_profiles_an_emulated_rank_over_three_clocks(agent: Agent) -> None:
    write_atomically(agent.plan_file, json.dumps(profiling_plan()))
    agent.start()
    steps = len(CLOCKS) * (WARMUP + MEASURED) + 2
    run_emulated_rank(
        agent,
        stage=STAGE,
        stages=STAGES,
        microbatches=MICROBATCHES,
        steps=steps,
        time_scale=TIME_SCALE,
        blocking_power_w=BLOCKING_POWER_W,
        bubble_s=BUBBLE_S,
        timeout_s=60,
    )
    wait_for(lambda: DONE.search(agent.log) is not None, "the profile", agent)
    log = agent.log

    for clock in CLOCKS:
        assert f"GPU 0: profiling stage 0 at {clock} MHz" in log
    match = DONE.search(log)
    assert match is not None
    assert (int(match.group(1)), int(match.group(2))) == (len(CLOCKS) * MEASURED, 0)
    # The rank waits BUBBLE_S at every iteration's start, at the blocking power; the time
    # between its computations (request round trips) adds a little busy-edge error.
    assert float(match.group(3)) == pytest.approx(BLOCKING_POWER_W, rel=0.1)
    measured = parse_profile(logged_profile(log), "agent log")
    truth = load_profile(PROFILE)
    assert measured.num_stages == 1
    for name in ("forward", "backward"):
        m, t = measured.get(STAGE, name), truth.get(STAGE, name)
        assert list(m.frequencies_mhz) == CLOCKS
        for clock, time_s, energy_j in zip(CLOCKS, m.times_s, m.energies_j, strict=True):
            k = list(t.frequencies_mhz).index(clock)
            want_s, want_j = t.times_s[k] * TIME_SCALE, t.energies_j[k] * TIME_SCALE
            # Never shorter than the computation, and not less energy; longer by the requests'
            # round trips and the rank's sleep overshooting, by how much depends on the
            # machine's load (tens of milliseconds seen in CI). So check the power, which that
            # does not change much: the GPU draws the profile's power while it computes.
            assert want_s <= time_s, (name, clock, time_s, want_s)
            assert energy_j >= 0.97 * want_j, (name, clock, energy_j, want_j)
            power_w, want_w = energy_j / time_s, want_j / want_s
            assert power_w == pytest.approx(want_w, rel=0.15), (name, clock, power_w, want_w)
        # Lower clocks: lower power, as in the profile the GPU follows.
        powers_w = list(m.energies_j / m.times_s)
        assert powers_w == sorted(powers_w, reverse=True)

    # Profiling is over: the GPU is back at its default clock, nothing is recorded.
    gpu = EmulatedBackend.from_csv(
        1,
        PROFILE,
        blocking_power_w=BLOCKING_POWER_W,
        node_name=NODE,
        state_file=agent.gpu_state,
    )
    assert gpu.locked_sm_clock_mhz(0) is None
    assert "every clock measured; SM clock reset" in log
    assert agent.stop() == 0
