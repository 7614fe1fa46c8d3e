"""Real DeepSpeed and Megatron-Core processes, attached with perseus_client.deepspeed and
perseus_client.megatron, driving a real node agent (standalone, emulated GPUs) that applies an
Instruction plan computation by computation, and profiles them.

As for torch (``test_agent_torch_training.py``, whose plans and checks these reuse): the agent
checks every ``instruction_begin`` against the plan's next computation and counts
``schedule_mismatch`` when they differ, so a stream in another order, with wrong microbatch or
chunk ids, or with hooks outside the iteration (``eval_batch()``, ``forward_only``) counts.
Megatron runs through the test-side CPU shim (``tests/support/megatron_cpu_worker.py``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_agent_torch_training import (
    BLOCKING_POWER_W,
    CLOCKS,
    MEASURED,
    MICROBATCHES,
    STAGES,
    STEPS,
    WARMUP,
    assert_plan_followed,
    assert_profile_measured,
    assert_wire_follows_the_planners_order,
    chunked_plan,
    instruction_plan,
    profiling,
)

from support.agent_process import NODE, PROFILE, Agent, wait_for, write_atomically
from support.framework_job import DEEPSPEED_EXAMPLE, MEGATRON_WORKER, require, run_script
from support.torch_job import recording_proxy

FRAMEWORKS = {
    "deepspeed": (DEEPSPEED_EXAMPLE, "deepspeed"),
    "megatron": (MEGATRON_WORKER, "megatron.core"),
}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="pfag-"))
    agent = Agent(tmp_path, socket_dir / "run", num_gpus=STAGES, log_level="info")
    yield agent
    agent.kill_if_running()
    shutil.rmtree(socket_dir, ignore_errors=True)


def measured(agent: Agent, steps: int) -> None:
    def done() -> bool:
        counts = [agent.metric("perseus_iteration_seconds_count", gpu=str(g)) for g in (0, 1)]
        return all(c == [float(steps)] for c in counts)

    wait_for(done, f"{steps} iterations of each rank in the agent's metrics", agent)


@pytest.mark.parametrize(
    ("framework", "schedule", "virtual"),
    [("deepspeed", "1f1b", 1), ("megatron", "1f1b", 1), ("megatron", "interleaved-1f1b", 2)],
)
def test_the_agent_follows_the_frameworks_schedule_without_a_mismatch(
    agent: Agent, framework: str, schedule: str, virtual: int
) -> None:
    """DeepSpeed's TrainSchedule and Megatron's 1F1B and interleaved 1F1B (P=2, V=2), real
    processes: the wire carries each rank's planner order (chunks when interleaved), and the
    agent applies the plan, evaluation after training included, without a mismatch."""
    script, module = FRAMEWORKS[framework]
    require(module, framework)
    plan = instruction_plan("1f1b") if virtual == 1 else chunked_plan(schedule, virtual)
    write_atomically(agent.plan_file, json.dumps(plan))
    agent.start()
    args = ["--pp", str(STAGES), "--microbatches", str(MICROBATCHES), "--steps", str(STEPS)]
    if framework == "megatron":
        args += ["--virtual", str(virtual)]
    with recording_proxy(agent.socket_dir / "agent.sock") as (proxy, wire):
        run_script(script, [*args, "--eval"], socket_path=proxy)
        measured(agent, STEPS)
    assert_wire_follows_the_planners_order(wire.by_rank(), schedule, virtual)
    assert_plan_followed(agent)
    assert "training process rank 0" in agent.log and "training process rank 1" in agent.log


@pytest.mark.parametrize("framework", ["deepspeed", "megatron"])
def test_the_agent_profiles_real_framework_processes_on_emulated_gpus(
    agent: Agent, framework: str
) -> None:
    """Profiling measured from the real processes: each forward and backward is padded to the
    profile's time at the clock the agent locked (``perseus_emulation.instruction_padding``),
    and the agent's measured time and power per clock match the profile the GPUs follow."""
    script, module = FRAMEWORKS[framework]
    require(module, framework)
    write_atomically(agent.plan_file, json.dumps(profiling(instruction_plan("1f1b"))))
    agent.start()
    steps = len(CLOCKS) * (WARMUP + MEASURED) + 2
    run_script(
        script,
        [
            *("--pp", str(STAGES), "--microbatches", str(MICROBATCHES), "--steps", str(steps)),
            *("--emulated-gpus", str(agent.gpu_state), "--emulated-profile", str(PROFILE)),
            *("--blocking-power", str(BLOCKING_POWER_W), "--node-name", NODE),
        ],
        socket_path=agent.socket_dir / "agent.sock",
    )
    assert_profile_measured(agent)
