"""Quiet steps (:mod:`perseus_operator.jobs.quiet_steps`): a reconcile whose inputs have not
changed reuses what the last step decided, and decides exactly what a step deciding
everything again would have: the same scenario run with reuse and without gives the same
statuses, events, straggler states and node plan writes, step by step, while the reusing run
skips most of the work."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from perseus_api.node_report import RankReport
from perseus_operator.cluster.cluster_index import (
    IndexedJobIO,
    PlanWrites,
    node_plan_entries,
    pod_entries,
)
from perseus_operator.jobs import job_decisions, lifecycle, running_decisions
from perseus_operator.jobs.job_observation import JobIO
from perseus_operator.jobs.lifecycle import JobMemo, Outcome, reconcile
from perseus_operator.jobs.planner_pool import InlinePlanner
from perseus_operator.jobs.running_decisions import expected_iteration_s
from support.fake_job_io import FakeCluster, profiling_reports
from support.lifecycle_job import JOB, NODES, NS, job_body, pod
from support.operator_harness import agent_status

STEP_S = 0.5  # the operator's timer (0.5 s), agents report every 1 s: 10x production
REPORT_S = 1.0
HEARTBEAT_S = 3.0
T0 = 1_800_000_000.0


class Clock:
    """The scenario's time: the reconcile's ``now_s`` and every timestamp the decisions
    write (transitions, a straggler's ``since``), so that two runs compare byte for byte."""

    def __init__(self) -> None:
        self.now_s = T0

    def rfc3339(self) -> str:
        return datetime.fromtimestamp(self.now_s, tz=UTC).isoformat(timespec="milliseconds")


class WatchedCluster(FakeCluster):
    """The in-memory cluster with kopf's indexes over it, filed again at :meth:`deliver` (as
    watch events would: an unchanged object is filed again as equal bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.pod_index: dict[Any, list[Any]] = {}
        self.plan_index: dict[Any, list[Any]] = {}

    def deliver(self) -> None:
        for index, entries, objects in (
            (self.pod_index, pod_entries, self.pods),
            (self.plan_index, node_plan_entries, self.node_plans.values()),
        ):
            index.clear()
            for obj in objects:
                for key, value in entries(obj).items():
                    index.setdefault(key, []).append(value)


class Unindexed:
    """The same cluster and indexes, without snapshots: every step decides everything."""

    def __init__(self, io: IndexedJobIO) -> None:
        self._io = io

    def __getattr__(self, name: str) -> Any:
        return getattr(self._io, name)


class Run:
    """One operator over its own in-memory cluster, stepping on :class:`Clock` time."""

    def __init__(self, clock: Clock, *, reuse: bool) -> None:
        self.clock = clock
        self.reuse = reuse
        self.cluster = WatchedCluster()
        self.cluster.pods = [pod(0), pod(1)]
        self.cluster.deliver()
        body = job_body(mode="StragglerAware")
        body["spec"]["stragglers"]["staleAfterSeconds"] = 8.0
        self.body = body
        self.cluster.jobs[(NS, JOB)] = body
        self.memo = JobMemo()
        self.writes = PlanWrites()
        self.written: dict[str, tuple[float, dict[str, Any]]] = {}
        self.plan_writes: list[str] = []
        put = self.cluster.put_node_plan

        async def recorded_put(body: Any, owner: Any) -> None:
            self.plan_writes.append(json.dumps(body["spec"], sort_keys=True))
            await put(body, owner)

        self.cluster.put_node_plan = recorded_put  # type: ignore[method-assign]

    def step(self) -> Outcome:
        c = self.cluster
        indexed = IndexedJobIO(
            c,
            job=(NS, JOB),
            pods=c.pod_index,
            node_plans=c.plan_index,
            workloads={},
            writes=self.writes,
        )
        io: JobIO = indexed if self.reuse else Unindexed(indexed)  # type: ignore[assignment]
        outcome = asyncio.run(
            reconcile(self.body, io, InlinePlanner(), self.memo, now_s=self.clock.now_s)
        )
        self.body["status"] = outcome.status.model_dump(mode="json", by_alias=True)
        if outcome.detector_state is not None:
            annotations = self.body["metadata"].setdefault("annotations", {})
            annotations[job_decisions.STRAGGLER_STATE_ANNOTATION] = outcome.detector_state
        return outcome

    def report(self, slow: dict[int, float], silent: set[str]) -> None:
        """Each node's agent, as it writes: a changed mean at once, else a heartbeat."""
        c = self.cluster
        expected = {n: expected_iteration_s({"spec": c.spec(n)}) for n in NODES}
        fastest_s = min(s for e in expected.values() for s in e.values())
        t_s = 0.2
        for node in NODES:
            if node in silent:
                continue
            spec = c.spec(node)
            ranks = [
                RankReport(
                    rank=a["rank"],
                    dp_rank=a["dpRank"],
                    pp_rank=a["stage"],
                    iterations=int(self.clock.now_s - T0) * 10 + 10,
                    last_iteration_s=t_s
                    * slow.get(a["dpRank"], 1.0)
                    * expected[node][a["rank"]]
                    / fastest_s,
                    mean_iteration_s=t_s
                    * slow.get(a["dpRank"], 1.0)
                    * expected[node][a["rank"]]
                    / fastest_s,
                    revision=spec["revision"],
                )
                for a in spec["assignments"]
            ]
            means = [r.mean_iteration_s for r in ranks]
            last = self.written.get(node)
            if (
                last is not None
                and last[1] == {"revision": spec["revision"], "means": means}
                and self.clock.now_s - last[0] < HEARTBEAT_S
            ):
                continue  # the dead-band holds it back
            status = agent_status(spec["revision"], ranks=ranks, reported_at=self.clock.rfc3339())
            status["reportIntervalSeconds"] = REPORT_S
            status["heartbeatSeconds"] = HEARTBEAT_S
            c.report(node, **status)
            self.written[node] = (self.clock.now_s, {"revision": spec["revision"], "means": means})
        c.deliver()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    c = Clock()
    for module in (job_decisions, running_decisions):
        monkeypatch.setattr(module, "now_rfc3339", c.rfc3339)
    yield c


def scenario(slow_from: int, slow_to: int, silent_from: int, silent_to: int, ticks: int) -> Any:
    """Per tick: the slow replicas (factor) and the silent nodes."""
    for tick in range(ticks):
        slow = {1: 1.25} if slow_from <= tick < slow_to else {}
        silent = {"node-0"} if silent_from <= tick < silent_to else set()
        yield tick, slow, silent


def running(run: Run) -> None:
    """Pending -> Profiling -> Running, plans applied (the same in every run)."""
    run.step()
    run.cluster.deliver()
    for node in NODES:
        run.cluster.report(node, profiling=profiling_reports(run.cluster.spec(node)))
    run.cluster.deliver()
    run.step()
    run.cluster.deliver()
    assert run.body["status"]["phase"] == "Running"


def normalized(outcome: Outcome) -> tuple[Any, ...]:
    return (
        outcome.status.model_dump(mode="json", by_alias=True),
        [(e.type, e.reason, e.message) for e in outcome.events],
        outcome.plan,
        outcome.iterations,
        outcome.new_stragglers,
        outcome.detector_state,
    )


def test_a_reused_step_decides_what_deciding_everything_again_would(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"workload": 0, "samples": 0}
    decide_workload, report_samples = lifecycle.decide_workload, lifecycle.report_samples

    def counted_workload(*args: Any, **kwargs: Any) -> Any:
        calls["workload"] += 1
        return decide_workload(*args, **kwargs)

    def counted_samples(*args: Any, **kwargs: Any) -> Any:
        calls["samples"] += 1
        return report_samples(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "decide_workload", counted_workload)
    monkeypatch.setattr(lifecycle, "report_samples", counted_samples)

    runs = {reuse: Run(clock, reuse=reuse) for reuse in (True, False)}
    for run in runs.values():
        clock.now_s = T0
        running(run)
    counted: dict[bool, dict[str, int]] = {}
    outcomes: dict[bool, list[tuple[Any, ...]]] = {True: [], False: []}
    for reuse, run in runs.items():
        clock.now_s = T0 + 10.0
        calls.update(workload=0, samples=0)
        # A straggler for 20 ticks; later node-0 falls silent long enough to go stale, and
        # comes back.
        for tick, slow, silent in scenario(10, 30, 40, 70, 90):
            if tick % round(REPORT_S / STEP_S) == 0:
                run.report(slow, silent)
            outcomes[reuse].append(normalized(run.step()))
            run.cluster.deliver()
            clock.now_s += STEP_S
        counted[reuse] = dict(calls)

    assert outcomes[True] == outcomes[False]
    assert runs[True].plan_writes == runs[False].plan_writes
    # The scenario did what it is for: a straggler re-targeted and recovered, stale
    # telemetry flagged and cleared, on both runs alike.
    reasons = [e[1] for o in outcomes[True] for e in o[1]]
    assert "StragglerDetected" in reasons and "StragglerRecovered" in reasons
    degraded = [
        c["reason"] for o in outcomes[True] for c in o[0]["conditions"] if c["type"] == "Degraded"
    ]
    assert "StaleTelemetry" in degraded and "TelemetryRecovered" in degraded
    assert len(runs[True].plan_writes) > len(runs[False].plan_writes) / 2 > 0
    # Most steps reused the stages before the Running stage; many the whole step.
    assert counted[False] == {"workload": 90, "samples": 90}
    assert counted[True]["workload"] < 30
    assert counted[True]["samples"] < 70


def settle(run: Run) -> None:
    """Step until a step reuses the last one whole (the first quiet steps still save the
    straggler detector's state, which changes the job)."""
    for _ in range(5):
        last = run.memo.last_step
        run.step()
        if last is not None and last.whole is not None and run.memo.last_step is last:
            return
    raise AssertionError("no step was reused")


def test_a_changed_pod_or_job_is_decided_again(clock: Clock) -> None:
    run = Run(clock, reuse=True)
    running(run)
    clock.now_s += 10.0
    run.report({}, set())
    settle(run)

    run.cluster.pods[1]["metadata"].setdefault("labels", {})["extra"] = "x"
    run.cluster.deliver()
    last = run.memo.last_step
    run.step()
    assert run.memo.last_step is not last  # the pods changed: decided again
    settle(run)

    last = run.memo.last_step
    run.body["metadata"].setdefault("annotations", {})["note"] = "changed"
    run.step()
    assert run.memo.last_step is not last  # the job changed
    settle(run)

    # An agent's report: the stages before the Running stage are reused, not the whole step.
    last = run.memo.last_step
    assert last is not None
    clock.now_s += 1.0
    run.report({}, set())
    run.step()
    assert run.memo.last_step is not None and run.memo.last_step.settled is last.settled
