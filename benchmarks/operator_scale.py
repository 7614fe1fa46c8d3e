"""The operator at scale: reconcile latency and straggler reaction with 200 jobs on 1,000 nodes.

Everything runs in this process, on one asyncio event loop, with time scaled down: in
production node agents report every 10 s and the operator reconciles every job every 5 s
(``PERSEUS_OPERATOR_RECONCILE_INTERVAL_S``); here the defaults are 1 s and 0.5 s (10x faster,
so the operator does 10x the work per second it would do in production).

* **Cluster**: an in-memory :class:`~perseus_operator.jobs.job_observation.JobIO` that keeps every
object
  as JSON text and hands out freshly parsed copies, as the real client does after an API call
  (the operator's own (de)serialization is measured; the network, the API server, etcd and the
  client's worker-thread hop are not). Node plans are indexed by (namespace, job). Beside it,
  the operator's watch indexes (:mod:`perseus_operator.cluster.cluster_index`, kopf's indexes in
  ``perseus-operator``): pods, and node plans, whose every write (the operator's and the
  agents') is delivered to the index as a watch event would be, parsed and re-filed, one turn
  of the event loop after the write.
* **Jobs**: ``--jobs`` PerseusJobs of workload kind ``Pods``, each with ``--nodes-per-job`` pods
  on as many distinct nodes (1,000 nodes by default), policy ``StragglerAware`` at
  ``Instruction`` granularity. Layouts cycle through data-parallel 2-5, 4/5/8 pipeline stages
  and tensor-parallel 1 or 5: four distinct pipelines (stages x microbatches), in four
  namespaces. Profiling is skipped: every job has a ``profileRef`` to a ConfigMap of its
  namespace holding the bundled profile cut to its number of stages. Straggler settings:
  ``persistenceReports`` 2, ``warmupIterations`` 0, ``staleAfterSeconds`` 6 report intervals
  (60 s in production).
* **Operator**: per job, a timer task like kopf's (reconcile, then sleep the interval; random
  first phase) runs :func:`~perseus_operator.jobs.lifecycle.reconcile` under the job's lock and
  ``asyncio.timeout``, through an :class:`~perseus_operator.cluster.cluster_index.IndexedJobIO` over
  the cluster and its indexes (as the handlers do), with a
  :class:`~perseus_operator.jobs.planner_pool.CachingPlanner` over a one-worker
  :class:`~perseus_operator.jobs.planner_pool.PoolPlanner` (what ``perseus-operator`` runs).
  Around it, what the kopf handler does: the JSON copy of the body, the status written back
  as a merge patch (applied at once: no watch round trip), the straggler-state
  annotation, the job's metrics (:class:`~perseus_operator.metrics.OperatorMetrics`).
  Events are counted, not posted.
* **Agents**: one task per node writes its node plan's status every report interval (random
  phase): ``observedRevision``, ``reportedAt``, an ``Applied`` condition, per-GPU entries and
  per-rank ``mean_iteration_s``. Every replica reports its own pace, the plan's ``T_min``
  with +-0.5 % noise (as in the unit tests), so a re-target does not feed back into the
  measurements. A straggler's ranks report ``--slowdown`` (1.2) times that, as a step: the
  agent's own averaging window is not simulated.
* **Stragglers**: once every job is Running with its plans applied, plus 2 report intervals,
  the measured window of ``--duration-s`` starts. ``--stragglers`` jobs, at random times in
  the window, get one replica that is slow for 6 report intervals, then recovers.

Measured (in the window): the wall time of each ``reconcile`` call (p50/p99/max) and of the
whole handler step; how late timers and agents woke up (event-loop saturation); straggler
reaction, from the first agent report that shows the slowdown to the moment the node plans
re-targeting the healthy replicas are written (``put_node_plan``), in report intervals;
recovery reaction, from the report that completes the recovery (the last node of the replica
to report normal times) to the moment plans back at ``T_min`` are written; false positives
(re-target writes of a job without an active injected straggler); CPU time of the process
per simulated node report; peak RSS.

Target (from the issue): straggler reaction p99 under 2 report intervals, every injected
straggler re-targeted, no false positive. By design, detection needs ``persistenceReports``
(2) report rounds on the slow side, so the floor is about one report interval plus the wait
for the next reconcile; the script also says how many slow reports each re-target actually
followed.

Run from the repository root (about 100 s; ``--quick``: about 20 s)::

    python benchmarks/operator_scale.py
    python benchmarks/operator_scale.py --quick

``--ci`` (``make bench``) is ``--quick`` with the target, the reaction not judged when the
machine starved the process, and one more check: the CPU of a handler step without plan writes
against an anchor measured in the same run (:func:`anchor_cpu_s`), at most
:data:`STEP_OVER_ANCHOR_MAX`.

Exit status: 0 when the target is met, 1 when it is missed (everything is printed first), 2
when the benchmark could not run (a job did not reach Running, a planner failure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import importlib.util
import json
import math
import os
import random
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final, NamedTuple, cast

REPO = Path(__file__).resolve().parents[1]
OPERATOR_ROOT = REPO / "operator"
if importlib.util.find_spec("perseus_operator") is None:
    sys.path.insert(0, str(OPERATOR_ROOT))
if importlib.util.find_spec("perseus_agent") is None:
    sys.path.insert(0, str(REPO / "node_agent"))

from perseus_agent.kube.report_cadence import ReportCadence, write_due  # noqa: E402
from perseus_api import resources  # noqa: E402
from perseus_api.job import WorkloadKind  # noqa: E402
from perseus_api.job_status import PerseusJobStatus, Phase  # noqa: E402
from perseus_operator.cluster.cluster_index import (  # noqa: E402
    IndexedJobIO,
    IndexedObject,
    PlanWrites,
    node_plan_entries,
    pod_entries,
)
from perseus_operator.cluster.kube.client import config_map_object  # noqa: E402
from perseus_operator.jobs.job_decisions import STRAGGLER_STATE_ANNOTATION  # noqa: E402
from perseus_operator.jobs.job_observation import JobIO  # noqa: E402
from perseus_operator.jobs.lifecycle import JobMemo, Outcome, reconcile  # noqa: E402
from perseus_operator.jobs.planner_pool import CachingPlanner, InlinePlanner, PoolPlanner  # noqa: E402
from perseus_operator.jobs.planning import RETARGETED_PLAN, PlanningInput  # noqa: E402
from perseus_operator.metrics import OperatorMetrics  # noqa: E402
from perseus_planner import DEFAULT_PROFILE, Frontier, bundled_profile  # noqa: E402

ESTIMATES: Final = {"Instruction": "instructionEstimate", "Stage": "stageEstimate"}
STARVED_LATENESS_R: Final = 0.1
STARVED_LATENESS_P99_R: Final = 0.25
"""--ci: timers later than these at the median or the p99 mean the machine starved the
process (measured on a loaded VM: a p50 of 23 ms and a p99 of 760 ms, with the process at
16 % of a core, came with a reaction p99 of 3.4 R)."""
RESULT: Final = {True: "PASS", False: "FAIL", None: "not judged"}
STEP_OVER_ANCHOR_MAX: Final = 6.0
"""--ci: the most CPU a handler step without plan writes may take, in anchors (:func:`anchor_cpu_s`,
measured in the same run, so that a loaded machine inflates both alike). Measured with --ci's
settings on the loaded 2-core VM, 2026-12-05 (docs/measurements/operator-scale.md): 7.4-8.3
anchors before the quiet steps (main at f88aa64), 3.1-3.8 after."""
ANCHOR_DOCUMENT: Final = {
    "items": [
        {"rank": i, "node": f"gpu-node-{i:05d}", "mhz": [1410.0 + k for k in range(8)], "ok": True}
        for i in range(64)
    ]
}
"""A fixed document (~11 KiB of JSON, a node plan's size) for :func:`anchor_cpu_s`."""
PRODUCTION_REPORT_S: Final = 10.0
PRODUCTION_RECONCILE_S: Final = 5.0
TARGET_REACTION_R: Final = 2.0
PERSISTENCE_REPORTS: Final = 2
STALE_AFTER_R: Final = 6.0  # 60 s at the production report interval
SETTLE_R: Final = 2.0  # after start-up, before the window: detectors have a baseline
SLOW_FOR_R: Final = 6.0  # how long an injected straggler stays slow
RECOVERY_MARGIN_R: Final = 5.0  # window left after a straggler recovers
BLOCKING_POWER_W: Final = 83.64  # the bundled profile's published blocking power
PLANNER_TIMEOUT_S: Final = 600.0  # the operator's default
RECONCILE_TIMEOUT_S: Final = PLANNER_TIMEOUT_S + 120.0  # handlers.RECONCILE_SLACK_S
PROFILE_CONFIG_MAP: Final = "perseus-profile-{stages}-stages"
NAMESPACES: Final = 4
MAX_GPUS_PER_POD: Final = 8
APPLIED_MHZ: Final = 1410


class BenchmarkError(RuntimeError):
    """The benchmark cannot go on (exit status 2)."""


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    microbatches: int

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


CANDIDATE_LAYOUTS: Final = (
    Layout(dp=5, pp=4, tp=1, microbatches=8),
    Layout(dp=2, pp=5, tp=1, microbatches=8),
    Layout(dp=4, pp=5, tp=1, microbatches=16),
    Layout(dp=3, pp=5, tp=1, microbatches=8),
    Layout(dp=5, pp=8, tp=1, microbatches=16),
    Layout(dp=2, pp=4, tp=5, microbatches=8),
)


def layouts_for(nodes_per_job: int) -> list[Layout]:
    """The candidate layouts whose processes fill ``nodes_per_job`` pods evenly."""
    return [
        layout
        for layout in CANDIDATE_LAYOUTS
        if layout.world % nodes_per_job == 0 and layout.world // nodes_per_job <= MAX_GPUS_PER_POD
    ]


def cut_profile(stages: int) -> str:
    """The bundled profile's rows of the first ``stages`` pipeline stages."""
    lines = bundled_profile(DEFAULT_PROFILE).path.read_text().strip().splitlines()
    column = lines[0].split(",").index("stage")
    kept = [line for line in lines[1:] if int(line.split(",")[column]) < stages]
    return "\n".join([lines[0], *kept]) + "\n"


# --------------------------------------------------------------------------- in-memory cluster


@dataclass
class StoredPlan:
    """A PerseusNodePlan as the API server would keep it: spec and status apart, as JSON,
    plus the little the simulated agent reads (kept small: every object the harness keeps
    slows the garbage collector, which pauses the operator's event loop too)."""

    namespace: str
    name: str
    job: str
    node: str
    metadata_json: str
    spec_json: str
    revision: int
    granularity: str
    assignments: list[dict[str, Any]]
    base_s: float
    """The plans' T_min."""
    pace_s: dict[str, float]
    """Per pipeline plan: its expected iteration time, the pace its ranks report (a replica
    re-targeted to a straggler's T' runs at T', as a real one does)."""
    status_json: str = "{}"
    resource_version: int = 0
    """Changes with every write, spec or status, as the API server's."""
    generation: int = 1
    """Changes with every spec write, as the API server's."""

    def text(self) -> str:
        metadata = f'{self.metadata_json[:-1]},"resourceVersion":"{self.resource_version}"}}'
        return (
            f'{{"apiVersion":"{resources.API_VERSION}","kind":"{resources.NODE_PLAN_KIND}",'
            f'"metadata":{metadata},"spec":{self.spec_json},'
            f'"status":{self.status_json}}}'
        )


@dataclass
class PlanWrite:
    t: float
    revision: int
    retargeted: bool


class WatchIndex(Mapping[Hashable, Collection[IndexedObject]]):
    """What a ``kopf.Index`` is to the handlers: key -> the objects filed under it, each
    object filed again (under the keys ``entries`` gives it) whenever it changes."""

    def __init__(self, entries: Callable[[Mapping[str, Any]], dict[Hashable, IndexedObject]]):
        self._entries = entries
        self._filed: dict[Hashable, dict[tuple[str, str], IndexedObject]] = {}
        self._keys_of: dict[tuple[str, str], tuple[Hashable, ...]] = {}

    def __getitem__(self, key: Hashable) -> Collection[IndexedObject]:
        return self._filed[key].values()

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._filed)

    def __len__(self) -> int:
        return len(self._filed)

    def put(self, obj: Mapping[str, Any]) -> None:
        ref = resources.object_key(obj)
        self.discard(ref)
        entries = self._entries(obj)
        for key, value in entries.items():
            self._filed.setdefault(key, {})[ref] = value
        self._keys_of[ref] = tuple(entries)

    def discard(self, ref: tuple[str, str]) -> None:
        for key in self._keys_of.pop(ref, ()):
            filed = self._filed[key]
            filed.pop(ref, None)
            if not filed:
                del self._filed[key]


