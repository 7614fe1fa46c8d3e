"""kopf handlers: thin adapters from kopf's events to :mod:`perseus_operator.jobs.lifecycle`.

Run with ``perseus-operator`` (or ``kopf run -m perseus_operator.handlers``). Settings come
from ``PERSEUS_OPERATOR_*`` variables (:class:`~perseus_operator.config.OperatorConfig`), read
once when this module is imported (the timer's interval is needed at registration).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeAlias

import kopf

from perseus_api import resources
from perseus_api.conventions import parse_rfc3339
from perseus_api.job import JOB_PLURAL
from perseus_api.job_status import PerseusJobStatus
from perseus_api.policy import POLICY_PLURAL
from perseus_api.power_budget import BUDGET_PLURAL
from perseus_operator.cluster.cluster_index import (
    IndexedJobIO,
    IndexedObject,
    PlanWrites,
    node_plan_entries,
    pod_entries,
    workload_entries,
)
from perseus_operator.cluster.kube.client import WORKLOAD_RESOURCES, KubeClient, load_api_client
from perseus_operator.config import OperatorConfig
from perseus_operator.jobs.job_decisions import STRAGGLER_STATE_ANNOTATION
from perseus_operator.jobs.job_release import RELEASE_PENDING, decide_release
from perseus_operator.jobs.lifecycle import JobMemo, Outcome, force_release, reconcile, release
from perseus_operator.jobs.planner_pool import CachingPlanner, PoolPlanner
from perseus_operator.metrics import OperatorMetrics
from perseus_operator.policies.policy_controller import PolicyController
from perseus_operator.power.budget_controller import BudgetController, JobFrontier
from perseus_operator.power.prometheus_draw import PrometheusDraw
from perseus_operator.workloads.objects import owner_reference

CONFIG: Final = OperatorConfig.from_env()
DEFAULT_POLICY: Final = CONFIG.default_policy_fields()
JOB: Final = (resources.GROUP, resources.VERSION, JOB_PLURAL)
POLICY: Final = (resources.GROUP, resources.VERSION, POLICY_PLURAL)
BUDGET: Final = (resources.GROUP, resources.VERSION, BUDGET_PLURAL)
FINALIZER: Final = f"{resources.GROUP}/reset-gpus"
RELEASE_POLL_S: Final = 1.0
"""Between two steps of a deletion that waits for the agents (a kopf retry, not a sleep)."""
RECONCILE_SLACK_S: Final = 120.0
"""A reconcile may take the planner's time limit plus this for its API calls."""
WORKLOAD_KINDS: Final = {resource: kind for kind, resource in WORKLOAD_RESOURCES.items()}
"""The workload kind of each (group, version, plural) the operator reads workloads of."""

log = logging.getLogger("perseus_operator")

ObjectIndex: TypeAlias = kopf.Index[Hashable, IndexedObject]

_watched_namespaces: list[str] = []


def watch_namespaces(names: list[str]) -> None:
    """Restrict the cluster-wide policies to these namespaces (``perseus-operator -n``), as
    kopf restricts the PerseusJobs; call before the operator starts."""
    _watched_namespaces[:] = names


@dataclass
class _Job:
    memo: JobMemo = field(default_factory=JobMemo)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    written: dict[str, Any] | None = None
    """The status this process last decided for the job (uid ``written_uid``)."""
    written_uid: str = ""
    written_from: PerseusJobStatus | None = None
    """The status ``written`` was dumped from."""
    node_plan_writes: PlanWrites = field(default_factory=PlanWrites)
    """Its node plan writes the index has not shown yet."""


@dataclass
class _Operator:
    """What the handlers share: kept in kopf's operator-level memo."""

    kube: KubeClient
    planner: CachingPlanner
    metrics: OperatorMetrics
    policies: PolicyController
    budgets: BudgetController | None = None
    jobs: dict[tuple[str, str], _Job] = field(default_factory=dict)
    stop_metrics: Any = None
    policy_rounds: asyncio.Task[None] | None = None
    budget_rounds: asyncio.Task[None] | None = None

    def frontiers(self) -> dict[tuple[str, str], JobFrontier]:
        """The frontiers the jobs' reconciles hold (for the power budgets: none solved again)."""
        return {
            key: JobFrontier(job.memo.frontier, job.memo.retarget_s)
            for key, job in self.jobs.items()
            if job.memo.frontier is not None
        }


