"""Real torch pipelining processes, attached with perseus_client.torch, driving a real node
agent (standalone, emulated GPUs) that applies an Instruction plan computation by computation.

The agent checks every ``instruction_begin`` against the plan's next computation and counts
``schedule_mismatch`` when they differ: a stream in another order, with wrong microbatch
ids, or with hooks outside the iteration (``eval()``, shape inference) would count here.
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

from perseus_api.profile import Profile, load_profile
from perseus_api.schedule import gpu_computation_order, stage_instruction_order
from perseus_planner.model_stages import derive_profile
from support.agent_process import NODE, PROFILE, Agent, wait_for, write_atomically
from support.factories import pipeline_plan_fields
from support.torch_job import recording_proxy, require_torch, run_example

STAGES, MICROBATCHES, STEPS = 2, 4, 3
BLOCKING_POWER_W = 83.64  # the agent's default for the bundled profile
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
    assert_plan_followed(agent)
    assert "training process rank 0" in agent.log and "training process rank 1" in agent.log


def assert_plan_followed(agent: Agent) -> None:
    """The agent applied the plan without a schedule mismatch, and forward and backward ran at
    different clocks: a change at least at every switch."""
    assert agent.metric("perseus_agent_apply_errors_total", reason="schedule_mismatch") in (
        [],
        [0.0],
    ), agent.log
    for gpu in ("0", "1"):
        changes = agent.metric("perseus_gpu_clock_changes_total", gpu=gpu)
        assert changes and changes[0] >= 2 * STEPS, (gpu, changes)


# Each chunk and each backward half at a clock of its own (supported by the emulated A100).
CHUNKED_CLOCK_MHZ = {
    ("forward", 0): 1410,
    ("forward", 1): 1305,
    ("backward", 0): 1005,
    ("backward", 1): 1200,
    ("backward_input", 0): 1110,
    ("backward_weight", 0): 1005,
}


def chunked_plan(schedule: str, virtual_stages: int) -> dict[str, Any]:
    """An Instruction plan of interleaved 1F1B (entries with their ``virtual_stage``) or
    ZB-H1 (split backwards), in the planner's per-GPU order."""
    node_plan = instruction_plan("1f1b")
    plan = node_plan["plans"]["main"]
    plan["schedule"], plan["virtual_stages"] = schedule, virtual_stages
    for stage in plan["stages"]:
        stage["instructions"] = [
            {
                "instruction": step.instruction,
                "microbatch": step.microbatch,
                "frequency_mhz": CHUNKED_CLOCK_MHZ[step.instruction, step.virtual_stage // STAGES],
                **({"virtual_stage": step.virtual_stage} if virtual_stages > 1 else {}),
            }
            for step in gpu_computation_order(
                schedule, STAGES, MICROBATCHES, stage["stage"], virtual_stages
            )
        ]
    return node_plan


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_the_agent_follows_interleaved_and_zero_bubble_torch_schedules(
    agent: Agent, schedule: str, virtual_stages: int
) -> None:
    """ScheduleInterleaved1F1B (P=2, V=2) and ScheduleInterleavedZeroBubble (ZB-H1), real
    processes: the agent receives, over protocol version 2, each rank's planner order with
    chunks and backward halves (recorded on the wire), and applies the plan without a
    mismatch."""
    write_atomically(agent.plan_file, json.dumps(chunked_plan(schedule, virtual_stages)))
    agent.start()
    with recording_proxy(agent.socket_dir / "agent.sock") as (proxy, wire):
        run_example(
            [
                *("--pp", str(STAGES), "--schedule", schedule),
                *("--microbatches", str(MICROBATCHES), "--steps", str(STEPS), "--eval"),
            ],
            socket_path=proxy,
        )

        def measured() -> bool:
            counts = [agent.metric("perseus_iteration_seconds_count", gpu=str(g)) for g in (0, 1)]
            return all(c == [float(STEPS)] for c in counts)

        wait_for(measured, f"{STEPS} iterations of each rank in the agent's metrics", agent)
    streams = wire.by_rank()
    assert all(requests[0]["version"] == 2 for requests in streams.values())
    assert_wire_follows_the_planners_order(streams, schedule, virtual_stages)
    assert_plan_followed(agent)


def assert_wire_follows_the_planners_order(
    streams: dict[int, list[dict[str, Any]]], schedule: str, virtual_stages: int
) -> None:
    """Every rank sent, ``STEPS`` times, its ``gpu_computation_order`` (with the chunk,
    ``virtual_stage // P``, when it runs several stages) as its instruction begins."""
    assert sorted(streams) == list(range(STAGES))
    for rank, requests in streams.items():
        begins = [
            (r["name"], r["microbatch"], r.get("chunk"))
            for r in requests
            if r["op"] == "instruction_begin"
        ]
        order = [
            (s.instruction, s.microbatch, s.virtual_stage // STAGES if virtual_stages > 1 else None)
            for s in gpu_computation_order(schedule, STAGES, MICROBATCHES, rank, virtual_stages)
        ]
        assert begins == order * STEPS, rank


CLOCKS = [1410, 1005]
WARMUP, MEASURED = 1, 2


def profiling(node_plan: dict[str, Any]) -> dict[str, Any]:
    """``node_plan`` asking for a profiling run: each of :data:`CLOCKS` for :data:`WARMUP`
    then :data:`MEASURED` iterations."""
    node_plan["profiling"] = {
        "frequencies_mhz": CLOCKS,
        "iterations_per_frequency": MEASURED,
        "warmup_iterations": WARMUP,
    }
    return node_plan


def done_pattern(gpu: int) -> re.Pattern[str]:
    return re.compile(
        rf"GPU {gpu} \(\S+\): profiling of stage {gpu} done: (\d+) iterations measured, "
        r"(\d+) dropped, blocking power ([0-9.]+) W"
    )


def logged_profile(log: str, gpu: int) -> dict[tuple[str, int], tuple[float, float]]:
    """``(instruction, clock) -> (time_s, energy_j)`` of the CSV rows the agent logged after
    GPU ``gpu``'s 'profiling ... done' line."""
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if done_pattern(gpu).search(line)) + 1
    assert lines[start] == "stage,instruction,frequency,time,energy", lines[start]
    rows: dict[tuple[str, int], tuple[float, float]] = {}
    for line in lines[start + 1 :]:
        if not re.fullmatch(r"\d+,(forward|backward),\d+,[0-9.e-]+,[0-9.e-]+", line):
            break
        stage, name, clock, time_s, energy_j = line.split(",")
        assert int(stage) == gpu
        rows[name, int(clock)] = float(time_s), float(energy_j)
    return rows


def assert_profile_measured(agent: Agent) -> None:
    """Once every GPU's sweep is done: each measured every clock ``MEASURED`` times, dropped
    nothing, and its time and power per (computation, clock) match the profile the emulated
    GPUs follow."""
    for gpu in range(STAGES):
        wait_for(lambda g=gpu: done_pattern(g).search(agent.log) is not None, "profiles", agent)
    truth = load_profile(PROFILE)
    for gpu in range(STAGES):
        match = done_pattern(gpu).search(agent.log)
        assert match is not None
        assert (int(match.group(1)), int(match.group(2))) == (len(CLOCKS) * MEASURED, 0)
        measured = logged_profile(agent.log, gpu)
        assert sorted(measured) == sorted((n, c) for n in ("forward", "backward") for c in CLOCKS)
        for (name, clock), (time_s, energy_j) in measured.items():
            t = truth.get(gpu, name)
            k = list(t.frequencies_mhz).index(clock)
            want_s, want_j = t.times_s[k], t.energies_j[k]
            # Never shorter than profiled (the padding); longer by the hooks' round trips
            # and sleep overshoot on a loaded machine: compare the power, as
            # test_agent_profiling does.
            assert want_s <= time_s <= 1.5 * want_s, (gpu, name, clock, time_s, want_s)
            power_w, want_w = energy_j / time_s, want_j / want_s
            assert power_w == pytest.approx(want_w, rel=0.15), (gpu, name, clock, power_w)


def test_the_agent_profiles_real_torch_processes_on_emulated_gpus(agent: Agent) -> None:
    """Profiling measured from the real processes: their computations take the profile's
    time at each clock the agent locks (padded on the emulated GPUs), and the agent's
    measured time and power per clock match the profile the GPUs follow."""
    node_plan = profiling(instruction_plan("1f1b"))
    write_atomically(agent.plan_file, json.dumps(node_plan))
    agent.start()
    steps = len(CLOCKS) * (WARMUP + MEASURED) + 2
    run_example(
        [
            *("--pp", str(STAGES), "--schedule", "1f1b"),
            *("--microbatches", str(MICROBATCHES), "--steps", str(steps)),
            *("--emulated-gpus", str(agent.gpu_state), "--emulated-profile", str(PROFILE)),
            *("--blocking-power", str(BLOCKING_POWER_W), "--node-name", NODE),
        ],
        socket_path=agent.socket_dir / "agent.sock",
    )
    assert_profile_measured(agent)


def derived_profile_csv(path: Path, schedule: str, virtual_stages: int) -> Profile:
    """The bundled profile's first two stages in ``schedule``'s form (P x V stages, or split
    backwards), written to ``path``: what the emulated GPUs of that job follow."""
    bundled = load_profile(PROFILE)
    two = Profile(
        "two stages",
        STAGES,
        {k: m for k, m in bundled.measurements.items() if k[0] < STAGES},
    )
    truth = derive_profile(two, schedule, virtual_stages)
    lines = ["stage,instruction,frequency,time,energy"]
    for (stage, name), m in truth.measurements.items():
        for clock, t, e in zip(m.frequencies_mhz, m.times_s, m.energies_j, strict=True):
            lines.append(f"{stage},{name},{int(clock)},{float(t)!r},{float(e)!r}")
    path.write_text("\n".join(lines) + "\n")
    return truth


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_the_agent_profiles_each_chunk_and_backward_half_of_real_torch_processes(
    tmp_path: Path, schedule: str, virtual_stages: int
) -> None:
    """Interleaved (P=2, V=2) and ZB-H1 torch jobs on emulated GPUs that follow a profile in
    the schedule's form: the agent measures every model stage on its GPU (stage v*P+p on GPU
    p) and every backward half, at the profile's power."""
    require_torch()
    csv_path = tmp_path / "truth.csv"
    truth = derived_profile_csv(csv_path, schedule, virtual_stages)
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="ptpf-"))
    agent = Agent(
        tmp_path,
        socket_dir / "run",
        num_gpus=STAGES,
        log_level="info",
        emulated_profile=(csv_path, BLOCKING_POWER_W),
    )
    try:
        node_plan = profiling(chunked_plan(schedule, virtual_stages))
        write_atomically(agent.plan_file, json.dumps(node_plan))
        agent.start()
        run_example(
            [
                *("--pp", str(STAGES), "--schedule", schedule, "--microbatches", str(MICROBATCHES)),
                *("--steps", str(len(CLOCKS) * (WARMUP + MEASURED) + 2)),
                *("--emulated-gpus", str(agent.gpu_state), "--emulated-profile", str(csv_path)),
                *("--blocking-power", str(BLOCKING_POWER_W), "--node-name", NODE),
            ],
            socket_path=agent.socket_dir / "agent.sock",
        )
        for gpu in range(STAGES):
            wait_for(lambda g=gpu: done_pattern(g).search(agent.log) is not None, "profile", agent)
        for gpu in range(STAGES):
            match = done_pattern(gpu).search(agent.log)
            assert match is not None
            assert (int(match.group(1)), int(match.group(2))) == (len(CLOCKS) * MEASURED, 0)
            rows = logged_rows(agent.log, gpu)
            order = gpu_computation_order(schedule, STAGES, MICROBATCHES, gpu, virtual_stages)
            kinds = {(s.virtual_stage, s.instruction) for s in order}
            assert sorted(rows) == sorted((*k, c) for k in kinds for c in CLOCKS)
            for (stage, name, clock), (time_s, energy_j) in rows.items():
                t = truth.get(stage, name)
                k = list(t.frequencies_mhz).index(clock)
                want_s, want_j = t.times_s[k], t.energies_j[k]
                assert want_s <= time_s <= 1.5 * want_s, (gpu, stage, name, clock, time_s)
                power_w, want_w = energy_j / time_s, want_j / want_s
                assert power_w == pytest.approx(want_w, rel=0.15), (gpu, stage, name, clock)
    finally:
        agent.kill_if_running()
        shutil.rmtree(socket_dir, ignore_errors=True)


def logged_rows(log: str, gpu: int) -> dict[tuple[int, str, int], tuple[float, float]]:
    """``(model stage, instruction, clock) -> (time_s, energy_j)`` of the CSV rows the agent
    logged after GPU ``gpu``'s 'profiling ... done' line."""
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if done_pattern(gpu).search(line)) + 1
    assert lines[start] == "stage,instruction,frequency,time,energy", lines[start]
    rows: dict[tuple[int, str, int], tuple[float, float]] = {}
    for line in lines[start + 1 :]:
        if not re.fullmatch(r"\d+,(forward|backward\w*),\d+,[0-9.e-]+,[0-9.e-]+", line):
            break
        stage, name, clock, time_s, energy_j = line.split(",")
        rows[int(stage), name, int(clock)] = float(time_s), float(energy_j)
    return rows
