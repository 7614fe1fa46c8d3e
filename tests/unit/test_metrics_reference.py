"""docs/reference/metrics.md is what ``scripts/metrics_reference.py`` generates from the
metrics the agent and the operator register, and lists every ``perseus_*`` metric the source
defines anywhere (a metric added in another module fails here until the script knows it)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
DEFINERS = {
    "Gauge",
    "Counter",
    "Histogram",
    "Summary",
    "Info",
    "Enum",
    "Metric",
    "GaugeMetricFamily",
    "CounterMetricFamily",
    "HistogramMetricFamily",
}


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "metrics_reference", REPO / "scripts" / "metrics_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("metrics_reference", module)
    spec.loader.exec_module(module)
    return module


def defined_metrics(source: str) -> Iterator[str]:
    """Names of the ``perseus_*`` metrics a module's source defines (a Gauge, Counter, ...,
    or a collector's Metric whose first argument is a literal name)."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0]
        if (
            called in DEFINERS
            and isinstance(first, ast.Constant)
            and isinstance(first.value, str)
            and first.value.startswith("perseus_")
        ):
            yield first.value


def test_the_reference_page_is_current() -> None:
    script = _script()
    committed = (REPO / script.DEFAULT_OUT).read_text(encoding="utf-8")
    assert committed == script.page(), (
        "docs/reference/metrics.md is stale: python scripts/metrics_reference.py"
    )


def test_every_metric_the_source_defines_is_on_the_page() -> None:
    listed = {doc.name for doc in (*_script().agent_docs(), *_script().operator_docs())}
    defined = {
        name
        for root in ("operator", "node_agent")
        for path in sorted((REPO / root).rglob("*.py"))
        for name in defined_metrics(path.read_text(encoding="utf-8"))
    }
    assert len(defined) >= 20
    missing = {n for n in defined if n not in listed and f"{n}_total" not in listed}
    assert not missing, f"defined but not in scripts/metrics_reference.py: {sorted(missing)}"


def test_a_metric_defined_elsewhere_is_found() -> None:
    source = (
        "from prometheus_client import Counter\n"
        "import prometheus_client\n"
        "A = Counter('perseus_new_things', 'New things.', ['node'])\n"
        "B = prometheus_client.Gauge('perseus_other', 'x')\n"
        "C = Counter('unrelated_total', 'y')\n"
    )
    assert list(defined_metrics(source)) == ["perseus_new_things", "perseus_other"]


def test_the_page_names_types_labels_and_units() -> None:
    docs = {d.name: d for d in (*_script().agent_docs(), *_script().operator_docs())}
    energy = docs["perseus_gpu_energy_joules_total"]
    assert (energy.kind, energy.unit) == ("counter", "joules")
    assert energy.labels == ("node", "gpu", "uuid")
    assert set(energy.some_labels) == {
        "job_namespace",
        "job_name",
        "pod_name",
        "dp_rank",
        "pp_rank",
    }
    saved = docs["perseus_job_energy_saved_joules_total"]
    assert (saved.kind, saved.labels, saved.unit) == (
        "counter",
        ("job_namespace", "job_name"),
        "joules",
    )
    assert docs["perseus_planner_seconds"].buckets[-1] == float("inf")
    assert "perseus_agent_driver_upgrade_released" in docs