def _state(memo: kopf.Memo) -> _Operator:
    state: _Operator = memo["perseus"]
    return state


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=resources.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=resources.GROUP)
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # events are ours; kopf posts only its warnings
    kubeconfig = CONFIG.kubeconfig or os.environ.get("KUBECONFIG", "")
    # perseus-operator serves /metrics itself, from before it leads (every replica): the
    # handlers' series join its registry. Run by `kopf run`, they serve their own.
    served = memo.get("perseus_registry")
    metrics = OperatorMetrics() if served is None else OperatorMetrics(registry=served)
    kube = KubeClient(load_api_client(kubeconfig))
    state = _Operator(
        kube=kube,
        planner=CachingPlanner(
            PoolPlanner(CONFIG.planner_workers, CONFIG.planner_timeout_s, metrics.planner.observe)
        ),
        metrics=metrics,
        policies=PolicyController(
            kube, interval_s=CONFIG.policy_interval_s, namespaces=_watched_namespaces
        ),
    )
    if served is None and CONFIG.metrics_port:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(
            CONFIG.metrics_port, CONFIG.metrics_address, registry=metrics.registry
        )
        state.stop_metrics = server.shutdown
    state.policy_rounds = asyncio.create_task(state.policies.run(), name="perseus-policies")
    state.budgets = BudgetController(
        kube,
        state.frontiers,
        interval_s=CONFIG.budget_interval_s,
        metrics=metrics,
        namespaces=_watched_namespaces,
        draw=(
            PrometheusDraw(CONFIG.prometheus_url, timeout_s=CONFIG.prometheus_timeout_s)
            if CONFIG.prometheus_url
            else None
        ),
        events_namespace=CONFIG.leader_election_namespace or "default",
    )
    state.budget_rounds = asyncio.create_task(state.budgets.run(), name="perseus-budgets")
    memo["perseus"] = state
    # What is loaded by now (kopf, the client, the planner's libraries: ~200,000 objects) lives
    # as long as the process: out of the garbage collector's way, so that a full collection
    # scans only what reconciles allocate. Its pauses stop the event loop, every timer with it
    # (benchmarks/operator_scale.py measured 150-300 ms ones at 200 jobs).
    gc.freeze()


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    state = memo.get("perseus")
    if state is None:
        return
    for rounds in (state.policy_rounds, state.budget_rounds):
        if rounds is not None:
            rounds.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rounds
    state.planner.close()
    state.kube.close()
    if state.stop_metrics is not None:
        state.stop_metrics()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    if CONFIG.kubeconfig:
        os.environ["KUBECONFIG"] = CONFIG.kubeconfig  # what kopf's kubeconfig login reads
    if os.environ.get("KUBECONFIG"):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_with_service_account(**kwargs)


# What a reconcile reads, kept current by kopf's watches (perseus_operator.cluster.cluster_index);
# each reaches every handler as the keyword argument of its function's name (_indexes). kopf
# fills them (from its first listing) before it calls any handler.


@kopf.index("v1", "pods")
def perseus_pods(body: kopf.Body, **_: Any) -> dict[Hashable, IndexedObject]:
    return pod_entries(body)


@kopf.index(resources.GROUP, resources.VERSION, resources.NODE_PLAN_PLURAL)
def perseus_node_plans(body: kopf.Body, **_: Any) -> dict[Hashable, IndexedObject]:
    return node_plan_entries(body)


def _is_workload(resource: kopf.Resource) -> bool:
    return (resource.group, resource.version, resource.plural) in WORKLOAD_KINDS


