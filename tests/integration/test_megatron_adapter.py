"""perseus_client.megatron against real Megatron-Core schedules (gloo, CPU processes).

Each test runs ``examples/megatron_pipeline.py``'s training as real processes through
``tests/support/megatron_cpu_worker.py``, the test-side shim that maps Megatron's CUDA
allocations to the CPU (what it hides, device sync and GPU identity, is untested until a GPU
run: see that file). Hooks reach the agent's real socket server and are recorded per rank.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from perseus_api.schedule import gpu_computation_order
from support.framework_job import MEGATRON_WORKER, require, run_recorded
from support.torch_job import computations, iteration_times_s, steps_of

MICROBATCHES = 4


@pytest.fixture(autouse=True)
def _megatron() -> None:
    require("megatron.core", "megatron")


@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_hooks_follow_the_planners_order_and_eval_reports_nothing(
    schedule: str, virtual: int
) -> None:
    """1F1B and interleaved 1F1B (P=2, V=2): each rank reports the planner's
    ``gpu_computation_order`` (chunk ``virtual_stage // P`` when interleaved, over protocol
    version 2), inside the training calls only: the closing ``forward_only`` call reports
    nothing."""
    pp, steps = 2, 2
    run = run_recorded(
        MEGATRON_WORKER,
        [
            *("--pp", str(pp), "--virtual", str(virtual), "--microbatches", str(MICROBATCHES)),
            *("--steps", str(steps), "--eval"),
        ],
    )
    assert sorted(run.events) == list(range(pp))
    for rank, events in run.events.items():
        hello = events[0].msg
        assert hello["rank"] == rank and hello["gpu_uuids"] == []
        if virtual > 1:
            assert hello["version"] == 2
        expected = [
            (s.instruction, s.microbatch, s.virtual_stage // pp if virtual > 1 else None)
            for s in gpu_computation_order(schedule, pp, MICROBATCHES, rank, virtual)
        ]
        recorded = steps_of(events)
        assert [s[0].msg["step"] for s in recorded] == list(range(steps))
        for step in recorded:
            assert computations(step) == expected, rank
    assert "Perseus: Megatron" not in run.stderr  # no warning: plannable, attached in time


def test_an_interleaved_order_the_planner_does_not_follow_gets_step_hooks_and_one_warning() -> None:
    """Interleaved with ``microbatch_group_size_per_vp_stage`` 4 (not the pipeline size):
    Megatron's order differs from the planner's, so iterations only, one warning per rank."""
    pp, steps = 2, 2
    run = run_recorded(
        MEGATRON_WORKER,
        [
            *("--pp", str(pp), "--virtual", "2", "--microbatches", "4"),
            *("--microbatch-group-size", "4", "--steps", str(steps)),
        ],
    )
    for events in run.events.values():
        assert [e.op for e in events] == ["hello"] + ["step_begin", "step_end"] * steps
    assert run.stderr.count("runs an order the planner does not follow") == pp


def test_a_straggler_replica_reports_longer_iterations(tmp_path: Path) -> None:
    """2 replicas x 2 stages; replica 1's forwards take 0.1 s longer. The iteration ends at
    the last backward, before the gradient all-reduce: the straggler's ranks report ~0.4 s
    more than the healthy replica's, while the steps timed by the training loop (the sync
    included) take as long on all."""
    slow_s, steps, pp = 0.1, 4, 2
    times_file = tmp_path / "step_times.jsonl"
    run = run_recorded(
        MEGATRON_WORKER,
        [
            *("--dp", "2", "--pp", str(pp), "--microbatches", str(MICROBATCHES)),
            *("--steps", str(steps), "--slow-replica", "1", "--slow-forward-s", str(slow_s)),
            *("--step-times", str(times_file)),
        ],
    )
    reported = {r: statistics.median(iteration_times_s(e)[1:]) for r, e in run.events.items()}
    replica: dict[int, tuple[int, int]] = {}
    around: dict[int, list[float]] = {}
    for line in times_file.read_text().splitlines():
        rec = json.loads(line)
        replica[rec["rank"]] = (rec["dp_rank"], rec["pp_rank"])
        if rec["step"] > 0:
            around.setdefault(rec["rank"], []).append((rec["end_ns"] - rec["begin_ns"]) / 1e9)
    by_place = {place: rank for rank, place in replica.items()}
    extra_s = MICROBATCHES * slow_s
    for stage in range(pp):
        healthy, straggler = by_place[0, stage], by_place[1, stage]
        assert reported[straggler] - reported[healthy] > extra_s / 2, reported
        timed = [statistics.median(around[r]) for r in (healthy, straggler)]
        assert abs(timed[1] - timed[0]) < extra_s / 4, timed
    # The healthy replica's ranks wait for the straggler at the all-reduce, after their end.
    assert statistics.median(around[by_place[0, 0]]) > reported[by_place[0, 0]] + extra_s / 2


def test_detach_gives_megatron_its_own_timers_and_schedule_functions_back() -> None:
    """In process, no job: ``attach`` wraps the config's timers and the schedule functions
    ``get_forward_backward_func`` picks from; a second ``attach`` of the same config is
    refused; ``detach`` restores both (the functions once no config is attached)."""
    import torch
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from perseus_client import PerseusClient
    from perseus_client.megatron import attach

    def config() -> TransformerConfig:
        return TransformerConfig(
            num_layers=2, hidden_size=16, num_attention_heads=1, pipeline_dtype=torch.float32
        )

    names = [
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ]
    originals = {n: getattr(schedules, n) for n in names}
    first, second = config(), config()
    timers = object()
    first.timers = timers
    client = PerseusClient("/nonexistent/agent.sock")
    a = attach(first, client=client)
    b = attach(second, client=client)
    try:
        assert first.timers is not timers and second.timers is not None
        assert all(getattr(schedules, n) is not originals[n] for n in names)
        with pytest.raises(ValueError, match="already attached"):
            attach(first, client=client)
        a.detach()
        assert first.timers is timers
        assert all(getattr(schedules, n) is not originals[n] for n in names)  # b still is
    finally:
        a.detach()
        b.detach()
        client.close()
    assert second.timers is None
    assert all(getattr(schedules, n) is originals[n] for n in names)
    with pytest.raises(TypeError, match="TransformerConfig"):
        attach(object(), client=client)
