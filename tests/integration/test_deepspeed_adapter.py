"""perseus_client.deepspeed against real DeepSpeed PipelineEngine jobs (gloo, CPU processes).

Each test runs ``examples/deepspeed_pipeline.py`` as real processes (DeepSpeed 0.19.8,
``DS_ACCELERATOR=cpu``) whose hooks reach the agent's real socket server, recording what each
rank reports. DeepSpeed puts replica ``d`` of stage ``s`` on global rank ``s * dp + d``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from perseus_api.schedule import stage_instruction_order
from support.framework_job import DEEPSPEED_EXAMPLE, require, run_recorded
from support.torch_job import computations, iteration_times_s, steps_of, unchunked

MICROBATCHES = 4


@pytest.fixture(autouse=True)
def _deepspeed() -> None:
    require("deepspeed", "deepspeed")


def test_hooks_follow_the_planners_1f1b_order_and_eval_reports_nothing() -> None:
    """Each stage reports TrainSchedule's computations in ``stage_instruction_order("1f1b")``,
    microbatches counted from the buffer-id instructions, inside ``train_batch()`` only: the
    closing ``eval_batch()`` reports nothing."""
    pp, steps = 2, 2
    run = run_recorded(
        DEEPSPEED_EXAMPLE,
        ["--pp", str(pp), "--microbatches", str(MICROBATCHES), "--steps", str(steps), "--eval"],
    )
    assert sorted(run.events) == list(range(pp))
    for rank, events in run.events.items():
        hello = events[0].msg
        assert hello["rank"] == rank  # from torch.distributed
        assert hello["gpu_uuids"] == []  # a CPU engine has no GPU to claim
        assert hello["version"] in (1, 2)
        expected = stage_instruction_order("1f1b", pp, MICROBATCHES, rank)
        recorded = steps_of(events)
        assert [s[0].msg["step"] for s in recorded] == list(range(steps))
        for step in recorded:
            assert computations(step) == unchunked(expected), rank  # no chunk: one stage
    assert "order the planner does not follow" not in run.stderr


def test_dualpipev_gets_step_hooks_and_one_warning() -> None:
    """DualPipeVEngine (two stages per rank, forwards and backwards of both overlapped) is not
    an order the planner follows: iterations only, one warning per rank."""
    pp, steps = 2, 2
    run = run_recorded(
        DEEPSPEED_EXAMPLE,
        [
            *("--pp", str(pp), "--schedule", "dualpipev", "--microbatches", str(2 * pp)),
            *("--steps", str(steps), "--eval"),
        ],
    )
    assert sorted(run.events) == list(range(pp))
    for events in run.events.values():
        assert [e.op for e in events] == ["hello"] + ["step_begin", "step_end"] * steps
    assert run.stderr.count("DualPipeVEngine runs DualPipeVSchedule") == pp


def test_a_straggler_replica_reports_longer_iterations(tmp_path: Path) -> None:
    """2 replicas x 2 stages; replica 1's forwards take 0.1 s longer. The iteration ends at
    the last backward, before ReduceGrads: the straggler's ranks report ~0.4 s more than the
    healthy replica's, while ``train_batch()`` itself (after the sync) takes as long on all."""
    slow_s, steps, dp, pp = 0.1, 4, 2, 2
    times_file = tmp_path / "step_times.jsonl"
    run = run_recorded(
        DEEPSPEED_EXAMPLE,
        [
            *("--dp", str(dp), "--pp", str(pp), "--microbatches", str(MICROBATCHES)),
            *("--steps", str(steps), "--slow-replica", "1", "--slow-forward-s", str(slow_s)),
            *("--step-times", str(times_file)),
        ],
    )
    # The first step (warm-up: shapes exchanged, buffers allocated) is left out.
    reported = {r: statistics.median(iteration_times_s(e)[1:]) for r, e in run.events.items()}
    around: dict[int, list[float]] = {}
    for line in times_file.read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] > 0:
            around.setdefault(rec["rank"], []).append((rec["end_ns"] - rec["begin_ns"]) / 1e9)
    timed = {r: statistics.median(t) for r, t in around.items()}
    extra_s = MICROBATCHES * slow_s  # the straggler's stage 0 alone runs 0.4 s more
    for stage in range(pp):
        healthy, straggler = stage * dp, stage * dp + 1
        assert reported[straggler] - reported[healthy] > extra_s / 2, reported
        assert abs(timed[straggler] - timed[healthy]) < extra_s / 4, timed
