"""What a training process may not do to the applier: grow the metrics with its claims, flood
the log, or drive a GPU another process has taken over."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.log_limit import DEFAULT_BURST, RateLimitedLog
from perseus_agent.serving.client_dispatch import ClientSession
from support.applier_calls import NODE, begin, gpu, hello, node_plan, session, step_begin
from support.fake_gpu import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(num_gpus=4)


@pytest.fixture
def applier(backend: FakeBackend, tmp_path: Path) -> PlanApplier:
    return PlanApplier(backend, ResetState(tmp_path), NODE)


def hello_claiming(
    applier: PlanApplier, s: ClientSession, *, rank: int, pod: str, uuids: list[str]
) -> dict[str, Any]:
    return applier.hello(
        s,
        {
            "op": "hello",
            "version": 1,
            "rank": rank,
            "local_rank": None,
            "gpu_uuids": uuids,
            "pid": 42,
            "job": f"claimed-job-{rank}",
            "namespace": "claimed-ns",
            "pod": pod,
        },
        0,
    )


def iteration(applier: PlanApplier, s: ClientSession, start_ns: int, seconds: float) -> None:
    applier.step_begin(s, {"op": "step_begin", "step": 0}, start_ns)
    applier.step_end(s, {"op": "step_end", "step": 0}, start_ns + int(seconds * 1e9))


def iteration_series(applier: PlanApplier) -> list[dict[str, str]]:
    return [
        s.labels
        for m in applier.metrics.iteration_seconds.collect()
        for s in m.samples
        if s.name == "perseus_iteration_seconds_count"
    ]


# -- 4. metric cardinality -------------------------------------------------------------------------


def test_hellos_with_distinct_claims_do_not_grow_the_metrics(applier: PlanApplier) -> None:
    applier.apply(node_plan([gpu(0, 0, rank=0, pod="gpt3-worker-0")], granularity="Instruction"))
    owner = session(1)
    hello(applier, owner, uuids=["GPU-0"], rank=0)
    iteration(applier, owner, 0, 2.0)
    lines_before = generate_latest(applier.metrics.registry).count(b"\n")

    for i in range(2, 2002):  # unmanaged claims: unknown GPUs, ranks and pods of their own
        s = session(i)
        hello_claiming(applier, s, rank=1000 + i, pod=f"pod-{i}", uuids=[f"GPU-fake-{i}"])
        iteration(applier, s, 0, 1.0)
        applier.disconnected(s)
    # Claims of a GPU the plan gives another rank, by UUID: measured under the plan's labels.
    for i in range(2002, 2502):
        s = session(i)
        hello_claiming(applier, s, rank=1000 + i, pod=f"pod-{i}", uuids=["GPU-0"])
        iteration(applier, s, 0, 1.0)
        applier.disconnected(s)

    series = iteration_series(applier)
    assert series == [
        {
            "node": NODE,
            "gpu": "0",
            "uuid": "GPU-0",
            "job_namespace": "ml",
            "job_name": "gpt3",
            "pod_name": "gpt3-worker-0",
            "dp_rank": "0",
            "pp_rank": "0",
            "rank": "0",
        }
    ]
    # Same series, other values (the counts of the one series grew).
    assert generate_latest(applier.metrics.registry).count(b"\n") == lines_before
    report = applier.report()
    assert report is not None
    assert [r.rank for r in report.ranks] == [0]  # the plan's rank, not the claims


def test_iteration_series_are_removed_when_their_gpu_or_plan_ends(applier: PlanApplier) -> None:
    applier.apply(node_plan([gpu(0, 0, rank=0), gpu(1, 1, rank=1)], granularity="Instruction"))
    sessions = [session(1), session(2)]
    for i, s in enumerate(sessions):
        hello(applier, s, uuids=[f"GPU-{i}"], rank=i)
        iteration(applier, s, 0, 1.0)
    assert sorted(s["gpu"] for s in iteration_series(applier)) == ["0", "1"]

    applier.apply(node_plan([gpu(0, 0, rank=0)], granularity="Instruction", revision=2))
    assert [s["gpu"] for s in iteration_series(applier)] == ["0"]  # GPU 1 left the plan

    # A new revision that gives GPU 0 another pod: the old series goes, the new one comes.
    applier.apply(node_plan([gpu(0, 0, rank=0, pod="p2")], granularity="Instruction", revision=3))
    assert iteration_series(applier) == []
    iteration(applier, sessions[0], 0, 1.0)
    assert [s["pod_name"] for s in iteration_series(applier)] == ["p2"]

    applier.clear()
    assert iteration_series(applier) == []
    assert b"perseus_iteration_seconds_count{" not in generate_latest(applier.metrics.registry)


def test_rank_times_keep_only_the_ranks_of_the_plan(applier: PlanApplier) -> None:
    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction"))  # no rank in the plan
    for i in range(1, 201):  # processes in turn on GPU 0, each claiming another rank
        s = session(i)
        hello(applier, s, uuids=["GPU-0"], rank=100 + i)
        iteration(applier, s, 0, 1.0)
        applier.disconnected(s)
    report = applier.report()
    assert report is not None
    assert [r.rank for r in report.ranks] == [300]  # the last owner's only


# -- 5. warnings a client can trigger at will ----------------------------------------------------


def test_out_of_order_instructions_log_a_bounded_number_of_warnings(
    applier: PlanApplier, caplog: pytest.LogCaptureFixture
) -> None:
    applier.apply(node_plan([gpu(0, 0)], granularity="Instruction"))
    s = session()
    hello(applier, s, uuids=["GPU-0"])
    step_begin(applier, s)
    with caplog.at_level(logging.WARNING, logger="perseus_agent.control.instruction_clocks"):
        for _ in range(25_000):
            begin(applier, s, "backward", 0)  # the plan always expects something else here
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    # The first ones in full; then at most one summary per minute (the run takes seconds).
    assert DEFAULT_BURST <= len(warnings) <= DEFAULT_BURST + 2
    assert "where the plan expects" in warnings[0].getMessage()
    assert "at most one summary per 60 s" in warnings[DEFAULT_BURST - 1].getMessage()
    assert applier.metrics.error_count("schedule_mismatch") == 25_000


def test_rate_limited_log_summarises_what_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(
        logging.getLogger("test.limit"), burst=3, interval_s=10.0, clock=lambda: now[0]
    )
    with caplog.at_level(logging.WARNING, logger="test.limit"):
        written = [limited.warning("a", "event %d", i) for i in range(5)]
        assert written == [True, True, True, False, False]
        assert limited.warning("b", "other kind") is True  # each key has its own budget
        assert limited.suppressed("a") == 2
        now[0] = 10.0
        assert limited.warning("a", "event %d", 5) is True
    assert [r.getMessage() for r in caplog.records] == [
        "event 0",
        "event 1",
        "event 2 (further messages like this one: at most one summary per 10 s)",
        "other kind",
        "2 more message(s) like the next one left out of the log in the last 10 s",
        "event 5",
    ]
    assert limited.suppressed("a") == 0


# -- 6. one owner per GPU --------------------------------------------------------------------------


def test_a_displaced_process_no_longer_moves_the_gpu(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    applier.apply(node_plan([gpu(0, 0, rank=0)], granularity="Instruction"))
    old, new = session(1), session(2)
    hello(applier, old, uuids=["GPU-0"], rank=0)
    step_begin(applier, old)
    assert begin(applier, old, "forward", 0) == 1200

    hello(applier, new, uuids=["GPU-0"], rank=0)  # a restarted process calls in
    step_begin(applier, new)
    assert begin(applier, new, "forward", 0) == 1200

    # The old process's messages change neither the clock nor the schedule position.
    step_begin(applier, old)
    assert begin(applier, old, "backward", 1) is None
    applier.instruction_end(old, {"op": "instruction_end", "name": "backward"}, 0)
    iteration(applier, old, 0, 5.0)
    assert backend.locked() == {0: 1200}
    assert applier.metrics.error_count("schedule_mismatch") == 0

    assert begin(applier, new, "forward", 1) == 1110  # the owner's next one, in order
    assert applier.metrics.error_count("schedule_mismatch") == 0

    # A plan change keeps the owner; the displaced process's disconnect resets nothing.
    applier.apply(node_plan([gpu(0, 0, rank=0)], granularity="Instruction", revision=2))
    assert begin(applier, old, "backward", 0) is None
    assert begin(applier, new, "backward", 0) == 1410
    applier.disconnected(old)
    assert backend.locked() == {0: 1410}
    report = applier.report()
    assert report is not None and [r.iterations for r in report.ranks] == []
    applier.disconnected(new)
    assert backend.locked() == {}


def test_a_gpu_its_owner_no_longer_claims_goes_to_the_process_that_does(
    applier: PlanApplier, backend: FakeBackend
) -> None:
    """A plan change that gives GPU 0 to another rank: the rank's process gets it even though
    it called in after the GPU's previous owner."""
    applier.apply(node_plan([gpu(0, 0, by_uuid=False, rank=0)], granularity="Instruction"))
    first, second = session(1), session(2)
    hello(applier, first, uuids=[], rank=0)
    hello(applier, second, uuids=[], rank=1)
    step_begin(applier, first)
    assert begin(applier, first, "forward", 0) == 1200

    applier.apply(
        node_plan([gpu(0, 0, by_uuid=False, rank=1)], granularity="Instruction", revision=2)
    )
    step_begin(applier, second)
    assert begin(applier, second, "forward", 0) == 1200
    assert begin(applier, first, "forward", 1) is None  # not its GPU any more
    assert begin(applier, second, "forward", 1) == 1110
