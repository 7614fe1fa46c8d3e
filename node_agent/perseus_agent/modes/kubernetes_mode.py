"""Kubernetes mode of the node agent (the default): this node's PerseusNodePlans.

The plans are read and reported through the API (:mod:`perseus_agent.kube`) with the pod's
service account (or ``--kubeconfig``) and applied by
:class:`~perseus_agent.plans.job_plans.JobPlans`, one applier per plan object. The API events
arrive on the source's thread and are handled one at a time on the agent loop, with every status
reported after every change and every ``--report-interval`` seconds (and written when it says
something new, or as a heartbeat: :mod:`perseus_agent.kube.report_cadence`); the GPUs are let go
while the node's GPU driver is upgraded (:mod:`perseus_agent.modes.driver_release`). An API
that cannot be reached is retried (with backoff) while the agent keeps running; only a
configuration that cannot be loaded at all is fatal.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

from perseus_agent.clocks.clock_owners import ClockOwnerGuard
from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.errors import AgentError
from perseus_agent.exporter import AgentMetrics
from perseus_agent.gpu.releasable import ReleasableBackend
from perseus_agent.kube import (
    KubeConfigError,
    ObjectKey,
    core_v1_api,
    custom_objects_api,
    load_api_client,
)
from perseus_agent.kube.node import NodeLabelSource
from perseus_agent.kube.plan_source import NodePlanSource
from perseus_agent.kube.pod_watch import NodePodWatch
from perseus_agent.kube.report_cadence import ReportCadence
from perseus_agent.kube.report_writer import ReportWriter
from perseus_agent.metrics_server import Health
from perseus_agent.modes.agent_config import Config, StartupError
from perseus_agent.modes.agent_lifecycle import Server
from perseus_agent.modes.driver_release import DriverUpgradeGate
from perseus_agent.modes.driver_upgrade import UPGRADE_STATE_LABEL
from perseus_agent.ownership.gpu_ownership import (
    KubeletOwnership,
    LocalRankIndexOwnership,
    Ownership,
)
from perseus_agent.ownership.node_pods import NodePods
from perseus_agent.ownership.pod_resources import PodResourcesClient
from perseus_agent.plans.job_plans import JobPlans
from perseus_agent.plans.plan_status import invalid_status, stopped_status
from perseus_agent.serving.tcp_server import TcpServer
from perseus_api.node_plan import NodePlan

__all__ = ["KubernetesMode", "KubernetesRunner", "choose_ownership"]

log = logging.getLogger("perseus_agent")

STOP_REPORT_TIMEOUT_S: Final = 3.0  # writing "stopped" statuses must fit the grace period
OWNERSHIP_REFRESH_S: Final = 5.0
"""How often at most the kubelet is asked again which GPUs the pods own (besides at every
plan change): how soon a pod that starts after its plan is managed."""
EVENT_POLL_S: Final = 2.0
"""How often the loop checks for a stop request between events (CPU vs. stop latency; plan
events are handled at once)."""


@dataclass(frozen=True)
class _PlanEvent:
    """What the plan source (or the node, or the report writer) saw, for the agent loop."""

    kind: str  # "plan", "delete", "invalid" or "driver"
    key: ObjectKey  # namespace, name of the object
    plan: NodePlan | None = None
    message: str = ""
    revision: int | None = None


class KubernetesMode:
    """The Kubernetes API client, loaded before the agent starts (:meth:`connect`)."""

    def __init__(self, config: Config, api_client: Any) -> None:
        self._config = config
        self._api_client = api_client

    @classmethod
    def connect(cls, config: Config) -> KubernetesMode:
        """Load the client configuration (nothing is requested from the API); one that cannot
        be loaded is fatal (StartupError)."""
        try:
            return cls(config, load_api_client(config.kubeconfig))
        except KubeConfigError as exc:
            raise StartupError(str(exc)) from None

    def open(
        self, gpus: ReleasableBackend, guard: ClockOwnerGuard, reset_state: ResetState
    ) -> KubernetesRunner:
        config = self._config
        events: queue.Queue[_PlanEvent] = queue.Queue()

        def gone(namespace: str, name: str) -> None:
            """The report writer found the plan object deleted: handle it as a deletion."""
            events.put(_PlanEvent("delete", (namespace, name)))

        metrics = AgentMetrics(config.node_name)
        # Who a connection comes from, as the API server says now (a watch, never a request on
        # a connection's path): a TCP peer's address, a Unix peer's cgroup pod UID.
        pods = NodePods(config.node_name)
        watch = NodePodWatch(
            core_v1_api(self._api_client), config.node_name, pods.listed, pods.changed, pods.lost
        )
        watch.start()
        ownership = choose_ownership(config, pods)
        jobs = JobPlans(guard, reset_state, config.node_name, metrics, ownership)
        # Lives until the shutdown has reset the clocks, to report that.
        writer = ReportWriter(
            custom_objects_api(self._api_client),
            on_gone=gone,
            cadence=ReportCadence.every(config.report_interval_s),
        )
        writer.start()
        return KubernetesRunner(
            config, self._api_client, gpus, guard, jobs, writer, events, pods, watch
        )

    def close(self) -> None:
        close = getattr(self._api_client, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                log.debug("error while closing the Kubernetes client", exc_info=True)


class KubernetesRunner:
    """Applies and reports this node's PerseusNodePlans."""

    def __init__(
        self,
        config: Config,
        api_client: Any,
        gpus: ReleasableBackend,
        guard: ClockOwnerGuard,
        jobs: JobPlans,
        writer: ReportWriter,
        events: queue.Queue[_PlanEvent],
        pods: NodePods,
        pod_watch: NodePodWatch,
    ) -> None:
        self._config = config
        self._api_client = api_client
        self._gpus = gpus
        self._guard = guard
        self._jobs = jobs
        self._writer = writer
        self._events = events
        self._pods = pods
        self._pod_watch = pod_watch
        self._invalid: dict[ObjectKey, dict[str, Any]] = {}  # statuses of invalid objects
        self._revisions: dict[ObjectKey, int | None] = {}  # at the shutdown

    @property
    def plans(self) -> JobPlans:
        return self._jobs

    def start_servers(self) -> list[Server]:
        if self._config.tcp_address is None:
            return []
        host, port = self._config.tcp_address
        server = TcpServer(host, port, self._jobs, self._pods.resolve, self._pods.holds)
        try:
            server.start()
        except AgentError as exc:
            raise StartupError(str(exc)) from None
        log.info("serving training processes on %s too", server.url)
        return [server]

    def run(self, stop: threading.Event, health: Health) -> None:
        """Apply and report this node's PerseusNodePlans until ``stop`` is set."""
        config, jobs, writer, events = self._config, self._jobs, self._writer, self._events
        api = custom_objects_api(self._api_client)
        gate = DriverUpgradeGate(jobs, self._gpus, self._guard, jobs.metrics)

        def on_upgrade_state(state: str | None) -> None:
            events.put(_PlanEvent("driver", ("", ""), message=state or ""))

        node = NodeLabelSource(
            core_v1_api(self._api_client),
            config.node_name,
            UPGRADE_STATE_LABEL,
            on_upgrade_state,
            interval_s=config.node_poll_interval_s,
        )

        def on_plan(namespace: str, name: str, plan: NodePlan) -> None:
            events.put(_PlanEvent("plan", (namespace, name), plan=plan))

        def on_delete(namespace: str, name: str) -> None:
            events.put(_PlanEvent("delete", (namespace, name)))

        def on_invalid(namespace: str, name: str, message: str, revision: int | None) -> None:
            events.put(_PlanEvent("invalid", (namespace, name), message=message, revision=revision))

        source = NodePlanSource(api, config.node_name, on_plan, on_delete, on_invalid)
        log.info(
            "node %s: %d GPU(s) via %s; watching PerseusNodePlans labelled %s in all namespaces",
            config.node_name,
            len(jobs.devices),
            config.backend,
            source.selector,
        )
        source.start()
        node.start()
        interval_s = config.report_interval_s
        next_report = time.monotonic() + interval_s
        next_ownership = time.monotonic() + OWNERSHIP_REFRESH_S
        try:
            while not stop.is_set():
                health.beat()
                wait_s = min(EVENT_POLL_S, max(0.0, next_report - time.monotonic()))
                try:
                    event: _PlanEvent | None = events.get(timeout=wait_s)
                except queue.Empty:
                    event = None
                if stop.is_set():
                    break
                if event is not None:
                    try:
                        self._on_plan_event(event, gate)
                    except Exception:  # never crash on a plan
                        log.exception("error while handling plan object %s/%s", *event.key)
                if time.monotonic() >= next_report:
                    next_report = time.monotonic() + interval_s
                    if time.monotonic() >= next_ownership:  # pods started, restarted, ended
                        next_ownership = time.monotonic() + OWNERSHIP_REFRESH_S
                        jobs.refresh_ownership()
                    for key in jobs.objects():
                        self._submit_status(key)
                    for key, status in self._invalid.items():
                        writer.submit(*key, status)
                    for key in gate.retry():  # a driver upgrade over, NVML not back yet
                        self._submit_status(key)
        finally:
            node.stop()
            source.stop()

    def stopping(self) -> None:
        for key in self._jobs.objects():
            report = self._jobs.report(key)
            self._revisions[key] = None if report is None else report.revision

    def stopped(self, reset_ok: bool) -> None:
        self._pod_watch.stop()
        for key, revision in self._revisions.items():
            self._writer.submit(*key, stopped_status(revision, reset_ok=reset_ok))
        self._writer.stop(timeout_s=STOP_REPORT_TIMEOUT_S)

    def _on_plan_event(self, event: _PlanEvent, gate: DriverUpgradeGate) -> None:
        jobs, writer, key = self._jobs, self._writer, event.key
        if gate.handle(event.kind, key, event.plan, event.message, writer):
            return
        self._invalid.pop(key, None)
        if event.kind == "plan":
            assert event.plan is not None
            changed = jobs.set_plan(key, event.plan)
        elif event.kind == "delete":
            log.info("plan object %s/%s is gone; resetting its GPUs", *key)
            writer.forget(*key)
            changed = jobs.remove(key)
        else:
            jobs.metrics.count_error("invalid_plan")
            changed = jobs.remove(key)  # its previous version's clocks, if any
            self._invalid[key] = invalid_status(event.message, event.revision)
            writer.submit(*key, self._invalid[key])
        for other in changed:
            self._submit_status(other)

    def _submit_status(self, key: ObjectKey) -> None:
        status = self._jobs.status(key)
        if status is not None:
            self._writer.submit(*key, status)


def choose_ownership(config: Config, pods: NodePods | None = None) -> Ownership:
    """Who tells which GPUs a plan's pods own (``--gpu-ownership``); ``pods``: the node's pods
    as the API server says (which pod a cgroup's UID is)."""
    if config.gpu_ownership == "local-rank-index":
        log.warning(
            "--gpu-ownership=local-rank-index: a pod's local rank r is taken to run on GPU "
            "index r, without asking the kubelet; only for clusters without one"
        )
        return LocalRankIndexOwnership()
    socket = config.pod_resources_socket
    if not socket.exists():
        log.error(
            "the kubelet's PodResources socket %s does not exist: no GPU will be managed until "
            "it does (mount /var/lib/kubelet/pod-resources, or pass "
            "--gpu-ownership=local-rank-index on a cluster without a kubelet)",
            socket,
        )
    return KubeletOwnership(PodResourcesClient(str(socket)), pods=pods)