class Cluster:
    """The :class:`~perseus_operator.jobs.job_observation.JobIO` of an in-memory cluster, and the
    operator's watch indexes over it.

    Objects are kept as JSON text and every read parses a fresh copy, which is what the
    operator pays with a real API client; writes are serialized. Nothing yields to the event
    loop (there is no network to wait for). Every call counts as one API call; a node plan
    written is delivered to the index (parsed, then filed) one turn of the loop later.
    """

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], str] = {}  # (namespace, selector) -> JSON list
        self.config_maps: dict[tuple[str, str], str] = {}
        self.plans: dict[tuple[str, str], dict[str, StoredPlan]] = {}  # (ns, job) -> by name
        self.on_node: dict[str, StoredPlan] = {}
        self.writes: dict[tuple[str, str], list[PlanWrite]] = {}
        self.calls = 0
        self.calls_by: Counter[str] = Counter()
        self.versions = 0  # resourceVersion: the operator validates a status once per version
        self.pod_index = WatchIndex(pod_entries)
        self.plan_index = WatchIndex(node_plan_entries)
        self.watch_events = 0
        self.watch_cpu_s = 0.0
        """CPU time (this thread) of the watch events: parsing (kopf's) and filing them."""

    def _count(self, method: str) -> None:
        self.calls += 1
        self.calls_by[method] += 1

    # -- the watches --

    def add_pods(self, namespace: str, selector: str, pods: list[dict[str, Any]]) -> None:
        self.pods[(namespace, selector)] = json.dumps(pods)
        for obj in pods:
            self.pod_index.put(obj)

    def _deliver(self, plan: StoredPlan | None, ref: tuple[str, str]) -> None:
        """A watch event of node plan ``ref`` (None: deleted), one loop turn from now."""

        def arrived() -> None:
            c0 = time.thread_time()
            self.watch_events += 1
            if plan is None:
                self.plan_index.discard(ref)
            else:
                self.plan_index.put(json.loads(plan.text()))
            self.watch_cpu_s += time.thread_time() - c0

        asyncio.get_running_loop().call_soon(arrived)

    # -- JobIO --

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self._count("list_pods")
        text = self.pods.get((namespace, selector))
        items: list[dict[str, Any]] = json.loads(text) if text else []
        return items

    async def get_workload(
        self, namespace: str, kind: WorkloadKind, name: str
    ) -> dict[str, Any] | None:
        self._count("get_workload")
        return None

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._count("get_config_map")
        text = self.config_maps.get((namespace, name))
        found: dict[str, Any] | None = json.loads(text) if text else None
        return found

    async def put_config_map(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        owner: Mapping[str, Any],
        annotations: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self._count("put_config_map")
        self.config_maps[(namespace, name)] = json.dumps(
            config_map_object(namespace, name, data, owner, annotations, labels)
        )

    async def list_config_maps(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self._count("list_config_maps")
        return []  # the simulated jobs name no model: never called

    async def get_node(self, name: str) -> dict[str, Any] | None:
        self._count("get_node")
        return None

    async def list_node_plans(self, namespace: str, job: str) -> list[dict[str, Any]]:
        self._count("list_node_plans")
        stored = self.plans.get((namespace, resources.label_value(job)), {})
        return [json.loads(stored[name].text()) for name in sorted(stored)]

    async def list_node_plans_on(
        self, namespace: str, nodes: Collection[str]
    ) -> list[dict[str, Any]]:
        self._count("list_node_plans_on")
        on_nodes = (self.on_node.get(node) for node in sorted(set(nodes)))
        return [
            json.loads(p.text()) for p in on_nodes if p is not None and p.namespace == namespace
        ]

    async def list_jobs(self, namespace: str | None, selector: str = "") -> list[dict[str, Any]]:
        self._count("list_jobs")
        return []  # read only when another job's plan is on a job's GPU: never here

    async def put_node_plan(self, body: Mapping[str, Any], owner: Mapping[str, Any]) -> None:
        self._count("put_node_plan")
        namespace, name = resources.object_key(body)
        job = str(body["metadata"]["labels"][resources.JOB_LABEL])
        spec = body["spec"]
        by_name = self.plans.setdefault((namespace, job), {})
        previous = by_name.get(name)
        # As the API server: a uid for the object's life, a generation bumped by spec writes.
        generation = previous.generation + 1 if previous else 1
        metadata = {
            **body["metadata"],
            "ownerReferences": [dict(owner)],
            "uid": f"plan-{namespace}-{name}",
            "generation": generation,
        }
        plan = StoredPlan(
            namespace=namespace,
            name=name,
            job=job,
            node=str(spec["node"]),
            metadata_json=json.dumps(metadata),
            spec_json=json.dumps(spec),
            revision=int(spec["revision"]),
            granularity=str(spec["granularity"]),
            assignments=[
                {k: a[k] for k in ("gpuIndex", "plan", "stage", "dpRank", "rank")}
                for a in spec["assignments"]
            ],
            base_s=min(float(p["tMinSeconds"]) for p in spec["plans"].values()),
            pace_s={
                name: float(p[f"{ESTIMATES[str(spec['granularity'])]}"]["iterationTimeSeconds"])
                for name, p in spec["plans"].items()
            },
            status_json=previous.status_json if previous else "{}",  # status is a subresource
            resource_version=self._next_version(),
            generation=generation,
        )
        by_name[name] = plan
        self.on_node[plan.node] = plan
        self._deliver(plan, (namespace, name))
        retargeted = any(a["plan"] == RETARGETED_PLAN for a in plan.assignments)
        writes = self.writes.setdefault((namespace, job), [])
        revision = plan.revision
        now = time.monotonic()
        if writes and writes[-1].revision == revision:
            writes[-1].t = now  # the revision is written when its last node plan is
            writes[-1].retargeted |= retargeted
        else:
            writes.append(PlanWrite(now, revision, retargeted))

    async def delete_node_plan(self, namespace: str, name: str) -> None:
        self._count("delete_node_plan")
        for by_name in self.plans.values():
            plan = by_name.get(name)
            if plan is not None and plan.namespace == namespace:
                del by_name[name]
                if self.on_node.get(plan.node) is plan:
                    del self.on_node[plan.node]
                self._deliver(None, (namespace, name))
                return

    # -- the agents' side --

    def write_status(self, plan: StoredPlan, status: Mapping[str, Any]) -> None:
        plan.status_json = json.dumps(status)
        plan.resource_version = self._next_version()
        self._deliver(plan, (plan.namespace, plan.name))

    def _next_version(self) -> int:
        self.versions += 1
        return self.versions


# --------------------------------------------------------------------------- simulation


@dataclass
class Injection:
    """One replica of a job slowed down from ``onset`` to ``end`` (monotonic seconds)."""

    dp_rank: int
    onset: float
    end: float
    first_slow_report: float | None = None
    first_slow_node: str = ""
    slow_reports: dict[str, list[float]] = field(default_factory=dict)
    """Per node hosting the replica: when it reported the slowdown."""
    recovered_report: dict[str, float] = field(default_factory=dict)
    """Per node hosting the replica: its first report after ``end``."""


@dataclass
class SimJob:
    index: int
    namespace: str
    name: str
    layout: Layout
    nodes: list[str]
    body: dict[str, Any]
    memo: JobMemo = field(default_factory=JobMemo)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    injection: Injection | None = None
    plan_writes: PlanWrites = field(default_factory=PlanWrites)
    last_outcome: Outcome | None = None
    written: dict[str, Any] | None = None
    written_from: PerseusJobStatus | None = None
    """Its last step's outcome (for :func:`adapter_cpu_s`)."""

    def slow_dp(self, now: float) -> int | None:
        i = self.injection
        if i is not None and i.onset <= now < i.end:
            return i.dp_rank
        return None


class Tick(NamedTuple):
    """One timer tick of the operator (a tuple of numbers: the collector soon skips it)."""

    start: float
    reconcile_s: float
    handler_s: float  # the work, without waiting for the loop
    handler_wall_s: float
    handler_cpu_s: float  # CPU time of the event loop's thread: what the load does not inflate
    late_s: float
    wrote: bool  # the tick wrote node plans
    status_patched: bool
    annotation_patched: bool
    events: int


@dataclass
class Settings:
    jobs: int
    nodes_per_job: int
    report_s: float
    reconcile_s: float
    duration_s: float
    stragglers: int
    slowdown: float
    jitter: float
    planner: str
    seed: int
    cadence: str = "dead-band"
    """``every``: every report is written; ``dead-band``: as the agent writes them
    (:mod:`perseus_agent.kube.report_cadence`)."""
    heartbeat_r: float = 3.0
    dead_band: float = 0.01
    profile: str = ""
    decide_every_step: bool = False
    """Quiet steps off (:class:`DecidingEveryStep`), for comparison."""
    ci: bool = False
    """The quick form for CI: the wall-clock reaction is not judged on a starved process."""
    """cProfile the measured window into this file (the figures then include its cost)."""


def job_body(
    index: int, namespace: str, name: str, layout: Layout, settings: Settings
) -> dict[str, Any]:
    return {
        "apiVersion": resources.API_VERSION,
        "kind": "PerseusJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{index:05d}",
            "generation": 1,
            "annotations": {},
        },
        "spec": {
            "workload": {"kind": "Pods", "podSelector": {"matchLabels": {"app": name}}},
            "parallelism": {
                "pipelineStages": layout.pp,
                "dataParallel": layout.dp,
                "tensorParallel": layout.tp,
                "microbatches": layout.microbatches,
            },
            "policy": {"blockingPowerWatts": BLOCKING_POWER_W},
            "profiling": {
                "profileRef": {"configMapName": PROFILE_CONFIG_MAP.format(stages=layout.pp)}
            },
            "stragglers": {
                "persistenceReports": PERSISTENCE_REPORTS,
                "warmupIterations": 0,
                "staleAfterSeconds": STALE_AFTER_R * settings.report_s,
            },
        },
    }


def pod(job: str, namespace: str, index: int, node: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-{index}",
            "namespace": namespace,
            "labels": {"app": job},
            # As the API server gives them: reconciles resolve ranks once per pod version.
            "uid": f"pod-{namespace}-{job}-{index}",
            "resourceVersion": "1",
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "trainer",
                    "env": [{"name": "JOB_COMPLETION_INDEX", "value": str(index)}],
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
        "status": {"phase": "Running"},
    }


class Simulation:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.cluster = Cluster()
        self.metrics = OperatorMetrics()
        self.solves: list[float] = []  # seconds of each frontier solve the cache let through
        inner: PoolPlanner | InlinePlanner
        if settings.planner == "pool":
            inner = PoolPlanner(1, PLANNER_TIMEOUT_S, self.solves.append)
        else:
            inner = CountingInlinePlanner(self.solves)
        self.planner = CachingPlanner(inner)
        self.jobs: list[SimJob] = []
        self.by_key: dict[tuple[str, str], SimJob] = {}
        self.ticks: list[Tick] = []
        self.reports: list[tuple[float, float, float, bool]] = []
        """Per agent report: when it was made, how late, what making (and writing) it cost
        (s), and whether it was written."""
        self.errors: list[str] = []
        self.stop = asyncio.Event()
        self.gc = GcWatch()
        self.iterations: dict[str, int] = {}
        self.cadence: ReportCadence | None = None
        if settings.cadence == "dead-band":
            self.cadence = ReportCadence(
                settings.report_s, settings.heartbeat_r * settings.report_s, settings.dead_band
            )
        self.written: dict[str, tuple[float, dict[str, Any]]] = {}
        """Per node: when its status was last written (loop time), and what."""
        self.calls_by: Counter[str] = Counter()
        """API calls in the window, by JobIO method."""
        self.watch_events = 0
        """Node plan watch events delivered to the index in the window."""
        self.watch_cpu_s = 0.0
        self.anchor_s = math.nan
        """:func:`anchor_cpu_s`, the lesser of right after the window and once stopped."""
        self.adapter_s = math.nan
        """:func:`adapter_cpu_s`, measured once the operator has stopped."""

    # -- set-up --

    def populate(self) -> None:
        s = self.s
        layouts = layouts_for(s.nodes_per_job)
        if not layouts:
            raise BenchmarkError(
                f"no layout fills {s.nodes_per_job} pods evenly with at most "
                f"{MAX_GPUS_PER_POD} GPUs each; try --nodes-per-job 5"
            )
        profiles = {pp: cut_profile(pp) for pp in {x.pp for x in layouts}}
        for namespace in (f"team-{n}" for n in range(NAMESPACES)):
            for stages, csv_text in profiles.items():
                name = PROFILE_CONFIG_MAP.format(stages=stages)
                self.cluster.config_maps[(namespace, name)] = json.dumps(
                    {
                        "metadata": {"name": name, "namespace": namespace},
                        "data": {"profile.csv": csv_text},
                    }
                )
        for index in range(s.jobs):
            namespace = f"team-{index % NAMESPACES}"
            name = f"train-{index:04d}"
            layout = layouts[index % len(layouts)]
            gpus = layout.world // s.nodes_per_job
            nodes = [f"gpu-node-{index * s.nodes_per_job + k:05d}" for k in range(s.nodes_per_job)]
            pods = [pod(name, namespace, k, node, gpus) for k, node in enumerate(nodes)]
            self.cluster.add_pods(namespace, f"app={name}", pods)
            job = SimJob(
                index, namespace, name, layout, nodes, job_body(index, namespace, name, layout, s)
            )
            self.jobs.append(job)
            self.by_key[(namespace, name)] = job

    # -- the operator's side --

    async def timer(self, job: SimJob) -> None:
        interval = self.s.reconcile_s
        loop = asyncio.get_running_loop()
        due = loop.time() + self.rng.uniform(0.0, interval)
        await asyncio.sleep(due - loop.time())
        while not self.stop.is_set():
            start = loop.time()
            late = max(0.0, start - due)
            try:
                tick = await self.handle(job, start, late)
            except Exception as exc:  # a bug, not a measurement: stop and say so
                self.errors.append(f"{job.namespace}/{job.name}: {exc!r}")
                self.stop.set()
                return
            self.ticks.append(tick)
            due = loop.time() + interval  # kopf timers: the interval runs from the end
            await asyncio.sleep(interval)

    async def handle(self, job: SimJob, start: float, late: float) -> Tick:
        """What handlers._reconcile does with one timer tick of the job."""
        c0 = time.thread_time()
        t0 = time.perf_counter()
        raw: dict[str, Any] = json.loads(json.dumps(job.body))  # kopf.Body -> plain dict
        writes = len(self.cluster.writes.get((job.namespace, job.name), ()))
        timed: list[float] = []
        c = self.cluster
        io: JobIO = IndexedJobIO(
            c,
            job=(job.namespace, job.name),
            pods=c.pod_index,
            node_plans=c.plan_index,
            workloads={},  # the jobs' workloads are of kind Pods
            writes=job.plan_writes,
        )
        if self.s.decide_every_step:
            io = cast(JobIO, DecidingEveryStep(io))

        async def timed_reconcile() -> Outcome:
            r0 = time.perf_counter()
            try:
                return await reconcile(raw, io, self.planner, job.memo)
            finally:
                timed.append(time.perf_counter() - r0)

        async with job.lock:  # and bounded in time, as the handler does
            w0 = time.perf_counter()
            async with asyncio.timeout(RECONCILE_TIMEOUT_S):
                outcome = await timed_reconcile()
            w1 = time.perf_counter()
        job.last_outcome = outcome
        status_patched, annotation_patched = self.patch(job, outcome)
        self.metrics.observe_job(
            job.namespace,
            job.name,
            phase=outcome.status.phase,
            plan=outcome.plan,
            iterations=outcome.iterations,
            replicas=job.layout.dp,
            new_stragglers=outcome.new_stragglers,
        )
        t1 = time.perf_counter()
        wrote = len(self.cluster.writes.get((job.namespace, job.name), ())) != writes
        return Tick(
            start=start,
            reconcile_s=timed[0],
            handler_s=(w0 - t0) + timed[0] + (t1 - w1),
            handler_wall_s=t1 - t0,
            handler_cpu_s=time.thread_time() - c0,
            late_s=late,
            wrote=wrote,
            status_patched=status_patched,
            annotation_patched=annotation_patched,
            events=len(outcome.events),
        )

    @staticmethod
    def patch(job: SimJob, outcome: Outcome) -> tuple[bool, bool]:
        """The status and annotation patch of the handler, applied to the stored body; says
        whether each was not empty (kopf would send it to the API)."""
        if outcome.status is not job.written_from or job.written is None:  # as the handler
            job.written = outcome.status.model_dump(mode="json", by_alias=True)
            job.written_from = outcome.status
        new = job.written
        status = job.body.setdefault("status", {})
        status_patched = False
        for key, value in new.items():
            if status.get(key) != value:
                status_patched = True
                if value is None:
                    status.pop(key, None)  # a merge patch's null removes the field
                else:
                    status[key] = value
        state = outcome.detector_state
        annotations = job.body["metadata"].setdefault("annotations", {})
        annotation_patched = False
        if state is not None and annotations.get(STRAGGLER_STATE_ANNOTATION) != state:
            annotations[STRAGGLER_STATE_ANNOTATION] = state
            annotation_patched = True
        return status_patched, annotation_patched

    # -- the agents' side --

    async def agent(self, node: str) -> None:
        period = self.s.report_s
        loop = asyncio.get_running_loop()
        due = loop.time() + self.rng.uniform(0.0, period)
        while not self.stop.is_set():
            await asyncio.sleep(max(0.0, due - loop.time()))
            now = loop.time()
            t0 = time.perf_counter()
            written = self.report(node, now)
            if written is not None:
                self.reports.append((now, now - due, time.perf_counter() - t0, written))
            due += period
            if due < now:  # fell behind by a whole period: skip, as a real agent would
                due = now + period

    def report(self, node: str, now: float) -> bool | None:
        """Report the node's status: True when written, False when the dead-band held it
        back, None when the node has no plan yet."""
        plan = self.cluster.on_node.get(node)
        if plan is None:
            return None
        job = self.by_key[(plan.namespace, plan.job)]
        revision, base = plan.revision, plan.base_s
        slow_dp = job.slow_dp(now)
        jitter = self.s.jitter
        # Iterations done in one production report interval.
        done = max(1, round(PRODUCTION_REPORT_S / base))
        iterations = self.iterations[node] = self.iterations.get(node, 0) + done
        gpus, ranks = [], []
        slow = False
        for a in plan.assignments:
            factor = 1.0 + self.rng.uniform(-jitter, jitter)
            if a["dpRank"] == slow_dp:
                factor *= self.s.slowdown
                slow = True
            gpus.append(
                {
                    "uuid": f"GPU-{node}-{a['gpuIndex']}",
                    "index": a["gpuIndex"],
                    "plan": a["plan"],
                    "stage": a["stage"],
                    "dp_rank": a["dpRank"],
                    "rank": a["rank"],
                    "target_mhz": APPLIED_MHZ,
                    "applied_mhz": APPLIED_MHZ,
                    "status": "Applied",
                    "message": "",
                }
            )
            ranks.append(
                {
                    "rank": a["rank"],
                    "dp_rank": a["dpRank"],
                    "pp_rank": a["stage"],
                    "iterations": iterations,
                    "last_iteration_s": plan.pace_s[a["plan"]] * factor,
                    "mean_iteration_s": plan.pace_s[a["plan"]] * factor,
                }
            )
        status = {
            "node": node,
            "job": plan.job,
            "namespace": plan.namespace,
            "revision": revision,
            "granularity": plan.granularity,
            "gpus": gpus,
            "ranks": ranks,
            "profiling": [],
            resources.STATUS_OBSERVED_REVISION: revision,
            resources.STATUS_REPORTED_AT: rfc3339_now(),
            "conditions": [
                {
                    "type": resources.CONDITION_APPLIED,
                    "status": "True",
                    "reason": resources.REASON_APPLIED,
                    "message": f"{len(gpus)} Applied",
                }
            ],
        }
        self.note_report(job, node, now, slow)
        cadence = self.cadence
        if cadence is not None:
            status = cadence.stamp(status)
            last = self.written.get(node)
            since_s = math.inf if last is None else now - last[0]
            previous = None if last is None else last[1]
            if write_due(previous, status, since_written_s=since_s, cadence=cadence) is None:
                return False
            self.written[node] = (now, status)
        self.cluster.write_status(plan, status)
        return True

    @staticmethod
    def note_report(job: SimJob, node: str, now: float, slow: bool) -> None:
        i = job.injection
        if i is None or now < i.onset:
            return
        if slow:
            if i.first_slow_report is None:
                i.first_slow_report, i.first_slow_node = now, node
            i.slow_reports.setdefault(node, []).append(now)
        elif now >= i.end and node in i.slow_reports:
            i.recovered_report.setdefault(node, now)

    # -- the run --

    def all_applied(self) -> bool:
        for job in self.jobs:
            status = job.body.get("status") or {}
            phase = status.get("phase")
            if phase == Phase.FAILED.value:
                raise BenchmarkError(
                    f"job {job.namespace}/{job.name} failed: {status.get('message')}"
                )
            if phase != Phase.RUNNING.value:
                return False
            applied = next(
                (c for c in status.get("conditions") or () if c.get("type") == "PlanApplied"),
                None,
            )
            if applied is None or applied.get("status") != "True":
                return False
        return True

    async def run(self, stack: contextlib.ExitStack) -> Results:
        s = self.s
        loop = asyncio.get_running_loop()
        self.populate()
        gc.freeze()  # as the operator's start-up handler does (perseus_operator.handlers)
        stack.enter_context(self.gc)
        started = loop.time()
        tasks = [asyncio.create_task(self.timer(job)) for job in self.jobs]
        tasks += [asyncio.create_task(self.agent(n)) for job in self.jobs for n in job.nodes]
        try:
            deadline = started + 120.0 + 20 * s.report_s
            while not self.all_applied():
                if self.errors:
                    raise BenchmarkError(self.errors[0])
                if loop.time() > deadline:
                    running = sum(
                        (j.body.get("status") or {}).get("phase") == "Running" for j in self.jobs
                    )
                    raise BenchmarkError(
                        f"only {running} of {len(self.jobs)} jobs Running with their plans "
                        f"applied after {deadline - started:.0f} s"
                    )
                await asyncio.sleep(0.05)
            startup_s = loop.time() - started
            await asyncio.sleep(SETTLE_R * s.report_s)
            window_start = loop.time()
            self.inject(window_start)
            cpu0, calls0 = cpu_seconds(), self.cluster.calls
            by0, events0 = Counter(self.cluster.calls_by), self.cluster.watch_events
            watch_cpu0 = self.cluster.watch_cpu_s
            profiler = cProfile.Profile() if s.profile else None
            if profiler is not None:
                profiler.enable()
            await asyncio.sleep(s.duration_s)
            window_end = loop.time()
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(s.profile)
            cpu, calls = cpu_seconds() - cpu0, self.cluster.calls - calls0
            self.anchor_s = anchor_cpu_s()
            self.calls_by = self.cluster.calls_by - by0
            self.watch_events = self.cluster.watch_events - events0
            self.watch_cpu_s = self.cluster.watch_cpu_s - watch_cpu0
        finally:
            self.stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.planner.close()
        if self.errors:
            raise BenchmarkError(self.errors[0])
        # Again with the operator stopped: a worker thread still building a plan at the
        # window's end made the first 1.7x slower (main at 3d54888, 539 µs against 295).
        self.anchor_s = min(self.anchor_s, anchor_cpu_s())
        self.adapter_s = await adapter_cpu_s(self.jobs)
        return Results(self, startup_s, window_start, window_end, cpu, calls)

    def inject(self, window_start: float) -> None:
        s = self.s
        r = s.report_s
        earliest = window_start + r
        latest = window_start + s.duration_s - (SLOW_FOR_R + RECOVERY_MARGIN_R) * r
        for job in self.rng.sample(self.jobs, min(s.stragglers, len(self.jobs))):
            onset = self.rng.uniform(earliest, latest)
            dp = self.rng.randrange(job.layout.dp)
            job.injection = Injection(dp_rank=dp, onset=onset, end=onset + SLOW_FOR_R * r)


class GcWatch:
    """Times the garbage collector's pauses (they stop the event loop too)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, int, float]] = []  # (when, generation, seconds)
        self._started = 0.0

    def __call__(self, phase: str, info: Mapping[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(
                (time.monotonic(), int(info["generation"]), time.perf_counter() - self._started)
            )

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self)


class DecidingEveryStep:
    """The same reads and writes, without the snapshots that let a step reuse the last one's
    decisions (``--decide-every-step``: the operator's behaviour is the same, its CPU that of
    a step deciding everything again)."""

    def __init__(self, io: JobIO) -> None:
        self._io = io

    def __getattr__(self, name: str) -> Any:
        return getattr(self._io, name)


class CountingInlinePlanner(InlinePlanner):
    """Solves in the event loop's thread, recording each solve's duration."""

    def __init__(self, solves: list[float]) -> None:
        self._solves = solves

    async def solve(self, request: PlanningInput) -> Frontier:
        started = time.monotonic()
        try:
            return await super().solve(request)
        finally:
            self._solves.append(time.monotonic() - started)


def anchor_cpu_s(repeats: int = 300) -> float:
    """CPU time (this thread) of one JSON round trip of :data:`ANCHOR_DOCUMENT`: the fixed
    unit the operator's CPU per step is compared with in the same run (the best of three
    rounds: the least disturbed by the machine)."""
    text = json.dumps(ANCHOR_DOCUMENT)
    best = math.inf
    for _ in range(3):
        c0 = time.thread_time()
        for _ in range(repeats):
            json.dumps(json.loads(text))
        best = min(best, (time.thread_time() - c0) / repeats)
    return best


async def adapter_cpu_s(jobs: Sequence[SimJob], rounds: int = 3, repeats: int = 20) -> float:
    """CPU time (this thread) of what ``perseus_operator.handlers._reconcile`` itself does
    around a quiet step's ``reconcile`` (the kopf adapter: the body's copy, the written status,
    the patch, the metrics), with ``reconcile`` replaced by one returning the job's last
    outcome, on the jobs' bodies as the window left them: the best of ``rounds`` rounds.

    :meth:`Simulation.handle` models that adapter; this runs the handlers module itself, of
    whichever tree is imported (``PYTHONPATH=<tree>/operator`` runs another's)."""
    import kopf

    from perseus_operator import handlers

    quiet = [j for j in jobs if j.last_outcome is not None and not j.last_outcome.events]
    if not quiet:
        return math.nan
    state = SimpleNamespace(jobs={}, kube=None, planner=None, metrics=OperatorMetrics())
    memo = {"perseus": state}
    indexes = {"perseus_pods": {}, "perseus_node_plans": {}, "perseus_workloads": {}}
    outcomes = {(j.namespace, j.name): j.last_outcome for j in quiet}

    async def last_outcome(body: Mapping[str, Any], *_: object, **__: object) -> Outcome:
        outcome = outcomes[(body["metadata"]["namespace"], body["metadata"]["name"])]
        assert outcome is not None
        return outcome

    bodies = [kopf.Body(json.loads(json.dumps(j.body))) for j in quiet]
    real = handlers.reconcile
    handlers.reconcile = last_outcome  # type: ignore[assignment]
    try:

        async def tick(body: kopf.Body) -> None:
            await handlers._reconcile(body, kopf.Patch(), memo, handlers._indexes(indexes))

        for body in bodies:  # the first tick has no written status yet
            await tick(body)
        best = math.inf
        for _ in range(rounds):
            c0 = time.thread_time()
            for _ in range(repeats):
                for body in bodies:
                    await tick(body)
            best = min(best, (time.thread_time() - c0) / (repeats * len(bodies)))
    finally:
        handlers.reconcile = real  # type: ignore[assignment]
    return best


def rfc3339_now() -> str:
    """As the agents write ``reportedAt``: to the millisecond."""
    return datetime.now(tz=UTC).isoformat(timespec="milliseconds")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------- results


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (with 20 values, p99 is the largest)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


@dataclass
class Reaction:
    job: str
    dp_rank: int
    retarget_r: float | None
    slow_reports: int | None
    recovery_r: float | None
    extra_writes: int


class Results:
    def __init__(
        self,
        sim: Simulation,
        startup_s: float,
        start: float,
        end: float,
        cpu_s: float,
        api_calls: int,
    ) -> None:
        self.sim = sim
        self.startup_s = startup_s
        self.start, self.end = start, end
        self.cpu_s = cpu_s
        self.api_calls = api_calls
        self.gc_pauses = [p for p in sim.gc.pauses if start <= p[0] < end]
        self.ticks = [t for t in sim.ticks if start <= t.start < end]
        self.reports = [r for r in sim.reports if start <= r[0] < end]
        self.reactions = [self.reaction(j) for j in sim.jobs if j.injection is not None]
        self.false_positives = self.count_false_positives()
        self.nominal_cpu = math.nan

    def reaction(self, job: SimJob) -> Reaction:
        i = job.injection
        assert i is not None
        r = self.sim.s.report_s
        writes = self.sim.cluster.writes.get((job.namespace, job.name), [])
        retarget_r = recovery_r = None
        slow_reports = None
        written = None
        if i.first_slow_report is not None:
            written = next(
                (w.t for w in writes if w.t >= i.first_slow_report and w.retargeted), None
            )
        if written is not None and i.first_slow_report is not None:
            retarget_r = (written - i.first_slow_report) / r
            slow_reports = sum(t <= written for t in i.slow_reports[i.first_slow_node])
            # Recovery shows once every node of the replica has reported normal times again.
            if i.recovered_report and set(i.recovered_report) == set(i.slow_reports):
                complete = max(i.recovered_report.values())
                back = next((w.t for w in writes if w.t >= complete and not w.retargeted), None)
                if back is not None:
                    recovery_r = (back - complete) / r
        episode = [w for w in writes if i.onset <= w.t < self.end]
        return Reaction(
            job=f"{job.namespace}/{job.name}",
            dp_rank=i.dp_rank,
            retarget_r=retarget_r,
            slow_reports=slow_reports,
            recovery_r=recovery_r,
            extra_writes=max(0, len(episode) - 2),
        )

    def count_false_positives(self) -> list[str]:
        """Jobs re-targeted while no injected straggler was showing."""
        out = []
        for job in self.sim.jobs:
            i = job.injection
            for w in self.sim.cluster.writes.get((job.namespace, job.name), ()):
                if not w.retargeted:
                    continue
                if i is None or i.first_slow_report is None or w.t < i.first_slow_report:
                    out.append(f"{job.namespace}/{job.name}")
                    break
        return out


# --------------------------------------------------------------------------- report


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def distribution(values: Sequence[float], scale: float = 1.0) -> list[float]:
    return [
        percentile(values, 0.50) * scale,
        percentile(values, 0.99) * scale,
        max(values, default=math.nan) * scale,
    ]


def report(results: Results) -> bool:
    sim, s = results.sim, results.sim.s
    window = results.end - results.start
    scale = PRODUCTION_REPORT_S / s.report_s
    ticks = results.ticks
    print(
        f"\n== Reconcile: {len(ticks):,} timer ticks of {s.jobs} jobs in a {window:.0f} s window "
        f"({len(ticks) / window:.0f}/s)"
    )
    writing = [t for t in ticks if t.wrote]
    rows = [
        ["reconcile(), ms", *distribution([t.reconcile_s for t in ticks], 1e3)],
        ["  of which writing plans, ms", *distribution([t.reconcile_s for t in writing], 1e3)],
        [
            "handler step (copy, reconcile, patch, metrics), ms",
            *distribution([t.handler_s for t in ticks], 1e3),
        ],
        [
            "  wall, with waiting for the loop, ms",
            *distribution([t.handler_wall_s for t in ticks], 1e3),
        ],
        ["timer lateness, ms", *distribution([t.late_s for t in ticks], 1e3)],
        ["agent report lateness, ms", *distribution([r[1] for r in results.reports], 1e3)],
    ]
    print(table(["", "p50", "p99", "max"], rows))
    p99_reconcile = percentile([t.reconcile_s for t in ticks], 0.99)
    print(
        f"reconcile p99 / reconcile interval: {p99_reconcile / s.reconcile_s:.2%}; "
        f"plan-writing ticks: {len(writing)}"
    )

    reactions = results.reactions
    retarget = [r.retarget_r for r in reactions if r.retarget_r is not None]
    recovery = [r.recovery_r for r in reactions if r.recovery_r is not None]
    missed = [r.job for r in reactions if r.retarget_r is None]
    print(
        f"\n== Stragglers: {len(reactions)} injected ({s.slowdown:g}x, one replica, "
        f"{SLOW_FOR_R:g} report intervals); persistenceReports {PERSISTENCE_REPORTS}, "
        "warmupIterations 0"
    )
    print(
        f"By design detection needs {PERSISTENCE_REPORTS} slow report rounds: a floor of about "
        f"{PERSISTENCE_REPORTS - 1} report interval(s) plus the wait for the job's next reconcile."
    )
    rows = [
        ["onset -> re-targeted plans written, R", *distribution(retarget)],
        ["  same, seconds at the production 10 s interval", *distribution(retarget, 10.0)],
        ["recovery complete -> T_min plans written, R", *distribution(recovery)],
    ]
    print(table(["", "p50", "p99", "max"], rows))
    seen: dict[int, int] = {}
    for r in reactions:
        if r.slow_reports is not None:
            seen[r.slow_reports] = seen.get(r.slow_reports, 0) + 1
    listed = ", ".join(f"{n}: {count} jobs" for n, count in sorted(seen.items()))
    print(
        f"slow reports written by the first node to show the slowdown, up to the re-target: "
        f"{listed or '-'}"
    )
    early = sum(count for n, count in seen.items() if n < PERSISTENCE_REPORTS)
    if early:
        print(
            f"{early} of {len(retarget)} re-targets came before that node's report number "
            f"{PERSISTENCE_REPORTS}: a replica on several nodes gets a new report whenever one\n"
            "of its nodes writes one, and each counts toward the persistence."
        )
    print(
        f"re-targeted: {len(retarget)} of {len(reactions)}; recovered: {len(recovery)}; "
        f"missed: {', '.join(missed) or 'none'}"
    )
    print(
        f"false positives (re-targeted with no straggler showing): "
        f"{len(results.false_positives)} {', '.join(results.false_positives)}".rstrip()
    )
    print(f"extra plan rewrites during the episodes: {sum(r.extra_writes for r in reactions)}")

    busy = sum(t.handler_s for t in ticks) / window
    pauses = results.gc_pauses
    pipelines = {(j.layout.pp, j.layout.microbatches) for j in sim.jobs}
    reports = len(results.reports)
    agents_s = sum(r[2] for r in results.reports)
    usage_self = resource.getrusage(resource.RUSAGE_SELF)
    usage_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print("\n== Load (information)")
    rows = [
        ["node reports / s", reports / window],
        [
            f"  status writes / s (cadence: {s.cadence})",
            sum(r[3] for r in results.reports) / window,
        ],
        ["process CPU, % of one core", 100 * results.cpu_s / window],
        ["process CPU per node report (agents + operator), µs", 1e6 * results.cpu_s / reports],
        ["  simulated agent's own share (wall time of the write), µs", 1e6 * agents_s / reports],
        ["operator handler steps (work), % of one core", 100 * busy],
        [f"  same at the production cadence (/{scale:g})", 100 * busy / scale],
        ["API calls / s (served in memory here)", results.api_calls / window],
        *(
            [f"  {method} / s", count / window]
            for method, count in sorted(sim.calls_by.items(), key=lambda kv: -kv[1])
        ),
        ["node plan watch events / s (into the index; no API call)", sim.watch_events / window],
        ["  status patches, % of ticks", 100 * sum(t.status_patched for t in ticks) / len(ticks)],
        [
            "  straggler-state annotation patches, % of ticks",
            100 * sum(t.annotation_patched for t in ticks) / len(ticks),
        ],
        ["  events (not posted) / s", sum(t.events for t in ticks) / window],
        [
            "GC pauses in the window: count, gen-2 count",
            f"{len(pauses)}, {sum(p[1] == 2 for p in pauses)}",
        ],
        ["  longest GC pause, ms", 1e3 * max((p[2] for p in pauses), default=0.0)],
        ["peak RSS of the process, MiB", usage_self.ru_maxrss / 1024],
        [
            "peak RSS of the planner worker, MiB",
            usage_children.ru_maxrss / 1024 if s.planner == "pool" else math.nan,
        ],
        ["start-up: all jobs Running, plans applied, s", results.startup_s],
        [
            "frontiers solved / distinct pipelines",
            f"{len(sim.solves)} / {len(pipelines)}",
        ],
        ["  longest solve (queueing included), s", max(sim.solves, default=math.nan)],
    ]
    print(table(["", "value"], rows))

    # CPU time per unit of work, which a loaded machine inflates far less than wall times, and
    # what the operator would need at the nominal cadence (every timer on time).
    quiet = [t.handler_cpu_s for t in ticks if not t.wrote]
    tick_cpu_s = sum(quiet) / len(quiet) if quiet else math.nan
    event_cpu_s = sim.watch_cpu_s / sim.watch_events if sim.watch_events else 0.0
    written = sum(r[3] for r in results.reports) / reports if reports else math.nan
    nodes = s.jobs * s.nodes_per_job
    nominal_events = written * nodes / s.report_s
    nominal = tick_cpu_s * s.jobs / s.reconcile_s + event_cpu_s * nominal_events
    print("\n== Operator CPU per unit of work (thread CPU time; information)")
    rows = [
        ["handler step without plan writes, mean, µs", 1e6 * tick_cpu_s],
        ["  p50, µs", 1e6 * percentile(quiet, 0.5)],
        ["watch event (parse + file in the index), µs", 1e6 * event_cpu_s],
        ["anchor (JSON round trip of a fixed 11 KiB document), µs", 1e6 * sim.anchor_s],
        ["handler step without plan writes, anchors", tick_cpu_s / sim.anchor_s],
        ["handlers.py adapter of a quiet step (reconcile stubbed), µs", 1e6 * sim.adapter_s],
        ["  same, anchors", sim.adapter_s / sim.anchor_s],
        ["watch event, anchors", event_cpu_s / sim.anchor_s],
        ["reports written (of those made)", written],
        [
            f"needed at the nominal cadence ({s.jobs / s.reconcile_s:.0f} steps/s, "
            f"{nominal_events:.0f} events/s), % of one core",
            100 * nominal,
        ],
    ]
    print(table(["", "value"], rows))
    results.nominal_cpu = nominal

    p99 = percentile(retarget, 0.99) if len(retarget) == len(reactions) else math.inf
    # The same reaction counted in the agents' reports (they share the loop with the
    # operator, so a loaded machine delays both, though not quite alike).
    counted = [r.slow_reports for r in reactions if r.slow_reports is not None]
    most_reports = max(counted, default=0)
    late_p50 = percentile([t.late_s for t in ticks], 0.5)
    late_p99 = percentile([t.late_s for t in ticks], 0.99)
    starved = (
        late_p50 > STARVED_LATENESS_R * s.report_s or late_p99 > STARVED_LATENESS_P99_R * s.report_s
    )
    reaction_ok: bool | None = p99 < TARGET_REACTION_R
    reports_ok: bool | None = (
        bool(reactions)
        and len(counted) == len(reactions)
        and most_reports <= PERSISTENCE_REPORTS + 2
    )
    if s.ci and starved:  # not judged: the machine, not the operator, was slow
        reaction_ok = reaction_ok or None
        reports_ok = reports_ok or (None if len(counted) == len(reactions) else False)
    checks = [
        (
            f"straggler reaction p99 < {TARGET_REACTION_R:g} report intervals",
            f"{p99:.2f} R",
            reaction_ok,
        ),
        (
            f"re-targeted by the first slow node's report {PERSISTENCE_REPORTS + 2}",
            f"{most_reports} reports" if counted else "-",
            reports_ok,
        ),
        (
            "every injected straggler re-targeted",
            f"{len(retarget)}/{len(reactions)}",
            not missed and bool(reactions),
        ),
        ("no false positive", str(len(results.false_positives)), not results.false_positives),
    ]
    if s.ci:  # CPU per step, against the anchor of the same run: holds on a loaded machine
        anchors = tick_cpu_s / sim.anchor_s
        checks.append(
            (
                f"handler step CPU < {STEP_OVER_ANCHOR_MAX:g} anchors",
                f"{anchors:.1f}",
                anchors < STEP_OVER_ANCHOR_MAX,
            )
        )
    print("\n== Target")
    print(
        table(
            ["check", "measured", "result"],
            [[c, m, RESULT[ok]] for c, m, ok in checks],
        )
    )
    if reaction_ok is None or reports_ok is None:
        print(
            f"The reaction was not judged: timers ran {late_p50 * 1e3:.0f} ms late at the median "
            f"and {late_p99 * 1e3:.0f} ms at the p99 (over {STARVED_LATENESS_R:g} or "
            f"{STARVED_LATENESS_P99_R:g} R): the process did not get its CPU "
            f"({100 * results.cpu_s / window:.0f} % of one core; load average "
            f"{os.getloadavg()[0]:.1f})."
        )
    return all(ok is not False for _, _, ok in checks)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes-per-job", type=int, default=5)
    parser.add_argument(
        "--report-interval-s",
        type=float,
        default=1.0,
        help="agent report interval (production: 10 s); default 1 s, time scaled 10x",
    )
    parser.add_argument(
        "--reconcile-interval-s",
        type=float,
        default=0.5,
        help="operator timer interval (production: 5 s); default 0.5 s",
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="measured window after start-up (default 90 report intervals)",
    )
    parser.add_argument("--stragglers", type=int, default=20)
    parser.add_argument("--slowdown", type=float, default=1.2)
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.005,
        help="relative noise on every reported iteration time",
    )
    parser.add_argument("--planner", choices=("pool", "inline"), default="pool")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cadence",
        choices=("dead-band", "every"),
        default="dead-band",
        help="agents write a report only when it says something new, plus a heartbeat "
        "(dead-band, as the agent does), or every report (every, as agents did before)",
    )
    parser.add_argument(
        "--heartbeat-r",
        type=float,
        default=3.0,
        help="dead-band cadence: report intervals between writes of an unchanged report",
    )
    parser.add_argument(
        "--dead-band", type=float, default=0.01, help="relative change of a mean written at once"
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        default="",
        help="cProfile the measured window (not the start-up) into FILE (pstats format)",
    )
    parser.add_argument(
        "--decide-every-step",
        action="store_true",
        help="every step decides everything again (no quiet steps): the same decisions, for "
        "comparing the CPU and timing in one script",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 20 jobs, 4 stragglers, 14 report intervals",
    )
    parser.add_argument(
        "--ci",
        action="store_true",
        help="--quick for CI (make bench): the reaction is not judged when the machine "
        "starved the process (timers over 0.1 R late at the median or 0.25 R at the p99); "
        "missed stragglers, false positives and a handler step over 6 anchors of CPU "
        "(measured in the same run) always are",
    )
    args = parser.parse_args(argv)
    args.quick = args.quick or args.ci
    if args.quick:
        args.jobs, args.stragglers = min(args.jobs, 20), min(args.stragglers, 4)
    report_s = args.report_interval_s
    duration = args.duration_s
    if duration is None:
        duration = (14 if args.quick else 90) * report_s
    shortest = (1 + SLOW_FOR_R + RECOVERY_MARGIN_R + 1) * report_s
    if duration < shortest:
        parser.error(f"--duration-s must be at least {shortest:g} s (13 report intervals)")
    if min(args.jobs, args.nodes_per_job, args.stragglers) < 1:
        parser.error("--jobs, --nodes-per-job and --stragglers must be >= 1")
    if not (report_s > 0 and args.reconcile_interval_s > 0 and args.slowdown > 1.05):
        parser.error("intervals must be > 0 and --slowdown above the 1.05 threshold")
    return Settings(
        jobs=args.jobs,
        nodes_per_job=args.nodes_per_job,
        report_s=report_s,
        reconcile_s=args.reconcile_interval_s,
        duration_s=duration,
        stragglers=args.stragglers,
        slowdown=args.slowdown,
        jitter=args.jitter,
        planner=args.planner,
        seed=args.seed,
        cadence=args.cadence,
        heartbeat_r=args.heartbeat_r,
        dead_band=args.dead_band,
        profile=args.profile,
        decide_every_step=args.decide_every_step,
        ci=args.ci,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    s = settings
    cadence = s.cadence
    if cadence == "dead-band":
        cadence += f" {s.dead_band:g}, heartbeat {s.heartbeat_r:g} R"
    print(
        f"perseus operator at scale: {s.jobs} jobs on {s.jobs * s.nodes_per_job:,} nodes "
        f"({s.nodes_per_job} per job); agents report every {s.report_s:g} s, operator "
        f"reconciles every {s.reconcile_s:g} s (production {PRODUCTION_REPORT_S:g} s / "
        f"{PRODUCTION_RECONCILE_S:g} s); planner {s.planner}; window {s.duration_s:g} s; "
        f"reports written: {cadence}; seed {s.seed}; Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs"
    )
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            results = asyncio.run(Simulation(settings).run(stack))
    except BenchmarkError as exc:
        print(f"\noperator_scale: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\noperator_scale: interrupted", file=sys.stderr)
        return 130
    ok = report(results)
    print(f"\ntotal time {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
