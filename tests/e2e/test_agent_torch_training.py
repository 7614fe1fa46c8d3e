"""Real torch pipelining processes, attached with perseus_client.torch, driving a real node
agent (standalone, emulated GPUs) that applies an Instruction plan computation by computation.

The agent checks every ``instruction_begin`` against the plan's next computation and counts
``schedule_mismatch`` when they differ: a stream in another order, with wrong microbatch
ids, or with hooks outside the iteration (``eval()``, shape inference) would count here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_process import NODE, Agent, wait_for, write_atomically
from factories import pipeline_plan_fields
from perseus_api.schedule import stage_instruction_order
from torch_job import require_torch, run_example

pytestmark = pytest.mark.e2e

STAGES, MICROBATCHES, STEPS = 2, 4, 3
CLOCK_MHZ = {"forward": 1410, "backward": 1005}


def instruction_plan(schedule: str) -> dict[str, Any]:
    plan = pipeline_plan_fields(num_stages=STAGES, num_microbatches=MICROBATCHES)
    plan["schedule"] = schedule
    for stage in plan["stages"]:
        stage["instructions"] = [
            {"instruction": kind, "microbatch": m, "frequency_mhz": CLOCK_MHZ[kind]}
            for kind, m in stage_instruction_order(schedule, STAGES, MICROBATCHES, stage["stage"])
        ]
    return {
        "node": NODE,
        "namespace": "ml",
        "job": "tiny",
        "revision": 1,
        "granularity": "Instruction",
        "plans": {"main": plan},
        # CPU stages claim no GPU: the agent matches them by their torch.distributed rank.
        "assignments": [
            {"gpu_index": s, "plan": "main", "stage": s, "rank": s} for s in range(STAGES)
        ],
    }


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    require_torch()
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="ptag-"))
    agent = Agent(tmp_path, socket_dir / "run", num_gpus=STAGES, log_level="info")
    yield agent
    agent.kill_if_running()
    shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_agent_follows_a_torch_schedule_without_a_mismatch(agent: Agent, schedule: str) -> None:
    write_atomically(agent.plan_file, json.dumps(instruction_plan(schedule)))
    agent.start()
    run_example(
        [
            *("--pp", str(STAGES), "--schedule", schedule),
            *("--microbatches", str(MICROBATCHES), "--steps", str(STEPS), "--eval"),
        ],
        socket_path=agent.socket_dir / "agent.sock",
    )

    def measured() -> bool:
        counts = [agent.metric("perseus_iteration_seconds_count", gpu=str(g)) for g in (0, 1)]
        return all(c == [float(STEPS)] for c in counts)

    wait_for(measured, f"{STEPS} iterations of each rank in the agent's metrics", agent)
    assert agent.metric("perseus_agent_apply_errors_total", reason="schedule_mismatch") in (
        [],
        [0.0],
    ), agent.log
    for gpu in ("0", "1"):
        # Forward and backward run at different clocks: a change at least at every switch.
        changes = agent.metric("perseus_gpu_clock_changes_total", gpu=gpu)
        assert changes and changes[0] >= 2 * STEPS, (gpu, changes)
    assert "training process rank 0" in agent.log and "training process rank 1" in agent.log