@kopf.index(_is_workload)  # those whose CRD is installed
def perseus_workloads(
    body: kopf.Body, resource: kopf.Resource, **_: Any
) -> dict[Hashable, IndexedObject]:
    kind = WORKLOAD_KINDS[(resource.group, resource.version, resource.plural)]
    return workload_entries(kind, body)


@kopf.on.create(*JOB)
@kopf.on.update(*JOB, field="spec")
async def changed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kwargs: Any) -> None:
    await _reconcile(body, patch, memo, _indexes(kwargs))


@kopf.timer(*JOB, interval=CONFIG.reconcile_interval_s)
async def progress(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kwargs: Any) -> None:
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    await _reconcile(body, patch, memo, _indexes(kwargs))


@kopf.on.delete(*JOB, retries=None, timeout=None)
async def deleted(body: kopf.Body, memo: kopf.Memo, runtime: timedelta, **kwargs: Any) -> None:
    """Keep the job (and its finalizer) until every agent has reset its GPUs, or the release
    timeout has passed.

    One release step per call; while agents are still resetting, ``kopf.TemporaryError``
    has kopf call again shortly, so the handler never sleeps and deleting many jobs at once
    waits for them side by side, not one after the other.
    """
    state = _state(memo)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    io = _job_io(state, (namespace, name), _indexes(kwargs))
    outcome = await release(namespace, name, io, owner_reference(_raw(body)))
    # kopf's runtime counts from this handler's first call, across retries and restarts; the
    # deletion timestamp also covers time the job waited before (e.g. with no operator).
    waited_s = max(
        _seconds_since(body["metadata"].get("deletionTimestamp")), runtime.total_seconds()
    )
    decision = decide_release(outcome, waited_s, CONFIG.release_timeout_s, RELEASE_POLL_S)
    if not decision.finish:
        raise kopf.TemporaryError(decision.message, delay=decision.retry_in_s)
    if decision.force:
        log.warning("PerseusJob %s/%s: %s", namespace, name, decision.message)
        kopf.warn(body, reason="ReleaseTimeout", message=decision.message)
        await force_release(namespace, name, io)
    state.jobs.pop((namespace, name), None)
    state.metrics.forget_job(namespace, name)


