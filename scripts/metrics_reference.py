"""The metrics reference page of the documentation, generated from the metrics themselves.

``python scripts/metrics_reference.py [--out FILE] [--check]`` (or ``make reference``) writes
(or checks) ``docs/reference/metrics.md``: every Prometheus metric the node agent and the
operator export, with its type, labels, unit and help text, read from the objects the
programs register (:class:`perseus_agent.exporter.AgentMetrics`, the agent's
:class:`~perseus_agent.exporter.GpuCollector` scraped on emulated GPUs, the driver upgrade
gauge; :class:`perseus_operator.metrics.ProcessMetrics` and
:class:`~perseus_operator.metrics.OperatorMetrics`). ``tests/unit/test_metrics_reference.py``
fails when the page is stale, and when the source defines a ``perseus_*`` metric this script
does not list (a metric added somewhere else: register it here too).

A script rather than a module of the product: the page needs both the agent and the operator,
which the import contracts keep apart.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

REPO = Path(__file__).resolve().parents[1]
for _root in ("operator", "node_agent"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.metrics import MetricWrapperBase  # noqa: E402
from prometheus_client.registry import Collector  # noqa: E402

from perseus_api.crd_reference import write_page  # noqa: E402

DEFAULT_OUT: Final = Path("docs/reference/metrics.md")

UNITS: Final = {
    "_joules": "joules",
    "_watts": "watts",
    "_hertz": "hertz",
    "_seconds": "seconds",
    "_ratio": "ratio",
    "_info": "",
}

_INTRO: Final = """# Metrics

Generated from the metric definitions by `python scripts/metrics_reference.py` (`make
reference`; do not edit by hand: `make test` fails when this page is stale or when the code
defines a metric it does not list). Base units, counters end in `_total`.

Both programs also serve prometheus_client's standard `process_*` (CPU, memory, open files)
and `python_info` series; the operator also `python_gc_*`. The chart's Grafana dashboards
and alerts use the metrics below ([Install](../operations/install.md),
[Alert runbooks](../operations/runbooks.md)).

Label names never clash with the labels Prometheus sets on every target: a PerseusJob is
`job_namespace` and `job_name`, a pod `pod_name` (never `namespace`, `job`, `pod`).
"""

_AGENT_INTRO: Final = """## Node agent

Served on `/metrics` of the agent (`--metrics-address`, `--metrics-port`; chart:
`agent.metricsAddress`, `agent.metricsPort`). The `perseus_gpu_*` series are read from the
GPU at scrape time, one per GPU (`node`, `gpu` index, `uuid`); while a GPU follows a plan
they also carry the PerseusJob and its ranks. A GPU whose reading fails is left out of that
scrape (and counted in `perseus_agent_apply_errors_total{reason="read_..."}`).
"""

_OPERATOR_INTRO: Final = """## Operator

Served on `/metrics` of every operator replica (chart: `operator.metricsPort`); the job, planner
and power budget series come from the replica that leads (`perseus_operator_leader` 1).
"""

PLAN_LABELS: Final = ("job_namespace", "job_name", "pod_name", "dp_rank", "pp_rank")
"""Labels of a GPU's series while it follows a plan."""


@dataclass(frozen=True)
class MetricDoc:
    """One metric as the page lists it."""

    name: str
    """As exposed (a counter's with ``_total``)."""
    kind: str
    labels: tuple[str, ...]
    """On every series."""
    some_labels: tuple[str, ...]
    """On some series only (a GPU under a plan; a reason)."""
    help: str
    buckets: tuple[float, ...] = ()

    @property
    def unit(self) -> str:
        for suffix, unit in UNITS.items():
            if self.name.removesuffix("_total").endswith(suffix):
                return unit
        return "count" if self.kind == "counter" else ""


