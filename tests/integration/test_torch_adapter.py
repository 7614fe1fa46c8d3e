"""perseus_client.torch against real torch.distributed.pipelining jobs (gloo, CPU processes).

Each test runs ``examples/torch_pipeline.py`` (the README's example) as real processes whose
hooks reach the agent's real socket server, recording what each rank reports.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from perseus_api.schedule import gpu_computation_order, stage_instruction_order
from support.torch_job import (
    computations,
    iteration_times_s,
    require_torch,
    run_example,
    run_recorded,
    steps_of,
    unchunked,
)

MICROBATCHES = 4


@pytest.fixture(autouse=True)
def _torch() -> None:
    require_torch()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_hooks_follow_the_planners_order(schedule: str) -> None:
    """Each stage reports its computations in ``stage_instruction_order``'s order, inside
    ``step()`` only: the closing ``eval()`` and the stages' shape inference report nothing."""
    pp, steps = 2, 2
    run = run_recorded(
        [
            *("--pp", str(pp), "--schedule", schedule, "--microbatches", str(MICROBATCHES)),
            *("--steps", str(steps), "--eval"),
        ]
    )
    assert sorted(run.events) == list(range(pp))
    for rank, events in run.events.items():
        hello = events[0].msg
        assert hello["rank"] == rank  # from torch.distributed
        assert hello["gpu_uuids"] == []  # a CPU stage has no GPU to claim
        expected = stage_instruction_order(schedule, pp, MICROBATCHES, rank)
        recorded = steps_of(events)
        assert [s[0].msg["step"] for s in recorded] == list(range(steps))
        for step in recorded:
            assert computations(step) == unchunked(expected)


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_interleaved_and_zero_bubble_hooks_name_chunks_and_backward_halves(
    schedule: str, virtual_stages: int
) -> None:
    """ScheduleInterleaved1F1B (2 stages per rank) and ScheduleInterleavedZeroBubble (one):
    each rank reports, over protocol version 2, the planner's ``gpu_computation_order``,
    every computation with its chunk (``virtual_stage // P``) and split backwards named."""
    pp, steps = 2, 2
    run = run_recorded(
        [
            *("--pp", str(pp), "--schedule", schedule, "--microbatches", str(MICROBATCHES)),
            *("--steps", str(steps), "--eval"),
        ]
    )
    assert sorted(run.events) == list(range(pp))
    for rank, events in run.events.items():
        assert events[0].msg["version"] == 2
        expected = [
            (s.instruction, s.microbatch, s.virtual_stage // pp if virtual_stages > 1 else None)
            for s in gpu_computation_order(schedule, pp, MICROBATCHES, rank, virtual_stages)
        ]
        recorded = steps_of(events)
        assert len(recorded) == steps
        for step in recorded:
            assert computations(step) == expected, rank
    assert "cannot be planned per instruction" not in run.stderr


def test_schedule_the_planner_cannot_follow_gets_step_hooks_and_one_warning() -> None:
    run = run_recorded(
        ["--pp", "2", "--schedule", "looped-bfs", "--microbatches", "4", "--steps", "2"]
    )
    for events in run.events.values():
        assert [e.op for e in events] == ["hello"] + ["step_begin", "step_end"] * 2
    assert run.stderr.count("ScheduleLoopedBFS with 2 stage(s) per rank") == 2  # one per rank
    assert run.stderr.count("cannot be planned per instruction") == 2


def test_a_straggler_replica_reports_longer_iterations(tmp_path: Path) -> None:
    """2 replicas x 2 stages with DDP stages; replica 1's forwards take 0.1 s longer.

    The adapter ends each iteration before the data-parallel gradient sync: the straggler's
    ranks report ~0.4 s more than the healthy replica's. Timed around ``step()`` (after the
    sync), every rank of both replicas sees the same time.
    """
    slow_s, steps = 0.1, 5
    times_file = tmp_path / "step_times.jsonl"
    run = run_recorded(
        [
            *("--dp", "2", "--pp", "2", "--microbatches", str(MICROBATCHES), "--steps", str(steps)),
            *("--slow-replica", "1", "--slow-forward-s", str(slow_s)),
            *("--step-times", str(times_file)),
        ]
    )
    # rank = dp_rank * pp + pp_rank; the first step (warm-up, shape inference) is left out.
    reported = {r: statistics.median(iteration_times_s(e)[1:]) for r, e in run.events.items()}
    around_step: dict[int, list[float]] = {}
    for line in times_file.read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] > 0:
            around_step.setdefault(rec["rank"], []).append((rec["end_ns"] - rec["begin_ns"]) / 1e9)
    timed = {r: statistics.median(t) for r, t in around_step.items()}
    extra_s = MICROBATCHES * slow_s  # the straggler's stage 0 alone runs 0.4 s more
    for pp_rank in (0, 1):
        healthy, straggler = pp_rank, 2 + pp_rank
        assert reported[straggler] - reported[healthy] > extra_s / 2, reported
        assert abs(timed[straggler] - timed[healthy]) < extra_s / 4, timed
    # The healthy replica's ranks wait for the straggler at the sync, after their reported end.
    assert min(timed[0], timed[1]) > reported[0] + extra_s / 2


def test_ddp_with_a_communication_hook_keeps_its_sync_and_says_what_that_costs() -> None:
    """Where moving DDP's sync would bypass the user's communication hook, the adapter leaves
    it inside the last backward and warns: the last stage still ends before the sync (at its
    last gradient), the stage before it waits for the straggler's sync, as the warning says."""
    slow_s, steps = 0.1, 5
    run = run_recorded(
        [
            *("--dp", "2", "--pp", "2", "--microbatches", str(MICROBATCHES), "--steps", str(steps)),
            *("--slow-replica", "1", "--slow-forward-s", str(slow_s), "--ddp-comm-hook"),
        ]
    )
    assert run.stderr.count("DDP gradient sync stays inside its last backward") == 4
    reported = {r: statistics.median(iteration_times_s(e)[1:]) for r, e in run.events.items()}
    extra_s = MICROBATCHES * slow_s
    assert reported[3] - reported[1] > extra_s / 2, reported  # last stage: seen
    assert abs(reported[2] - reported[0]) < extra_s / 4, reported  # first stage: coupled


def test_moved_ddp_sync_gives_ddps_own_weights(tmp_path: Path) -> None:
    """With the adapter's DDP sync after the step, training ends with the weights DDP's own
    sync inside the last backward gives (and the replicas agree)."""
    args = ["--dp", "2", "--pp", "2", "--microbatches", str(MICROBATCHES), "--steps", "3"]
    weights: dict[str, dict[int, dict[str, list[list[float]] | list[float]]]] = {}
    for mode in ("perseus", "ddp"):
        out = tmp_path / mode
        out.mkdir()
        run_example(
            [*args, "--weights-out", str(out)] + (["--no-perseus"] if mode == "ddp" else [])
        )
        weights[mode] = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}

    def flat(w: dict[str, list[list[float]] | list[float]]) -> list[float]:
        values: list[float] = []
        for v in w.values():
            for row in v:
                values.extend(row if isinstance(row, list) else [row])
        return values

    for rank in range(4):
        ours, theirs = flat(weights["perseus"][rank]), flat(weights["ddp"][rank])
        assert len(ours) == len(theirs) > 0
        assert all(
            math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
            for a, b in zip(ours, theirs, strict=True)
        )
    for pp_rank in (0, 1):  # replicas of a stage hold the same weights
        assert flat(weights["perseus"][pp_rank]) == flat(weights["perseus"][2 + pp_rank])