class _ReleaseRetriesAreRoutine(logging.Filter):
    """kopf logs every ``TemporaryError`` at ERROR level, and posts it as an Error event; a
    deletion waiting for the agents' reset is the normal course, so those become INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO and RELEASE_PENDING in record.getMessage():
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


RELEASE_RETRY_FILTER: Final = _ReleaseRetriesAreRoutine()
logging.getLogger("kopf.objects").addFilter(RELEASE_RETRY_FILTER)


@kopf.on.event(*POLICY)
async def policy_changed(memo: kopf.Memo, **kwargs: Any) -> None:
    """A PerseusPolicy was created, changed or deleted: act on it now, not at the next round."""
    state = memo.get("perseus")
    if state is not None:
        # Filled: kopf calls handlers only then.
        state.policies.read_pods_from(_indexes(kwargs).pods)
        state.policies.wake()


@kopf.on.event(*BUDGET)
async def budget_changed(
    event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """A PerseusPowerBudget was created, changed or deleted: act on it now (not on the
    controller's own status writes, which would make every write start another round)."""
    state = memo.get("perseus")
    if state is None or state.budgets is None:
        return
    generation = body.get("metadata", {}).get("generation")
    observed = (body.get("status") or {}).get("observedGeneration")
    if event.get("type") == "DELETED" or generation != observed:
        state.budgets.wake()


# -- adapters ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Indexes:
    pods: ObjectIndex
    node_plans: ObjectIndex
    workloads: ObjectIndex


def _indexes(kwargs: Mapping[str, Any]) -> _Indexes:
    """The indexes among a handler's keyword arguments."""
    return _Indexes(
        kwargs["perseus_pods"], kwargs["perseus_node_plans"], kwargs["perseus_workloads"]
    )


def _job_io(state: _Operator, key: tuple[str, str], indexes: _Indexes) -> IndexedJobIO:
    job = state.jobs.setdefault(key, _Job())
    return IndexedJobIO(
        state.kube,
        job=key,
        pods=indexes.pods,
        node_plans=indexes.node_plans,
        workloads=indexes.workloads,
        writes=job.node_plan_writes,
    )


async def _reconcile(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, indexes: _Indexes
) -> None:
    state = _state(memo)
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    io = _job_io(state, key, indexes)
    job = state.jobs[key]
    async with job.lock:  # a timer tick and a spec change never reconcile at once
        raw = _raw(body)
        if job.written_uid and job.written_uid != str(raw["metadata"].get("uid") or ""):
            job.node_plan_writes.pending.clear()  # those of an earlier job of the same name
        current = with_written_status(raw, job.written, job.written_uid)
        # Bounded, so that nothing (a hung connection) can stop this job's progress for good.
        async with asyncio.timeout(CONFIG.planner_timeout_s + RECONCILE_SLACK_S):
            outcome = await reconcile(
                current, io, state.planner, job.memo, default_policy=DEFAULT_POLICY
            )
        # Dumped once, and not again for the status object a quiet step hands back (decisions
        # edit a copy, never a status they were given): the patch is made of what is kept.
        if outcome.status is not job.written_from or job.written is None:
            job.written = outcome.status.model_dump(mode="json", by_alias=True)
            job.written_from = outcome.status
        written = job.written
        job.written_uid = str(raw["metadata"].get("uid") or "")
    # Against what the API showed: a status patch kopf could not apply is written again.
    _patch(raw, patch, outcome, written)
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    state.metrics.observe_job(
        *key,
        phase=outcome.status.phase,
        plan=outcome.plan,
        iterations=outcome.iterations,
        replicas=_replicas(raw),
        new_stragglers=outcome.new_stragglers,
    )


def with_written_status(
    raw: dict[str, Any], written: Mapping[str, Any] | None, written_uid: str
) -> dict[str, Any]:
    """The job with the status this process last decided for it, when it has one.

    Only the operator writes a PerseusJob's status, but kopf applies a handler's patch after
    the handler returns, and a handler waiting for the job's lock holds the body of when it
    was called: reconciling from that body went back a phase and wrote an old plan revision
    over a newer one (a revision then reused for another plan). A replica that has just
    taken over has nothing written yet and starts from the stored status.
    """
    if written is None or written_uid != str(raw["metadata"].get("uid") or ""):
        return raw
    return {**raw, "status": {**(raw.get("status") or {}), **written}}


def _patch(
    raw: Mapping[str, Any], patch: kopf.Patch, outcome: Outcome, new: Mapping[str, Any]
) -> None:
    """Only what changed: an unchanged status is not written again. ``new``: the outcome's
    status as JSON (``model_dump(mode="json", by_alias=True)``)."""
    old = raw.get("status") or {}
    for k, v in new.items():
        if old.get(k) != v:
            patch.status[k] = v
    annotations = (raw.get("metadata") or {}).get("annotations") or {}
    state = outcome.detector_state
    if state is not None and annotations.get(STRAGGLER_STATE_ANNOTATION) != state:
        patch.metadata.annotations[STRAGGLER_STATE_ANNOTATION] = state


def _raw(body: kopf.Body) -> dict[str, Any]:
    """A plain copy of the body, nothing shared with kopf's: a JSON round trip copies as deep
    as a ``copy.deepcopy`` (the body is JSON, parsed from the API) in a third of its time."""
    raw: dict[str, Any] = json.loads(json.dumps(dict(body)))
    return raw


def _replicas(raw: Mapping[str, Any]) -> int:
    try:
        return int(raw["spec"]["parallelism"].get("dataParallel", 1))
    except (KeyError, TypeError, ValueError, AttributeError):
        return 1


def _seconds_since(stamp: object) -> float:
    when = parse_rfc3339(stamp)
    if when is None:
        return 0.0
    return max(0.0, (datetime.now(tz=UTC) - when).total_seconds())
