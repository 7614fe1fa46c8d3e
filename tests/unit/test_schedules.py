"""Interleaved 1F1B and ZB-H1: per-GPU orders (by hand and against torch) and their DAGs."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest

from perseus_api.errors import ScheduleError
from perseus_api.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Schedule,
    Step,
    check_schedule_sizes,
    gpu_computation_order,
    stage_instruction_order,
)
from perseus_planner.dag import PipelineDAG, build_pipeline_dag, topological_order

_LETTER = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}

INTERLEAVED_SIZES = [(p, v, m) for p in (1, 2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p)]
ZB_SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 7, 10)]


def _labels(order: list[Step]) -> str:
    """``"0F0 2B1"``: virtual stage, instruction letter, microbatch."""
    return " ".join(f"{s.virtual_stage}{_LETTER[s.instruction]}{s.microbatch}" for s in order)


def _interleaved(p: int, v: int, m: int, gpu: int) -> str:
    return _labels(gpu_computation_order("interleaved-1f1b", p, m, gpu, v))


def _zb(p: int, m: int, gpu: int) -> str:
    return _labels(gpu_computation_order("zb-h1", p, m, gpu))


# -- hand-written orders -------------------------------------------------------------------


def test_interleaved_p2_v2_m4() -> None:
    # Megatron-LM: GPU p warms up (V-1)*P + 2*(P-1-p) forwards, one round (P microbatches)
    # of each chunk in turn; backwards go from the last chunk down, also round by round.
    assert (
        _interleaved(2, 2, 4, 0)
        == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    )
    assert (
        _interleaved(2, 2, 4, 1)
        == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )


def test_interleaved_p4_v2_m8() -> None:
    expected = [
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 "
        "0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 "
        "1B2 5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7",
        "2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 "
        "2B3 6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7",
        "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 "
        "7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7",
    ]
    assert [_interleaved(4, 2, 8, gpu) for gpu in range(4)] == expected


def test_interleaved_all_warmup_when_few_microbatches() -> None:
    # P=2, V=2, M=2: GPU 0's warm-up (2 + 2) covers every forward.
    assert _interleaved(2, 2, 2, 0) == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"
    assert _interleaved(2, 2, 2, 1) == "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"


def test_zb_h1_p4_m6() -> None:
    # 1F1B with B = backward_input; GPU p delays its first p weight passes to the cooldown.
    assert _zb(4, 6, 0) == "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5"
    assert _zb(4, 6, 1) == "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1I4 1W3 1I5 1W4 1W5"
    assert _zb(4, 6, 2) == "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2I5 2W3 2W4 2W5"
    assert _zb(4, 6, 3) == "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5"


def test_zb_h1_p2_m2() -> None:
    assert _zb(2, 2, 0) == "0F0 0F1 0I0 0W0 0I1 0W1"
    assert _zb(2, 2, 1) == "1F0 1I0 1F1 1I1 1W0 1W1"


# -- invariants ----------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED_SIZES)
def test_interleaved_runs_every_computation_once_on_its_gpu(p: int, v: int, m: int) -> None:
    for gpu in range(p):
        order = gpu_computation_order("interleaved-1f1b", p, m, gpu, v)
        expected = {
            Step(i, mb, c * p + gpu)
            for c in range(v)
            for i in (FORWARD, BACKWARD)
            for mb in range(m)
        }
        assert len(order) == len(expected) == 2 * v * m
        assert set(order) == expected


@pytest.mark.parametrize(("p", "m"), ZB_SIZES)
def test_zb_h1_is_1f1b_with_weight_passes_added(p: int, m: int) -> None:
    for gpu in range(p):
        order = gpu_computation_order("zb-h1", p, m, gpu)
        assert len(order) == len(set(order)) == 3 * m
        without_w = [
            (BACKWARD if s.instruction == BACKWARD_INPUT else s.instruction, s.microbatch)
            for s in order
            if s.instruction != BACKWARD_WEIGHT
        ]
        assert without_w == stage_instruction_order("1f1b", p, m, gpu)
        weights = [s.microbatch for s in order if s.instruction == BACKWARD_WEIGHT]
        assert weights == list(range(m))
        # ZB-H1's memory bound: microbatches whose weight pass is still to come never exceed
        # the P that 1F1B's first GPU holds.
        live = peak = 0
        for s in order:
            live += {FORWARD: 1, BACKWARD_WEIGHT: -1}.get(s.instruction, 0)
            peak = max(peak, live)
        assert peak <= min(p, m)


def _check_dag(dag: PipelineDAG) -> None:
    """Dependencies hold in every execution the DAG allows, and no cross-GPU edge is implied
    by the others (the solver would mistake it for a critical dependency)."""
    n = dag.num_nodes
    index = {(c.stage, c.instruction, c.microbatch): i for i, c in enumerate(dag.computations)}
    succ: list[list[int]] = [[] for _ in range(n)]
    for u, w in dag.edges.tolist():
        succ[u].append(w)
    reach = [0] * n  # bit sets of descendants
    for u in reversed(topological_order(n, dag.edges).tolist()):
        for w in succ[u]:
            reach[u] |= reach[w] | (1 << w)
    grad = BACKWARD_INPUT if dag.schedule.splits_backward else BACKWARD
    stages = dag.num_model_stages
    for s, mb in itertools.product(range(stages), range(dag.num_microbatches)):
        must = [((s, FORWARD, mb), (s, grad, mb))]
        if dag.schedule.splits_backward:
            must.append(((s, BACKWARD_INPUT, mb), (s, BACKWARD_WEIGHT, mb)))
        if s + 1 < stages:
            must += [((s, FORWARD, mb), (s + 1, FORWARD, mb)), ((s + 1, grad, mb), (s, grad, mb))]
        for a, b in must:
            assert reach[index[a]] >> index[b] & 1, f"{b} does not wait for {a}"
    for u in range(n):
        for w in succ[u]:
            if dag.computations[u].gpu != dag.computations[w].gpu:
                others = [x for x in succ[u] if x != w]
                assert not any(reach[x] >> w & 1 for x in others), "implied cross-GPU edge"
    for gpu, order in enumerate(dag.stage_order):
        assert all(dag.computations[i].gpu == gpu for i in order)
        assert all(dag.computations[i].stage % dag.num_stages == gpu for i in order)


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED_SIZES)
def test_interleaved_dag(p: int, v: int, m: int) -> None:
    dag = build_pipeline_dag("interleaved-1f1b", p, m, v)
    assert dag.schedule is Schedule.INTERLEAVED_1F1B
    assert (dag.num_stages, dag.virtual_stages, dag.num_model_stages) == (p, v, p * v)
    assert dag.num_nodes == 2 * p * v * m
    _check_dag(dag)


@pytest.mark.parametrize(("p", "m"), ZB_SIZES)
def test_zb_h1_dag(p: int, m: int) -> None:
    dag = build_pipeline_dag("zb-h1", p, m)
    assert dag.num_nodes == 3 * p * m
    _check_dag(dag)


@pytest.mark.parametrize(("schedule", "p", "m"), [("1f1b", 4, 6), ("gpipe", 3, 4), ("1f1b", 3, 2)])
def test_old_schedules_keep_their_dags(schedule: str, p: int, m: int) -> None:
    dag = build_pipeline_dag(schedule, p, m)
    _check_dag(dag)
    for gpu in range(p):
        steps = gpu_computation_order(schedule, p, m, gpu)
        assert [(s.instruction, s.microbatch) for s in steps] == stage_instruction_order(
            schedule, p, m, gpu
        )
        assert {s.virtual_stage for s in steps} == {gpu}


# -- input checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spelling", "schedule"),
    [
        ("Interleaved1F1B", Schedule.INTERLEAVED_1F1B),
        ("interleaved-1f1b", Schedule.INTERLEAVED_1F1B),
        ("ZBH1", Schedule.ZB_H1),
        ("zb-h1", Schedule.ZB_H1),
        ("ZB_H1", Schedule.ZB_H1),
    ],
)
def test_new_spellings(spelling: str, schedule: Schedule) -> None:
    assert Schedule.parse(spelling) is schedule


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v", "message"),
    [
        (
            "interleaved-1f1b",
            4,
            8,
            1,
            "at least 2 virtual stages per GPU, got 1 (with one, use 1f1b)",
        ),
        ("interleaved-1f1b", 4, 6, 2, "multiple of the pipeline stages"),
        ("1f1b", 4, 8, 2, "1f1b has one model stage per GPU; virtual stages (2) need interleaved"),
        ("zb-h1", 4, 8, 2, "zb-h1 has one model stage per GPU"),
        ("interleaved-1f1b", 4, 8, 0, "virtual_stages must be a positive integer, got 0"),
    ],
)
def test_sizes_the_schedule_does_not_take(
    schedule: str, p: int, m: int, v: int, message: str
) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        check_schedule_sizes(schedule, p, m, v)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        build_pipeline_dag(schedule, p, m, v)


def test_interleaved_has_no_ambiguous_instruction_order() -> None:
    with pytest.raises(ScheduleError, match="ambiguous; use gpu_computation_order"):
        stage_instruction_order("interleaved-1f1b", 2, 4, 0)


def test_gpu_out_of_range() -> None:
    with pytest.raises(ScheduleError, match=re.escape("stage must be in 0..1, got 2")):
        gpu_computation_order("zb-h1", 2, 4, 2)


# -- torch ---------------------------------------------------------------------------------


def _torch_order(schedule_class: Any, p: int, v: int, m: int, rank: int) -> str:
    """torch's own per-rank actions, from the schedule's ``_calculate_single_rank_operations``
    (built without process groups: only the attributes the order depends on are set)."""
    sched = schedule_class.__new__(schedule_class)
    sched.pp_group_size = p
    sched.n_local_stages = v
    sched._n_microbatches = m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    letters = {"F": "F", "B": "B", "I": "I", "W": "W"}
    out = []
    for action in sched._calculate_single_rank_operations(rank):
        if action is None:
            continue
        kind = action.computation_type.value  # an enum since torch 2.x: 'F', 'B', 'I', 'W'
        out.append(f"{action.stage_index}{letters[kind]}{action.microbatch_index}")
    return " ".join(out)


def test_orders_equal_torchs() -> None:
    schedules = pytest.importorskip(
        "torch.distributed.pipelining.schedules",
        reason="torch is not installed here; the orders follow its published algorithm",
    )
    for p, v, m in INTERLEAVED_SIZES:
        for rank in range(p):
            assert _interleaved(p, v, m, rank) == _torch_order(
                schedules.ScheduleInterleaved1F1B, p, v, m, rank
            ), (p, v, m, rank)
    for p, m in ZB_SIZES:
        if m % max(1, m // p):
            continue  # torch refuses these sizes; the order does not depend on its rounds
        for rank in range(p):
            assert _zb(p, m, rank) == _torch_order(
                schedules.ScheduleInterleavedZeroBubble, p, 1, m, rank
            ), (p, m, rank)