def _exposed(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def _wrapper_doc(metric: MetricWrapperBase) -> MetricDoc:
    # prometheus_client keeps a metric's definition in these attributes (no public accessor).
    kind = str(getattr(metric, "_type"))  # noqa: B009
    buckets: tuple[float, ...] = ()
    if kind == "histogram":
        buckets = tuple(getattr(metric, "_upper_bounds"))  # noqa: B009
    return MetricDoc(
        name=_exposed(str(getattr(metric, "_name")), kind),  # noqa: B009
        kind=kind,
        labels=tuple(getattr(metric, "_labelnames")),  # noqa: B009
        some_labels=(),
        help=str(getattr(metric, "_documentation")),  # noqa: B009
        buckets=buckets,
    )


def _collected_docs(collector: Collector) -> list[MetricDoc]:
    """A custom collector's metrics, their labels from one scrape of it."""
    docs = []
    for family in collector.collect():
        keys = [frozenset(s.labels) for s in family.samples]
        every = frozenset.intersection(*keys) if keys else frozenset()
        some = frozenset.union(*keys) - every if keys else frozenset()
        first = [k for s in family.samples for k in s.labels]
        order = list(dict.fromkeys(first))
        docs.append(
            MetricDoc(
                name=_exposed(family.name, family.type),
                kind=family.type,
                labels=tuple(k for k in order if k in every),
                some_labels=tuple(k for k in order if k in some),
                help=family.documentation,
            )
        )
    return docs


def registry_docs(
    registry: CollectorRegistry, scraped: Iterable[Collector] = ()
) -> list[MetricDoc]:
    """The metrics of ``registry``'s own wrappers (Gauge, Counter, Histogram) and of the
    custom collectors ``scraped``; prometheus_client's standard collectors left out."""
    collectors: Sequence[Any] = list(getattr(registry, "_collector_to_names"))  # noqa: B009
    docs = [_wrapper_doc(c) for c in collectors if isinstance(c, MetricWrapperBase)]
    for collector in scraped:
        docs.extend(_collected_docs(collector))
    return sorted(docs, key=lambda d: d.name)


def agent_docs() -> list[MetricDoc]:
    """Every metric of a node agent: its own, and the GPU readings of three emulated GPUs (one
    under a plan, one with clocks an administrator locked, one idle)."""
    from perseus_agent.clocks.clock_owners import ForeignClocks
    from perseus_agent.exporter import (
        AgentMetrics,
        GpuCollector,
        ManagedGpu,
        driver_upgrade_released_gauge,
    )
    from perseus_agent.gpu.emulated import EmulatedBackend
    from perseus_planner.bundled import BUNDLED_PROFILES

    profile = next(iter(BUNDLED_PROFILES.values())).path
    backend = EmulatedBackend.from_csv(3, profile, blocking_power_w=80.0, node_name="node")
    try:
        metrics = AgentMetrics("node", version="docs")
        driver_upgrade_released_gauge(metrics)
        plan = {"namespace": "ml", "job": "j", "pod": "p", "dp_rank": "0", "pp_rank": "0"}
        collector = GpuCollector(
            backend,
            backend.devices(),
            metrics,
            lambda: {0: ManagedGpu(plan, target_mhz=1005)},
            foreign=lambda: {1: ForeignClocks("locked", 1200)},
        )
        return registry_docs(metrics.registry, [collector])
    finally:
        backend.close()


def operator_docs() -> list[MetricDoc]:
    from perseus_operator.metrics import OperatorMetrics, ProcessMetrics

    registry = CollectorRegistry()
    ProcessMetrics("docs", registry=registry)
    OperatorMetrics(registry=registry)
    return registry_docs(registry)


def _labels_cell(doc: MetricDoc) -> str:
    cell = ", ".join(f"`{k}`" for k in (*doc.labels, *(("le",) if doc.kind == "histogram" else ())))
    plan = [k for k in doc.some_labels if k in PLAN_LABELS]
    other = [k for k in doc.some_labels if k not in PLAN_LABELS]
    if plan:
        cell += "; under a plan also " + ", ".join(f"`{k}`" for k in plan)
    if other:
        cell += "; on some series " + ", ".join(f"`{k}`" for k in other)
    return cell or "(none)"


def _bound(value: float) -> str:
    return "+Inf" if math.isinf(value) else f"{value:g}"


def _table(docs: Sequence[MetricDoc]) -> str:
    rows = [
        "| Metric | Type | Labels | Unit | Meaning |",
        "|---|---|---|---|---|",
    ]
    for doc in docs:
        meaning = " ".join(doc.help.split()).replace("|", "\\|")
        if doc.buckets:
            meaning += " Buckets: " + ", ".join(_bound(b) for b in doc.buckets) + "."
        rows.append(
            f"| `{doc.name}` | {doc.kind} | {_labels_cell(doc)} | {doc.unit or '-'} | {meaning} |"
        )
    return "\n".join(rows) + "\n"


def page() -> str:
    """The whole page, as committed."""
    return "\n".join(
        [
            _INTRO,
            _AGENT_INTRO,
            _table(agent_docs()),
            _OPERATOR_INTRO,
            _table(operator_docs()),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=REPO / DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="fail if the page is stale")
    args = parser.parse_args(argv)
    return write_page(
        args.out, page(), check=args.check, regenerate="python scripts/metrics_reference.py"
    )


if __name__ == "__main__":
    sys.exit(main())
