"""The plan applier against an in-memory GPU backend."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.errors import GpuLostError, GpuNoPermissionError, PlanError
from perseus_agent.gpu.base import GpuInfo
from perseus_agent.profiling.energy_sampler import EnergySampler
from perseus_agent.profiling.profiler import profile_csv
from perseus_agent.serving.local_server import LocalServer
from perseus_api.node_plan import NodePlan, ProfilingSpec
from perseus_api.node_report import GpuStatus, NodeReport
from perseus_api.profile import parse_profile
from support.applier_calls import (
    NODE,
    STAGE0_SCHEDULE,
    STAGE1_SCHEDULE,
    begin,
    gpu,
    hello,
    node_plan,
    session,
    step_begin,
)
from support.fake_gpu import FakeBackend
from support.profile_table import BLOCKING_W, TABLE
from support.simulated_profiling import Profiling, RecordingSampler


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(num_gpus=4)


@pytest.fixture
def state(tmp_path: Path) -> ResetState:
    return ResetState(tmp_path)


@pytest.fixture
def applier(backend: FakeBackend, state: ResetState) -> PlanApplier:
    return PlanApplier(backend, state, NODE)


# -- Stage granularity ---------------------------------------------------------------------------


def test_stage_granularity_locks_each_gpu_to_its_stage_clock(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    report = applier.apply(node_plan([gpu(0, 0, rank=0), gpu(1, 1, by_uuid=False, dp_rank=1)]))

    assert backend.locked() == {0: 1200, 1: 1005}
    assert (report.node, report.namespace, report.job, report.revision) == (NODE, "ml", "gpt3", 1)
    assert [
        (g.uuid, g.index, g.stage, g.target_mhz, g.applied_mhz, g.status) for g in report.gpus
    ] == [
        ("GPU-0", 0, 0, 1200, 1200, GpuStatus.APPLIED),
        ("GPU-1", 1, 1, 1005, 1005, GpuStatus.APPLIED),
    ]
    assert report.gpus[1].dp_rank == 1
    assert applier.metrics.clock_changes(0) == 1
    managed = applier.managed_gpus()
    assert managed[1].labels == {
        "namespace": "ml",
        "job": "gpt3",
        "pod": "",
        "dp_rank": "1",
        "pp_rank": "1",
    }
    assert managed[1].target_mhz == 1005
    assert report.model_dump(mode="json")["gpus"][0]["status"] == "Applied"


def test_the_report_carries_each_gpus_energy_counter(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    """The operator's power budgets derive the draw from it; a GPU that cannot read its
    counter reports none, and the report goes on."""
    applier.apply(node_plan([gpu(0, 0), gpu(1, 1)]))
    backend.gpus[1].energy_j = 4321.5
    report = applier.report()
    assert report is not None
    assert [g.energy_j for g in report.gpus] == [0.0, 4321.5]
    assert report.model_dump(mode="json", by_alias=True)["gpus"][1]["energyJoules"] == 4321.5

    backend.fail[("energy_j", 1)] = GpuLostError("fell off the bus", 1)
    report = applier.report()
    assert report is not None
    assert [g.energy_j for g in report.gpus] == [0.0, None]


def test_unsupported_clock_is_clamped_to_the_nearest_supported_one(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    report = applier.apply(node_plan([gpu(0, 0), gpu(1, 1)], stage_mhz=(1203, 1500)))

    assert backend.locked() == {0: 1200, 1: 1410}
    g0, g1 = report.gpus
    assert (g0.status, g0.target_mhz, g0.applied_mhz) == (GpuStatus.CLAMPED, 1203, 1200)
    assert "1203 MHz" in g0.message and "1200 MHz" in g0.message
    assert (g1.status, g1.target_mhz, g1.applied_mhz) == (GpuStatus.CLAMPED, 1500, 1410)


def test_unknown_gpus_are_reported_per_assignment(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    report = applier.apply(
        node_plan(
            [
                gpu(0, 0),
                {"gpu_uuid": "GPU-99", "plan": "tmin", "stage": 1},
                gpu(7, 1, by_uuid=False),
            ]
        )
    )

    assert backend.locked() == {0: 1200}
    statuses = [(g.uuid, g.index, g.status) for g in report.gpus]
    assert statuses == [
        ("GPU-0", 0, GpuStatus.APPLIED),
        ("GPU-99", None, GpuStatus.FAILED),
        (None, 7, GpuStatus.FAILED),
    ]
    assert "no GPU with UUID GPU-99 on node node-1" in report.gpus[1].message
    assert "no GPU with index 7" in report.gpus[2].message
    assert applier.metrics.error_count("unknown_gpu") == 2


def test_same_gpu_by_uuid_and_by_index_is_refused_once(applier: PlanApplier) -> None:
    report = applier.apply(node_plan([gpu(1, 0), gpu(1, 1, by_uuid=False)]))
    assert [g.status for g in report.gpus] == [GpuStatus.APPLIED, GpuStatus.FAILED]
    assert "already assigned as GPU-1" in report.gpus[1].message


def test_gpu_error_fails_that_gpu_only(applier: PlanApplier, backend: FakeBackend) -> None:
    backend.fail[("lock_sm_clock", 1)] = GpuNoPermissionError("insufficient permissions", 1)
    plan = node_plan([gpu(0, 0), gpu(1, 1), gpu(2, 1)])

    report = applier.apply(plan)

    assert backend.locked() == {0: 1200, 2: 1005}
    assert [g.status for g in report.gpus] == [
        GpuStatus.APPLIED,
        GpuStatus.FAILED,
        GpuStatus.APPLIED,
    ]
    assert report.gpus[1].message == "no_permission: insufficient permissions"
    assert report.gpus[1].applied_mhz is None
    assert applier.metrics.error_count("no_permission") == 1

    # The GPU recovers: re-applying retries it, and only it.
    del backend.fail[("lock_sm_clock", 1)]
    backend.calls.clear()
    report = applier.apply(plan)
    assert [g.status for g in report.gpus] == [GpuStatus.APPLIED] * 3
    assert backend.mutating_calls() == [("lock_sm_clock", 1, 1005)]


def test_reapplying_the_same_plan_makes_no_gpu_calls(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    assignments = [gpu(0, 0), gpu(1, 1)]
    applier.apply(node_plan(assignments))
    backend.calls.clear()

    first = applier.apply(node_plan(assignments))
    second = applier.apply(node_plan(assignments, revision=2))

    # Only the reports' reads of the energy counters (for the power budgets).
    assert {c[0] for c in backend.calls} <= {"energy_j"}
    assert second.revision == 2
    assert [g.status for g in first.gpus] == [GpuStatus.APPLIED, GpuStatus.APPLIED]
    assert applier.metrics.clock_changes(0) == 1


def test_new_revision_changes_clocks_and_resets_dropped_gpus(
    applier: PlanApplier, backend: FakeBackend, state: ResetState
) -> None:
    applier.apply(node_plan([gpu(0, 0), gpu(1, 1), gpu(2, 1)]))
    assert backend.locked() == {0: 1200, 1: 1005, 2: 1005}
    backend.calls.clear()

    report = applier.apply(node_plan([gpu(0, 0), gpu(2, 1)], revision=2, stage_mhz=(1200, 900)))

    assert backend.locked() == {0: 1200, 2: 900}
    assert sorted(backend.mutating_calls(), key=str) == [
        ("lock_sm_clock", 2, 900),
        ("reset_sm_clock", 1),
    ]
    assert [g.index for g in report.gpus] == [0, 2]
    assert [e.uuid for e in state.entries()] == ["GPU-0", "GPU-2"]


def test_clear_resets_every_gpu(
    applier: PlanApplier, backend: FakeBackend, state: ResetState
) -> None:
    applier.apply(node_plan([gpu(0, 0), gpu(1, 1), gpu(3, 1)]))

    applier.clear()

    assert backend.locked() == {}
    assert state.entries() == []
    assert applier.report() is None
    assert applier.managed_gpus() == {}
    assert applier.locked_gpus() == []
    assert applier.metrics.clock_changes(3) == 2  # the lock and the reset


def test_failed_reset_stays_recorded(
    applier: PlanApplier, backend: FakeBackend, state: ResetState
) -> None:
    applier.apply(node_plan([gpu(0, 0), gpu(1, 1)]))
    backend.fail[("reset_sm_clock", 1)] = GpuLostError("gone", 1)

    applier.clear()

    assert backend.locked() == {1: 1005}
    assert [e.uuid for e in state.entries()] == ["GPU-1"]
    assert applier.locked_gpus() == [1]
    assert applier.metrics.error_count("gpu_lost") == 1


def test_plan_for_another_node_is_refused(applier: PlanApplier, backend: FakeBackend) -> None:
    with pytest.raises(PlanError, match="for node 'node-2' but this agent runs on 'node-1'"):
        applier.apply(node_plan([gpu(0, 0)], node="node-2"))
    assert backend.mutating_calls() == []


# -- Instruction granularity ---------------------------------------------------------------------


def test_instruction_granularity_waits_for_the_training_process(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    report = applier.apply(node_plan([gpu(0, 0), gpu(1, 1)], granularity="Instruction"))
    assert [g.status for g in report.gpus] == [GpuStatus.WAITING, GpuStatus.WAITING]
    assert [g.applied_mhz for g in report.gpus] == [None, None]
    assert backend.mutating_calls() == []


def test_instruction_clock_follows_the_schedule(
    applier: PlanApplier, backend: FakeBackend, state: ResetState
) -> None:
    applier.apply(node_plan([gpu(0, 0), gpu(1, 1)], granularity="Instruction"))
    s = session()
    reply = hello(applier, s, uuids=["GPU-0"])
    assert reply["managed"] is True
    assert reply["gpus"] == [{"index": 0, "uuid": "GPU-0", "stage": 0, "dp_rank": 0}]

    for iteration in range(2):
        step_begin(applier, s)
        clocks = [begin(applier, s, name, mb) for name, mb, _ in STAGE0_SCHEDULE]
        assert clocks == [mhz for _, _, mhz in STAGE0_SCHEDULE], iteration
        assert backend.locked() == {0: 1305}
        assert [e.uuid for e in state.entries()] == ["GPU-0"]
    assert applier.metrics.error_count("schedule_mismatch") == 0
    assert applier.metrics.clock_changes(0) == 8
    g0 = applier.report().gpus[0]  # type: ignore[union-attr]
    assert (g0.status, g0.target_mhz, g0.applied_mhz) == (GpuStatus.APPLIED, 1305, 1305)


def test_the_next_computations_clock_is_locked_when_one_ends(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    """So it is in place when the next computation starts, however long a clock change takes."""
    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction"))
    s = session()
    hello(applier, s, uuids=["GPU-0"])
    step_begin(applier, s)
    assert backend.locked() == {0: 1200}  # the iteration's first computation
    for (name, mb, mhz), after in zip(STAGE0_SCHEDULE, [*STAGE0_SCHEDULE[1:], None], strict=True):
        changes = applier.metrics.clock_changes(0)
        assert begin(applier, s, name, mb) == mhz
        assert applier.metrics.clock_changes(0) == changes  # nothing left to change
        applier.instruction_end(s, {"op": "instruction_end", "name": name}, 0)
        assert backend.locked() == {0: mhz if after is None else after[2]}
    assert applier.metrics.clock_changes(0) == 4


def test_instruction_without_microbatch_follows_the_schedule_by_name(
    applier: PlanApplier,
) -> None:
    applier.apply(node_plan([gpu(1, 1)], granularity="Instruction"))
    s = session()
    hello(applier, s, uuids=["GPU-1"])
    step_begin(applier, s)
    clocks = [begin(applier, s, name, None) for name, _, _ in STAGE1_SCHEDULE]
    assert clocks == [1005, 1095, 1005, 1095]  # the last one clamped from 1097
    g = applier.report().gpus[0]  # type: ignore[union-attr]
    assert (g.status, g.target_mhz, g.applied_mhz) == (GpuStatus.CLAMPED, 1097, 1095)


def test_schedule_mismatch_resynchronises_and_is_counted(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction"))
    s = session()
    hello(applier, s, uuids=["GPU-0"])
    step_begin(applier, s)

    assert begin(applier, s, "forward", 0) == 1200
    assert begin(applier, s, "backward", 0) == 1410  # the plan expects forward 1 here
    assert applier.metrics.error_count("schedule_mismatch") == 1
    assert begin(applier, s, "backward", 1) == 1305  # back in step
    assert begin(applier, s, "forward", 1) == 1110  # earlier in the schedule: found anyway
    assert applier.metrics.error_count("schedule_mismatch") == 2
    assert begin(applier, s, "backward", 0) == 1410  # in step again after the resync
    assert applier.metrics.error_count("schedule_mismatch") == 2
    assert begin(applier, s, "forward", 5) == 1410  # not in the plan: clock kept
    assert applier.metrics.error_count("schedule_mismatch") == 3

    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) == 1200
    assert applier.metrics.error_count("schedule_mismatch") == 3
    assert backend.locked() == {0: 1200}


def test_session_is_matched_by_rank_without_gpu_uuids(applier: PlanApplier) -> None:
    applier.apply(node_plan([gpu(0, 0, rank=4), gpu(1, 1, rank=5)], granularity="Instruction"))
    s = session()
    reply = hello(applier, s, uuids=[], rank=5)
    assert [g["index"] for g in reply["gpus"]] == [1]
    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) == 1005


def test_session_that_calls_in_before_the_plan_is_matched_when_it_arrives(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    s = session()
    reply = hello(applier, s, uuids=["GPU-0"])
    assert reply["managed"] is False
    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) is None  # nothing to control yet

    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction"))
    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) == 1200
    assert backend.locked() == {0: 1200}


def test_stage_granularity_replies_with_the_locked_clock(applier: PlanApplier) -> None:
    applier.apply(node_plan([gpu(0, 0)]))
    s = session()
    hello(applier, s, uuids=["GPU-0"])
    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) == 1200
    assert begin(applier, s, "backward", 1) == 1200


def test_disconnect_resets_the_gpu_and_waits_again(
    applier: PlanApplier, backend: FakeBackend, state: ResetState
) -> None:
    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction"))
    s = session()
    hello(applier, s, uuids=["GPU-0"])
    step_begin(applier, s)
    begin(applier, s, "forward", 0)

    applier.disconnected(s)

    assert backend.locked() == {}
    assert state.entries() == []
    g = applier.report().gpus[0]  # type: ignore[union-attr]
    assert (g.status, g.applied_mhz) == (GpuStatus.WAITING, None)


def test_gpu_error_while_switching_fails_the_gpu_until_the_next_step(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction"))
    s = session()
    hello(applier, s, uuids=["GPU-0"])
    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) == 1200
    backend.fail[("lock_sm_clock", 0)] = GpuLostError("fell off the bus", 0)

    assert begin(applier, s, "forward", 1) is None
    g = applier.report().gpus[0]  # type: ignore[union-attr]
    assert g.status == GpuStatus.FAILED and g.message == "gpu_lost: fell off the bus"
    assert backend.locked() == {}  # not left at the old clock
    assert begin(applier, s, "backward", 0) is None  # no retry within the iteration
    assert applier.metrics.error_count("gpu_lost") == 1

    del backend.fail[("lock_sm_clock", 0)]
    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) == 1200


def test_new_revision_keeps_a_running_schedule_in_place(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction"))
    s = session()
    hello(applier, s, uuids=["GPU-0"])
    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) == 1200

    report = applier.apply(node_plan([gpu(0, 0)], granularity="Stage", revision=2))
    assert backend.locked() == {0: 1200}
    assert report.gpus[0].status == GpuStatus.APPLIED
    assert begin(applier, s, "forward", 1) == 1200  # Stage now: the clock stays

    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction", revision=3))
    assert backend.locked() == {0: 1200}  # still bound: the next computation switches
    step_begin(applier, s)
    assert begin(applier, s, "forward", 0) == 1200
    assert begin(applier, s, "forward", 1) == 1110


def test_an_instruction_plan_taking_over_mid_iteration_finds_its_place_uncounted(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    """A plan that kept no place in the schedule (Stage here; profiling alike) gives way to an
    Instruction plan between two computations: the next one tells where the process is."""
    applier.apply(node_plan([gpu(0, 0)], granularity="Stage"))
    s = session()
    hello(applier, s, uuids=["GPU-0"])
    step_begin(applier, s)
    begin(applier, s, "forward", 0)

    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction", revision=2))
    assert begin(applier, s, "forward", 1) == 1110  # the plan's clock for forward 1
    assert applier.metrics.error_count("schedule_mismatch") == 0
    # From the next iteration on the place is known again: a computation out of order counts.
    step_begin(applier, s)
    begin(applier, s, "forward", 1)
    assert applier.metrics.error_count("schedule_mismatch") == 1


def test_iteration_time_is_recorded_per_rank(applier: PlanApplier) -> None:
    applier.apply(node_plan([gpu(2, 1, rank=3, dp_rank=1, pod="gpt3-worker-1")]))
    s = session()
    hello(applier, s, uuids=["GPU-2"], rank=3)
    for i in range(3):
        step_begin(applier, s, t_ns=10 * i * 10**9)
        applier.step_end(s, {"op": "step_end", "step": i}, 10 * i * 10**9 + (2 + i) * 10**9)

    registry = applier.metrics.registry
    labels = {
        "node": NODE,
        "gpu": "2",
        "uuid": "GPU-2",
        "job_namespace": "ml",
        "job_name": "gpt3",
        "pod_name": "gpt3-worker-1",
        "dp_rank": "1",
        "pp_rank": "1",
        "rank": "3",
    }
    assert registry.get_sample_value("perseus_iteration_seconds_count", labels) == 3
    assert registry.get_sample_value("perseus_iteration_seconds_sum", labels) == 9.0
    rank = applier.report().ranks[0]  # type: ignore[union-attr]
    assert (rank.rank, rank.dp_rank, rank.pp_rank, rank.iterations) == (3, 1, 1, 3)
    assert (rank.last_iteration_s, rank.mean_iteration_s) == (4.0, 3.0)
    assert rank.revision == 1


def test_iteration_mean_restarts_with_each_plan_revision(applier: PlanApplier) -> None:
    """The operator compares means under one plan: a re-targeted plan (slower on purpose) must
    not blend with the old one, and the iteration the change cuts in two counts for neither."""
    applier.apply(node_plan([gpu(0, 0, rank=0)]))
    s = session()
    hello(applier, s, uuids=["GPU-0"], rank=0)

    def iteration(i: int, seconds: int, *, new_revision: int | None = None) -> None:
        step_begin(applier, s, t_ns=100 * i * 10**9)
        if new_revision is not None:
            applier.apply(node_plan([gpu(0, 0, rank=0)], revision=new_revision))
        applier.step_end(s, {"op": "step_end", "step": i}, (100 * i + seconds) * 10**9)

    for i in range(3):
        iteration(i, 2)
    assert applier.report().ranks[0].revision == 1  # type: ignore[union-attr]
    iteration(3, 7, new_revision=2)  # the plan changed during this one
    assert applier.report().ranks == []  # type: ignore[union-attr]  # nothing measured under 2 yet
    iteration(4, 5)
    iteration(5, 3)
    rank = applier.report().ranks[0]  # type: ignore[union-attr]
    assert (rank.iterations, rank.revision, rank.mean_iteration_s) == (6, 2, 4.0)


# -- through the real local server ---------------------------------------------------------------


def test_training_process_switches_clocks_over_the_socket(
    applier: PlanApplier, backend: FakeBackend, socket_dir: Path
) -> None:
    applier.apply(node_plan([gpu(0, 0), gpu(1, 1)], granularity="Instruction"))
    path = socket_dir / "agent.sock"
    with LocalServer(path, applier), socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        stream = sock.makefile("rwb")

        def call(msg: dict[str, Any]) -> dict[str, Any]:
            stream.write(json.dumps(msg).encode() + b"\n")
            stream.flush()
            reply: dict[str, Any] = json.loads(stream.readline())
            assert reply["ok"] is True, reply
            return reply

        call(
            {
                "op": "hello",
                "version": 1,
                "rank": 1,
                "local_rank": 1,
                "gpu_uuids": ["GPU-1"],
                "pid": 1,
                "job": "gpt3",
                "namespace": "ml",
                "pod": None,
            }
        )
        call({"op": "step_begin", "step": 0})
        clocks = []
        for name, mb, _ in STAGE1_SCHEDULE:
            clocks.append(call({"op": "instruction_begin", "name": name, "microbatch": mb}))
            call({"op": "instruction_end", "name": name})
        call({"op": "step_end", "step": 0})
        assert [c["sm_clock_mhz"] for c in clocks] == [1005, 1095, 1005, 1095]
        assert backend.locked() == {1: 1095}
        stream.close()
    assert backend.locked() == {}  # disconnected: back to default clocks


# -- profiling -----------------------------------------------------------------------------------


def profile_rows(report: NodeReport, index: int) -> list[tuple[Any, ...]]:
    (p,) = [p for p in report.profiling if p.index == index]
    return [
        (r.stage, r.instruction, r.frequency_mhz, r.time_s, r.energy_j, r.samples) for r in p.rows
    ]


def expected_profile(stage: int, clocks: list[int], samples: int) -> list[tuple[Any, ...]]:
    return [
        (
            stage,
            name,
            clock,
            pytest.approx(TABLE[(stage, name)][clock][0], rel=1e-9),
            pytest.approx(TABLE[(stage, name)][clock][1], rel=1e-9),
            samples,
        )
        for clock in clocks
        for name in ("forward", "backward")
    ]


def test_profiling_runs_each_clock_and_reports_the_profile(tmp_path: Path) -> None:
    run = Profiling(tmp_path)
    a = run.applier
    report = a.apply(run.plan([(0, 0)], [1410, 1200, 1005], iterations=2, warmup=1))

    assert [(g.index, g.status, g.applied_mhz) for g in report.gpus] == [
        (0, GpuStatus.WAITING, None)
    ]
    (p,) = report.profiling
    assert (p.uuid, p.stage, p.frequencies_mhz, p.applied_mhz) == (
        run.uuid(0),
        0,
        [1410, 1200, 1005],
        [None, None, None],
    )
    assert (p.frequency_index, p.done, p.rows, p.blocking_power_w) == (0, False, [], None)
    assert run.locks == []

    s = run.connect(0)
    replies, progress = [], []
    for _ in range(3 * (1 + 2)):
        replies.append(run.iteration(s, 0, stage=0))
        report = a.report()  # type: ignore[assignment]
        progress.append((report.profiling[0].frequency_index, report.profiling[0].done))
        if not report.profiling[0].done:
            assert [e.uuid for e in run.state.entries()] == [run.uuid(0)]

    assert replies == [[c] * 4 for c in (1410, 1200, 1005) for _ in range(3)]
    assert run.locks == [(0, 1410, True), (0, 1200, True), (0, 1005, True)]
    assert progress == [(0, False)] * 2 + [(1, False)] * 3 + [(2, False)] * 3 + [(3, True)]
    # Done: the clock is back to default and forgotten.
    assert run.gpus.locked_sm_clock_mhz(0) is None
    assert run.state.entries() == []
    assert a.locked_gpus() == []
    g = report.gpus[0]
    assert (g.status, g.target_mhz, g.applied_mhz) == (GpuStatus.APPLIED, None, None)
    assert "every clock measured" in g.message
    (p,) = report.profiling
    assert p.applied_mhz == [1410, 1200, 1005]
    assert (p.measured_iterations, p.dropped_iterations) == (6, 0)
    assert profile_rows(report, 0) == expected_profile(0, [1410, 1200, 1005], samples=4)
    assert p.blocking_power_w == pytest.approx(BLOCKING_W, rel=1e-9)
    assert run.samplers[0].stopped
    parsed = parse_profile(profile_csv(p.rows), "report")
    assert list(parsed.get(0, "backward").frequencies_mhz) == [1410, 1200, 1005]
    assert NodeReport.model_validate_json(report.model_dump_json()) == report

    # Nothing more happens: the process trains on at default clocks.
    assert run.iteration(s, 0, stage=0) == [None] * 4
    assert run.gpus.locked_sm_clock_mhz(0) is None


def test_profiling_samples_the_counter_at_each_computations_edges(tmp_path: Path) -> None:
    # The background sampler's 5 ms alone: the counter interpolated across each edge between
    # a computation and idle time put part of the computation's energy in the idle time.
    run = Profiling(tmp_path, period_ns=5_000_000, at_power_changes=False)
    a = run.applier
    a.apply(run.plan([(0, 0)], [1410, 1005], iterations=2, warmup=1))
    s = run.connect(0)
    for _ in range(2 * (1 + 2)):
        run.iteration(s, 0, stage=0)
    run.advance(10_000_000)
    report = a.report()
    assert report is not None
    (p,) = report.profiling
    assert p.done
    assert profile_rows(report, 0) == expected_profile(0, [1410, 1005], samples=4)
    assert p.blocking_power_w == pytest.approx(BLOCKING_W, rel=1e-9)


def test_profiling_clamps_unsupported_clocks_and_reports_them(tmp_path: Path) -> None:
    run = Profiling(tmp_path)
    a = run.applier
    a.apply(run.plan([(0, 0)], [1410, 1100], iterations=1, warmup=0))
    s = run.connect(0)

    assert run.iteration(s, 0, stage=0) == [1410] * 4
    assert run.iteration(s, 0, stage=0) == [1005] * 4  # 1100 is not supported: 1005 is nearest
    report = a.report()
    assert report is not None
    assert run.locks == [(0, 1410, True), (0, 1005, True)]
    (p,) = report.profiling
    assert p.done and p.applied_mhz == [1410, 1005]
    assert profile_rows(report, 0) == expected_profile(0, [1410, 1005], samples=2)


def test_profiling_skips_clocks_that_clamp_to_one_already_scheduled(tmp_path: Path) -> None:
    """A sweep wider than the GPU's range measures the GPU's top clock once, not once per
    scheduled clock above it."""
    run = Profiling(tmp_path)
    a = run.applier
    report = a.apply(run.plan([(0, 0)], [2100, 1800, 1410, 1200], iterations=1, warmup=0))
    (p,) = report.profiling
    assert p.frequencies_mhz == [2100, 1200]
    s = run.connect(0)
    assert run.iteration(s, 0, stage=0) == [1410] * 4
    assert run.iteration(s, 0, stage=0) == [1200] * 4
    report = a.report()
    assert report is not None
    (p,) = report.profiling
    assert p.done and p.applied_mhz == [1410, 1200]
    assert profile_rows(report, 0) == expected_profile(0, [1410, 1200], samples=2)


def test_clamped_profiling_clock_is_reported_while_measured(tmp_path: Path) -> None:
    run = Profiling(tmp_path)
    a = run.applier
    a.apply(run.plan([(0, 0)], [1100, 1005], iterations=1, warmup=0))
    s = run.connect(0)
    a.step_begin(s, {"op": "step_begin", "step": 0}, run.sim.ns)
    g = a.report().gpus[0]  # type: ignore[union-attr]
    assert (g.status, g.target_mhz, g.applied_mhz) == (GpuStatus.CLAMPED, 1100, 1005)
    assert "1100 MHz is not supported by GPU 0; clamped to 1005 MHz" in g.message


def test_gpu_error_during_profiling_fails_that_gpu_only(tmp_path: Path) -> None:
    run = Profiling(tmp_path)
    a = run.applier
    a.apply(run.plan([(0, 0), (1, 1)], [1410, 1200], iterations=1, warmup=1))
    s0, s1 = run.connect(0), run.connect(1)
    for _ in range(2):  # 1410 on both
        run.iteration(s0, 0, stage=0)
        run.iteration(s1, 1, stage=1)
    run.gpus.inject_fault(1, GpuLostError("GPU 1 fell off the bus", 1))
    while not a.report().profiling[0].done:  # type: ignore[union-attr]
        run.iteration(s0, 0, stage=0)
        assert run.iteration(s1, 1, stage=1) == [None] * 4  # no clock under control

    report = a.report()
    assert report is not None
    g0, g1 = report.gpus
    assert g0.status == GpuStatus.APPLIED
    assert g1.status == GpuStatus.FAILED
    assert g1.message == "gpu_lost: cannot read the energy counter: GPU 1 fell off the bus"
    p0, p1 = report.profiling
    assert p0.done and profile_rows(report, 0) == expected_profile(0, [1410, 1200], samples=2)
    assert not p1.done and p1.rows == [] and p1.blocking_power_w is None
    assert run.samplers[1].stopped
    assert a.metrics.error_count("gpu_lost") >= 1
    # GPU 1's clock could not be reset (the fault): it stays recorded for the next start.
    assert [e.uuid for e in run.state.entries()] == [run.uuid(1)]


def test_lock_failure_during_profiling_fails_the_gpu(
    backend: FakeBackend, state: ResetState
) -> None:
    samplers: list[RecordingSampler] = []

    def factory(gpu: GpuInfo, read: Callable[[], float]) -> EnergySampler:
        samplers.append(RecordingSampler(read, interval_s=None))
        return samplers[-1]

    applier = PlanApplier(backend, state, NODE, sampler_factory=factory)
    plan = node_plan([gpu(0, 0), gpu(1, 1)]).model_copy(
        update={
            "profiling": ProfilingSpec(
                frequencies_mhz=[1410], iterations_per_frequency=1, warmup_iterations=0
            )
        }
    )
    applier.apply(plan)
    backend.fail[("lock_sm_clock", 1)] = GpuNoPermissionError("insufficient permissions", 1)
    s0, s1 = session(1), session(2)
    hello(applier, s0, uuids=["GPU-0"])
    hello(applier, s1, uuids=["GPU-1"])
    step_begin(applier, s0)
    step_begin(applier, s1)
    assert begin(applier, s0, "forward", 0) == 1410
    assert begin(applier, s1, "forward", 0) is None
    report = applier.report()
    assert report is not None
    assert [g.status for g in report.gpus] == [GpuStatus.APPLIED, GpuStatus.FAILED]
    assert report.gpus[1].message == "no_permission: insufficient permissions"
    assert backend.locked() == {0: 1410}
    assert [sp.stopped for sp in samplers] == [False, True]


def test_reapplying_keeps_profiling_progress_and_a_plan_without_it_ends_it(
    tmp_path: Path,
) -> None:
    run = Profiling(tmp_path)
    a = run.applier
    a.apply(run.plan([(0, 0)], [1410, 1200], iterations=1, warmup=1))
    s = run.connect(0)
    run.iteration(s, 0, stage=0)
    run.iteration(s, 0, stage=0)
    sampler = run.samplers[0]

    report = a.apply(run.plan([(0, 0)], [1410, 1200], iterations=1, warmup=1, revision=2))
    assert report.profiling[0].frequency_index == 1
    assert run.samplers[0] is sampler and not sampler.stopped
    assert run.gpus.locked_sm_clock_mhz(0) == 1410

    # Another schedule starts over, from a reset clock.
    report = a.apply(run.plan([(0, 0)], [1200, 1005], iterations=1, warmup=1, revision=3))
    assert sampler.stopped and run.samplers[0] is not sampler
    assert report.profiling[0].frequency_index == 0
    assert run.gpus.locked_sm_clock_mhz(0) is None
    assert report.gpus[0].status == GpuStatus.WAITING
    assert run.iteration(s, 0, stage=0) == [1200] * 4

    # A plan without profiling applies the plan again.
    plan = NodePlan.model_validate(
        {**run.plan([(0, 0)], [1410]).model_dump(), "profiling": None, "granularity": "Stage"}
    )
    report = a.apply(plan)
    assert run.samplers[0].stopped
    assert report.profiling == []
    assert run.gpus.locked_sm_clock_mhz(0) == 1200  # stage 0's clock in pipeline_fields()
    assert report.gpus[0].status == GpuStatus.APPLIED


def test_disconnect_during_profiling_resets_and_warms_up_again(tmp_path: Path) -> None:
    run = Profiling(tmp_path)
    a = run.applier
    a.apply(run.plan([(0, 0)], [1410, 1200], iterations=2, warmup=1))
    s = run.connect(0)
    run.iteration(s, 0, stage=0)  # warm-up
    run.iteration(s, 0, stage=0)  # measured 1 of 2
    a.disconnected(s)

    assert run.gpus.locked_sm_clock_mhz(0) is None
    assert run.state.entries() == []
    report = a.report()
    assert report is not None
    assert report.gpus[0].status == GpuStatus.WAITING
    assert report.profiling[0].frequency_index == 0

    s = run.connect(0, connection_id=9)
    run.iteration(s, 0, stage=0)  # warm-up again
    assert a.report().profiling[0].frequency_index == 0  # type: ignore[union-attr]
    run.iteration(s, 0, stage=0)  # measured 2 of 2
    assert a.report().profiling[0].frequency_index == 1  # type: ignore[union-attr]
    assert run.gpus.locked_sm_clock_mhz(0) == 1410


def test_default_samplers_run_in_threads_until_the_plan_goes(
    backend: FakeBackend, state: ResetState
) -> None:
    applier = PlanApplier(backend, state, NODE)
    plan = node_plan([gpu(0, 0), gpu(2, 1)]).model_copy(
        update={
            "profiling": ProfilingSpec(
                frequencies_mhz=[1410, 1005], iterations_per_frequency=1, warmup_iterations=0
            )
        }
    )
    applier.apply(plan)
    names = {t.name for t in threading.enumerate()}
    assert {"perseus-energy-gpu0", "perseus-energy-gpu2"} <= names
    applier.clear()
    names = {t.name for t in threading.enumerate()}
    assert not {"perseus-energy-gpu0", "perseus-energy-gpu2"} & names


def test_the_plan_after_profiling_takes_over_mid_iteration_uncounted(tmp_path: Path) -> None:
    run = Profiling(tmp_path)
    a = run.applier
    a.apply(run.plan([(0, 0)], [1410, 1200], iterations=1, warmup=1))
    s = run.connect(0)
    run.iteration(s, 0, stage=0)
    step_begin(a, s)
    begin(a, s, "forward", 0)

    # Profiling done, the Instruction plan lands between two computations of an iteration.
    plan = NodePlan.model_validate(
        {**run.plan([(0, 0)], [1410]).model_dump(), "profiling": None, "revision": 2}
    )
    assert plan.granularity == "Instruction"
    a.apply(plan)
    begin(a, s, "forward", 1)
    assert a.metrics.error_count("schedule_mismatch") == 0
