"""Prometheus metrics of the node agent (:mod:`perseus_agent.metrics_server` serves them).

Everything lives on a dedicated :class:`~prometheus_client.CollectorRegistry` (never the global
one), so several agents can run in one process (tests) and nothing registers itself by import.

GPU readings (energy, power, clock) are taken *at scrape time* by :class:`GpuCollector`, so the
energy counter is the GPU's own cumulative counter and not a sum of samples. A GPU whose reading
fails is left out of that scrape and the failure is counted in
``perseus_agent_apply_errors_total{reason="read_<reason>"}``; a scrape never fails because of
one GPU. While the agent has released the GPUs for a driver upgrade, no GPU series is exported
(``perseus_agent_driver_upgrade_released`` is 1) and nothing is counted.

Labels: ``node``, ``gpu`` (index) and ``uuid`` on every GPU series, plus ``job_namespace``,
``job_name`` (the PerseusJob), ``pod_name``, ``dp_rank`` and ``pp_rank`` while the GPU follows a
plan. Never ``namespace``, ``job`` or ``pod``: Prometheus sets those on every target (the
agent's own pod, the scrape job), and a clash renames one side ``exported_*`` or needs
``honor_labels``, which overrides the target's (:data:`EXPORTED_NAMES`).

``perseus_gpu_clock_event_reasons`` has one series per GPU and NVML clock event ("throttle")
reason (label ``reason``, :data:`~perseus_agent.gpu.base.CLOCK_EVENT_REASONS`), 1 while that
reason holds the clock down: a Perseus lock (``user_defined_clocks`` with a target clock) can
then be told from a power cap or a thermal slowdown. ``perseus_gpu_foreign_clocks{kind}`` is 1
for a GPU whose clocks (``locked``, ``applications``) or power limit (``power_limit``) another owner
set (:mod:`perseus_agent.clocks.clock_owners`), 0 (no ``kind``) for the others.
``perseus_gpu_power_limit_watts`` is each GPU's power limit in force, whoever set it (a power
budget's backstop, an administrator, the default); GPUs without power limits have none.

Cardinality. Every label value comes from the node plan (what the operator assigned), never from
what a training process claims in its hello: whoever can reach the socket could otherwise grow
``/metrics`` and the agent's memory without bound. ``perseus_iteration_seconds`` has one series
per GPU of a plan (its ``rank`` label is the plan's), observed only for the process driving that
GPU, and the applier removes it when the GPU leaves the plan or the plan ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client import (
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from perseus_agent.clocks.clock_owners import ForeignClocks
from perseus_agent.errors import GpuError, GpuNotSupportedError, GpuReleasedError
from perseus_agent.gpu.base import CLOCK_EVENT_REASONS, GpuBackend, GpuInfo

__all__ = [
    "EXPORTED_NAMES",
    "ITERATION_BUCKETS_S",
    "ITERATION_LABELS",
    "KNOWN_ERROR_REASONS",
    "MANAGED_LABELS",
    "AgentMetrics",
    "GpuCollector",
    "ManagedGpu",
    "driver_upgrade_released_gauge",
    "exported_label",
]

log = logging.getLogger(__name__)

MANAGED_LABELS: Final = ("namespace", "job", "pod", "dp_rank", "pp_rank")
"""What the applier says about a GPU under a plan (:class:`ManagedGpu`), by these keys."""

EXPORTED_NAMES: Final = {"namespace": "job_namespace", "job": "job_name", "pod": "pod_name"}
"""The label each :data:`MANAGED_LABELS` key is exported as, where not itself."""


def exported_label(key: str) -> str:
    """The exported label name of a :data:`MANAGED_LABELS` key (others unchanged)."""
    return EXPORTED_NAMES.get(key, key)


ITERATION_LABELS: Final = (
    "node",
    "gpu",
    "uuid",
    *(exported_label(k) for k in MANAGED_LABELS),
    "rank",
)

ITERATION_BUCKETS_S: Final = (
    0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
    45.0, 60.0, 90.0, 120.0, 180.0, 300.0, float("inf"),
)  # fmt: skip

KNOWN_ERROR_REASONS: Final = (
    "invalid_plan",
    "unknown_gpu",
    "schedule_mismatch",
    "reset_state",
    "no_permission",
    "not_supported",
    "gpu_lost",
    "invalid_argument",
    "not_found",
    "gpu_error",
    "foreign_clocks",
    "foreign_power_limit",
)
"""Reasons exported at zero from the start, so alerts see the series before the first error."""

_MHZ_TO_HZ: Final = 1_000_000


@dataclass(frozen=True)
class ManagedGpu:
    """What the plan applier says about one GPU it manages."""

    labels: Mapping[str, str]
    """Values of (a subset of) :data:`MANAGED_LABELS`; empty values are left out."""
    target_mhz: int | None = None
    """The clock the plan asks for right now, if any."""


class AgentMetrics:
    """The agent's own metrics (the ones it counts rather than reads from the GPU).

    Args:
        node: Value of the ``node`` label.
        registry: Registry to put them on; a new dedicated one by default.
    """

    def __init__(
        self, node: str, registry: CollectorRegistry | None = None, version: str = ""
    ) -> None:
        self.node = node
        self.registry = registry if registry is not None else CollectorRegistry()
        # The process's own series (process_*, python_info), as every exporter serves them.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR):
            self.registry.register(collector)
        build = Gauge(
            "perseus_agent_build_info",
            "Always 1; the label names the agent's version.",
            ["version"],
            registry=self.registry,
        )
        build.labels(version or _version()).set(1)
        self.apply_errors = Counter(
            "perseus_agent_apply_errors",
            "Errors while applying plans or reading GPUs, by reason.",
            ["node", "reason"],
            registry=self.registry,
        )
        for reason in KNOWN_ERROR_REASONS:
            self.apply_errors.labels(node=node, reason=reason)
        self.iteration_seconds = Histogram(
            "perseus_iteration_seconds",
            "Training iteration time per rank (step begin to step end), in seconds.",
            list(ITERATION_LABELS),
            buckets=ITERATION_BUCKETS_S,
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._clock_changes: dict[int, int] = {}

    def count_error(self, reason: str) -> None:
        self.apply_errors.labels(node=self.node, reason=reason).inc()

    def error_count(self, reason: str) -> float:
        """Current value of ``perseus_agent_apply_errors_total{reason}`` (for tests and logs)."""
        for metric in self.apply_errors.collect():  # this counter only: no GPU is read
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels.get("reason") == reason:
                    return sample.value
        return 0.0

    def count_clock_change(self, index: int) -> None:
        with self._lock:
            self._clock_changes[index] = self._clock_changes.get(index, 0) + 1

    def clock_changes(self, index: int) -> int:
        with self._lock:
            return self._clock_changes.get(index, 0)

    def iteration_values(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        """The ``perseus_iteration_seconds`` label values of ``labels``, in
        :data:`ITERATION_LABELS` order (missing ones empty, ``node`` this node)."""
        values = dict.fromkeys(ITERATION_LABELS, "")
        for key, value in labels.items():
            if (name := exported_label(key)) in values:
                values[name] = value
        values["node"] = self.node
        return tuple(values[name] for name in ITERATION_LABELS)

    def observe_iteration(self, labels: Mapping[str, str], seconds: float) -> tuple[str, ...]:
        """Record one iteration; ``labels`` missing from :data:`ITERATION_LABELS` are empty.

        Returns the series' label values, for :meth:`remove_iteration`: every series stays
        until removed, so the caller removes those of ranks and plans that ended.
        """
        values = self.iteration_values(labels)
        self.iteration_seconds.labels(*values).observe(seconds)
        return values

    def remove_iteration(self, values: tuple[str, ...]) -> None:
        """Drop the series of label ``values`` (from :meth:`observe_iteration`), if any."""
        with contextlib.suppress(KeyError):
            self.iteration_seconds.remove(*values)


def driver_upgrade_released_gauge(metrics: AgentMetrics) -> Gauge:
    """``perseus_agent_driver_upgrade_released`` on ``metrics``' registry: only a Kubernetes
    mode agent, which follows the node's driver upgrades, registers it
    (:mod:`perseus_agent.modes.driver_release`)."""
    return Gauge(
        "perseus_agent_driver_upgrade_released",
        "1 while the agent has reset its clocks and released NVML for a GPU driver "
        "upgrade of the node (label nvidia.com/gpu-driver-upgrade-state), else 0.",
        ["node"],
        registry=metrics.registry,
    )


class GpuCollector(Collector):
    """Reads every GPU of ``backend`` at scrape time.

    Args:
        backend: The GPUs.
        devices: The GPUs to export (listed once by the caller).
        metrics: Where failed readings are counted, and the clock change counts.
        managed: Returns the GPUs under a plan, by index (called once per scrape).
        foreign: Returns the clocks other owners set, by GPU index (once per scrape).
        foreign_power: Returns the GPUs whose power limit another owner set (once per scrape).
    """

    def __init__(
        self,
        backend: GpuBackend,
        devices: Sequence[GpuInfo],
        metrics: AgentMetrics,
        managed: Callable[[], Mapping[int, ManagedGpu]],
        foreign: Callable[[], Mapping[int, ForeignClocks]] | None = None,
        foreign_power: Callable[[], Mapping[int, object]] | None = None,
    ) -> None:
        self._backend = backend
        self._devices = list(devices)
        self._metrics = metrics
        self._managed = managed
        self._foreign = foreign or dict
        self._foreign_power = foreign_power or dict
        self._no_reasons: set[int] = set()  # GPUs that cannot tell: not asked again
        self._no_power_limit: set[int] = set()  # GPUs without power limits: not asked again

    def describe(self) -> Iterable[Metric]:
        return []  # no GPU reads at registration time

    def collect(self) -> Iterable[Metric]:
        energy = Metric(
            "perseus_gpu_energy_joules",
            "Energy consumed by the GPU since an arbitrary origin, in joules.",
            "counter",
        )
        power = Metric("perseus_gpu_power_watts", "Current GPU power draw, in watts.", "gauge")
        clock = Metric("perseus_gpu_sm_clock_hertz", "Current GPU SM clock, in hertz.", "gauge")
        target = Metric(
            "perseus_gpu_target_sm_clock_hertz",
            "SM clock the frequency plan asks for, in hertz.",
            "gauge",
        )
        changes = Metric(
            "perseus_gpu_clock_changes",
            "SM clock changes made by this agent.",
            "counter",
        )
        reasons = Metric(
            "perseus_gpu_clock_event_reasons",
            "1 while this NVML clock event (throttle) reason holds the GPU's clock, else 0.",
            "gauge",
        )
        foreign_metric = Metric(
            "perseus_gpu_foreign_clocks",
            "1 for a GPU whose clocks or power limit another owner set (kind: locked, "
            "applications or power_limit), else 0.",
            "gauge",
        )
        limit = Metric(
            "perseus_gpu_power_limit_watts",
            "The GPU's power management limit in force (whoever set it), in watts.",
            "gauge",
        )
        try:
            managed = self._managed()
            foreign = self._foreign()
            foreign_power = self._foreign_power()
        except Exception:  # a scrape must never fail
            log.exception("cannot read the managed GPUs; exporting the GPUs as unmanaged")
            managed, foreign, foreign_power = {}, {}, {}
        node = self._metrics.node
        for gpu in self._devices:
            try:
                energy_j = self._backend.energy_j(gpu.index)
                power_w = self._backend.power_w(gpu.index)
                clock_mhz = self._backend.sm_clock_mhz(gpu.index)
            except GpuReleasedError:
                continue  # a driver upgrade: perseus_agent_driver_upgrade_released says so
            except GpuError as exc:
                log.warning("cannot read GPU %d (%s): %s", gpu.index, gpu.uuid, exc)
                self._metrics.count_error(f"read_{exc.reason}")
                continue
            except Exception:
                log.exception("cannot read GPU %d (%s)", gpu.index, gpu.uuid)
                self._metrics.count_error("read_error")
                continue
            labels = {"node": node, "gpu": str(gpu.index), "uuid": gpu.uuid}
            state = managed.get(gpu.index)
            if state is not None:
                labels.update(
                    {
                        exported_label(k): v
                        for k, v in state.labels.items()
                        if k in MANAGED_LABELS and v != ""
                    }
                )
            energy.add_sample("perseus_gpu_energy_joules_total", labels, energy_j)
            power.add_sample("perseus_gpu_power_watts", labels, power_w)
            clock.add_sample("perseus_gpu_sm_clock_hertz", labels, clock_mhz * _MHZ_TO_HZ)
            if state is not None and state.target_mhz is not None:
                target.add_sample(
                    "perseus_gpu_target_sm_clock_hertz", labels, state.target_mhz * _MHZ_TO_HZ
                )
            changes.add_sample(
                "perseus_gpu_clock_changes_total",
                labels,
                self._metrics.clock_changes(gpu.index),
            )
            bits = self._event_reasons(gpu)
            if bits is not None:
                for reason, bit in CLOCK_EVENT_REASONS.items():
                    reasons.add_sample(
                        reasons.name, {**labels, "reason": reason}, 1.0 if bits & bit else 0.0
                    )
            # Every GPU, 0 without (so that a query over it has data, as for ``up``).
            other = foreign.get(gpu.index)
            if other is not None:
                foreign_metric.add_sample(foreign_metric.name, {**labels, "kind": other.kind}, 1.0)
            if gpu.index in foreign_power:
                foreign_metric.add_sample(foreign_metric.name, {**labels, "kind": "power_limit"}, 1)
            if other is None and gpu.index not in foreign_power:
                foreign_metric.add_sample(foreign_metric.name, labels, 0.0)
            limit_w = self._power_limit_w(gpu)
            if limit_w is not None:
                limit.add_sample(limit.name, labels, limit_w)
        return [energy, power, clock, target, changes, reasons, foreign_metric, limit]

    def _power_limit_w(self, gpu: GpuInfo) -> float | None:
        if gpu.index in self._no_power_limit:
            return None
        try:
            return self._backend.power_limit_w(gpu.index)
        except GpuNotSupportedError:
            self._no_power_limit.add(gpu.index)
        except GpuError as exc:
            self._metrics.count_error(f"read_{exc.reason}")
        return None

    def _event_reasons(self, gpu: GpuInfo) -> int | None:
        if gpu.index in self._no_reasons:
            return None
        try:
            return self._backend.clock_event_reasons(gpu.index)
        except GpuNotSupportedError:
            self._no_reasons.add(gpu.index)
            log.info("GPU %d reports no clock event reasons; not exported", gpu.index)
        except GpuError as exc:
            self._metrics.count_error(f"read_{exc.reason}")
        return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("perseus-k8s")
    except PackageNotFoundError:
        return "unknown"
