"""An emulated training rank: one pipeline stage's loop on an emulated GPU.

It plays the training process for tests and demos without GPUs: every step it
walks its stage's schedule, calls the ``perseus_client`` hooks around each
forward and backward exactly as real training code would, marks the emulated
GPU busy with that computation, and sleeps for the time the real profile
measured at the clock now in effect (scaled by ``--time-scale`` so tests run
fast). The GPU's energy counter, read by the node agent, then reflects the
plan the agent applied.

Waiting on other stages is modelled only as ``--bubble-s``: an idle wait (the GPU at
blocking power) at the start of every iteration, as a stage waits for its first input;
:mod:`perseus_emulation.job` runs every rank of a data-parallel x pipeline-parallel job
with the real dependencies between them.

It prints one JSON line at the end: ``step_times_s`` (each iteration's wall time) and
``busy_s`` (how long the GPU computed in all, sleep overshoot included).

Usage::

    python -m perseus_emulation.rank --state-file gpus.json --gpu-index 0 \\
        --profile gpt3.csv --blocking-power 83.64 --stage 0 --stages 8 \\
        --microbatches 4 --steps 10 --socket /run/perseus/agent.sock
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_api.schedule import Schedule, stage_instruction_order
from perseus_client import PerseusClient


def run_rank(
    gpu: EmulatedBackend,
    client: PerseusClient,
    *,
    gpu_index: int,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    steps: int,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    time_scale: float = 1.0,
    bubble_s: float = 0.0,
) -> RankRun:
    """Run ``steps`` iterations; return each one's wall time and the time the GPU was busy.

    ``bubble_s``: idle (blocked) time at the start of each iteration, not scaled.
    """
    order = stage_instruction_order(schedule, num_stages, num_microbatches, stage)
    step_times_s = []
    busy_start_s = gpu.busy_s(gpu_index)
    for step in range(steps):
        start_s = time.monotonic()
        client.on_step_begin(step)
        if bubble_s > 0:
            time.sleep(bubble_s)
        for instruction, microbatch in order:
            client.on_instruction_begin(instruction, microbatch)
            gpu.set_activity(gpu_index, stage, instruction)
            time.sleep(gpu.instruction_time_s(gpu_index, stage, instruction) * time_scale)
            gpu.set_activity(gpu_index, None, None)
            client.on_instruction_end(instruction)
        client.on_step_end(step)
        step_times_s.append(time.monotonic() - start_s)
    # Sleeps overshoot on a loaded machine and the GPU computes meanwhile: callers that check
    # energy need the time it really computed, as the emulated GPU counted it.
    return RankRun(step_times_s, gpu.busy_s(gpu_index) - busy_start_s)


@dataclass(frozen=True)
class RankRun:
    step_times_s: list[float]
    """Wall time of each iteration, seconds."""
    busy_s: float
    """Time the emulated GPU ran computations, in all, seconds."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="perseus-emulated-rank", description=__doc__)
    parser.add_argument("--state-file", type=Path, required=True, help="emulated GPU state")
    parser.add_argument("--num-gpus", type=int, default=1, help="GPUs in the state file")
    parser.add_argument("--gpu-index", type=int, default=0)
    parser.add_argument("--node-name", default="emulated")
    parser.add_argument("--profile", type=Path, required=True, help="profile CSV")
    parser.add_argument("--blocking-power", type=float, required=True, help="watts")
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--socket", type=Path, default=None, help="agent socket")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument(
        "--bubble-s", type=float, default=0.0, help="idle time at each iteration's start"
    )
    args = parser.parse_args(argv)
    try:
        gpu = EmulatedBackend.from_csv(
            args.num_gpus,
            args.profile,
            blocking_power_w=args.blocking_power,
            node_name=args.node_name,
            state_file=args.state_file,
        )
        schedule = Schedule.parse(args.schedule)
    except ValueError as exc:
        print(f"perseus-emulated-rank: error: {exc}", file=sys.stderr)
        return 2
    uuid = gpu.devices()[args.gpu_index].uuid
    client = PerseusClient(args.socket, rank=args.rank, gpu_uuids=[uuid])
    with client:
        run = run_rank(
            gpu,
            client,
            gpu_index=args.gpu_index,
            stage=args.stage,
            num_stages=args.stages,
            num_microbatches=args.microbatches,
            steps=args.steps,
            schedule=schedule,
            time_scale=args.time_scale,
            bubble_s=args.bubble_s,
        )
    print(json.dumps({"step_times_s": run.step_times_s, "busy_s": run.busy_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
