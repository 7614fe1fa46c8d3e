"""Every query of the chart's Grafana dashboards, as Grafana would send it, against a real
Prometheus: the dashboards' queries and template variables, Grafana's interpolation of them, a
Prometheus (Debian package) scraping the components with the settings of the chart's
PodMonitors, and a client that tells which queries return no data.

Shared by the dashboards' end-to-end test and the real-cluster scenario. Typical use::

    with prometheus(workdir, scrape_jobs({"node-agent": ..., "operator": ...})) as prom:
        poll(lambda: missing_data(prom, time.time()), "the dashboards")
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support.helm_render import CHART, render
from support.prometheus_server import running_prometheus

SCRAPE_S = 1.0
RATE_INTERVAL = "5s"  # Grafana: max($__interval + scrape interval, 4 x scrape interval)
RANGE = "5m"  # the dashboard's time range; longer than the tests run
INTERVAL = "1s"  # Grafana's $__interval: one step per scrape
RANGE_WINDOW_S = 10.0  # range queries: the last seconds, one step per scrape
TIMEOUT_S = 40.0  # poll's default
DCGM_MARKER = "(dcgm-exporter)"  # in a legend or panel title: the query needs dcgm-exporter


# -- the dashboards ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One target of a dashboard panel."""

    dashboard: str  # the dashboard's uid (its file's stem)
    panel: str  # the panel's title
    ref: str  # the target's refId
    expr: str  # PromQL, before Grafana's interpolation
    instant: bool
    needs_dcgm: bool  # declared so by its legend or panel title

    @property
    def name(self) -> str:
        """``dashboard / panel / refId``."""
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def load_dashboards() -> dict[str, dict[str, Any]]:
    """The chart's dashboards (``helm/perseus/dashboards/*.json``) by uid (the file's stem)."""
    return {
        p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))
    }


def chart_dashboards(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The dashboards as the chart renders them with ``values`` (its ConfigMaps), by uid."""
    dashboards = {}
    for config_map in render(values).of_kind("ConfigMap"):
        ((name, text),) = config_map["data"].items()
        if name.endswith(".json"):
            dashboards[name.removesuffix(".json")] = json.loads(text)
    return dashboards


def dashboard_queries(dashboards: Mapping[str, Mapping[str, Any]]) -> list[Query]:
    """Every target of every panel (rows' nested panels included) of ``dashboards``."""
    queries = []
    for uid, dash in dashboards.items():
        panels = [p for top in dash["panels"] for p in (top, *top.get("panels", []))]
        for panel in panels:
            for target in panel.get("targets", []):
                needs = (
                    DCGM_MARKER in target.get("legendFormat", "") or DCGM_MARKER in panel["title"]
                )
                queries.append(
                    Query(
                        uid,
                        panel["title"],
                        target["refId"],
                        target["expr"],
                        target["instant"],
                        needs,
                    )
                )
    return queries


def substitute(
    expr: str,
    variables: Mapping[str, str],
    *,
    rate_interval: str = RATE_INTERVAL,
    time_range: str = RANGE,
    interval: str = INTERVAL,
) -> str:
    """Grafana's interpolation of the built-in (``$__rate_interval``, ``$__range``,
    ``$__interval``) and template variables used here; anything else (e.g. label_replace's
    ``$1``) is left as it is."""
    builtins = {"__rate_interval": rate_interval, "__range": time_range, "__interval": interval}

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in builtins:
            return builtins[name]
        if name in variables:
            return variables[name]
        return match.group(0)  # e.g. label_replace's "$1"

    return re.sub(r"\$\{(\w+)\}|\$([A-Za-z_]\w*)", value, expr)


# -- Prometheus ----------------------------------------------------------------------------------


class PromClient:
    """Prometheus' HTTP API as Grafana calls it: instant and range queries, label values.

    ``scrape_s`` is the range queries' step, ``range_window_s`` how far they look back.
    """

    def __init__(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        scrape_s: float = SCRAPE_S,
        range_window_s: float = RANGE_WINDOW_S,
    ) -> None:
        self.url = f"http://{host}:{port}"
        self.scrape_s = scrape_s
        self.range_window_s = range_window_s

    def get(self, path: str, params: Mapping[str, str] | list[tuple[str, str]]) -> Any:
        """The ``data`` of a successful API response; AssertionError with Prometheus' error
        otherwise (e.g. ``bad_data``: the query does not parse)."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:  # 400: the query does not parse
            body = json.load(exc)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def values(self, expr: str, instant: bool, at_s: float) -> list[dict[str, Any]]:
        """The series ``expr`` returns at ``at_s`` (instant) or in the window before it, those
        with at least one finite value."""
        if instant:
            result: list[dict[str, Any]] = self.get(
                "/api/v1/query", {"query": expr, "time": f"{at_s:.3f}"}
            )["result"]
            return [s for s in result if _finite(s["value"][1])]
        result = self.get(
            "/api/v1/query_range",
            {
                "query": expr,
                "start": f"{at_s - self.range_window_s:.3f}",
                "end": f"{at_s:.3f}",
                "step": f"{self.scrape_s:g}",
            },
        )["result"]
        return [s for s in result if any(_finite(v) for _, v in s["values"])]

    def label_values(self, query: str, at_s: float) -> list[str]:
        """Grafana's ``label_values(metric{...}, label)``, over the minute before ``at_s``."""
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert match, f"unsupported variable query {query!r}"
        selector, label = match.groups()
        data: list[str] = self.get(
            f"/api/v1/label/{label}/values",
            [("match[]", selector), ("start", f"{at_s - 60:.3f}"), ("end", f"{at_s:.3f}")],
        )
        return data


def _finite(value: str) -> bool:
    """Whether a sample value of Prometheus' API (a string) is a number (not NaN, not ±Inf)."""
    return math.isfinite(float(value))


@contextmanager
def prometheus(
    workdir: Path, jobs: list[dict[str, Any]], scrape_s: float = SCRAPE_S
) -> Iterator[PromClient]:
    """A real Prometheus with the scrape configs ``jobs`` (see :func:`scrape_jobs`), its
    configuration and data in ``workdir``; stopped on exit."""
    with running_prometheus(workdir, [], scrape_s, scrape_configs=jobs) as server:
        yield PromClient(int(server.url.rsplit(":", 1)[1]), scrape_s=scrape_s)


def scrape_jobs(targets: Mapping[str, str | Sequence[str]]) -> list[dict[str, Any]]:
    """Static scrape configs with what the chart's PodMonitors set: job name, honor_labels,
    path, metric relabelings; and the target labels the Prometheus Operator adds to every target
    (``namespace``, ``pod``, ``container`` of the Perseus pod), which the series' own labels
    must not clash with.

    ``targets``: ``host:port`` (or several) by component: ``node-agent`` and ``operator``, and
    optionally ``dcgm`` (a ``dcgm-exporter`` job).
    """

    def listed(component: str) -> list[str]:
        found = targets[component]
        return [found] if isinstance(found, str) else list(found)

    rendered = render({"metrics": {"podMonitor": {"enabled": True}}})
    jobs = []
    for monitor in rendered.of_kind("PodMonitor"):
        component = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        (job,) = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
        target_labels = {
            "namespace": monitor["metadata"]["namespace"],
            "pod": f"{monitor['metadata']['name']}-0",
            "container": component,
        }
        jobs.append(
            {
                "job_name": job,
                "honor_labels": endpoint["honorLabels"],
                "metrics_path": endpoint["path"],
                "static_configs": [{"targets": listed(component), "labels": target_labels}],
                "metric_relabel_configs": [
                    {_snake(k): v for k, v in r.items()}
                    for r in endpoint.get("metricRelabelings", [])
                ],
            }
        )
    assert len(jobs) == 2
    if "dcgm" in targets:
        jobs.append({"job_name": "dcgm-exporter", "static_configs": [{"targets": listed("dcgm")}]})
    return jobs


def _snake(key: str) -> str:
    """A Prometheus Operator RelabelConfig key as Prometheus's (``sourceLabels``: source_labels)."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in key)


# -- checks --------------------------------------------------------------------------------------


def resolve_variables(prom: PromClient, dash: Mapping[str, Any], at_s: float) -> dict[str, str]:
    """Each variable's value as Grafana picks it: a constant's own, "All" (``.*``) for a
    multi-value variable, else the first value of its query; every query must find values
    (AssertionError)."""
    values: dict[str, str] = {}
    for var in dash["templating"]["list"]:
        if var["type"] == "constant":
            values[var["name"]] = var["query"]
        if var["type"] != "query":
            continue
        found = prom.label_values(substitute(var["definition"], values), at_s)
        assert found, f"{dash['uid']}: variable {var['name']} finds no values"
        values[var["name"]] = var["allValue"] if var["multi"] else sorted(found)[0]
    return values


def _without_data(
    prom: PromClient,
    queries: Sequence[Query],
    variables: Mapping[str, Mapping[str, str]],
    at_s: float,
) -> list[tuple[Query, str]]:
    """The queries that return no (finite) data at ``at_s``, each with its substituted
    expression."""
    substituted = [(q, substitute(q.expr, variables[q.dashboard])) for q in queries]
    return [(q, expr) for q, expr in substituted if not prom.values(expr, q.instant, at_s)]


def failing(
    prom: PromClient,
    queries: Sequence[Query],
    variables: Mapping[str, Mapping[str, str]],
    at_s: float,
) -> list[str]:
    """Names of the queries that return no (finite) data at ``at_s``; ``variables``: each
    dashboard's (by uid) template variables."""
    return [q.name for q, _ in _without_data(prom, queries, variables, at_s)]


def missing_data(prom: PromClient, at_s: float, *, include_dcgm: bool = False) -> list[str]:
    """``name: expression`` of each dashboard query that returns no data at ``at_s``, with each
    dashboard's template variables resolved from Prometheus at ``at_s`` as Grafana would.

    The queries that need dcgm-exporter are left out unless ``include_dcgm``. A variable that
    finds no values, or a query that does not parse, raises AssertionError (:func:`poll` counts
    it as missing data).
    """
    dashboards = load_dashboards()
    variables = {uid: resolve_variables(prom, d, at_s) for uid, d in dashboards.items()}
    queries = [q for q in dashboard_queries(dashboards) if include_dcgm or not q.needs_dcgm]
    return [f"{q.name}: {expr}" for q, expr in _without_data(prom, queries, variables, at_s)]


def poll(
    check: Callable[[], list[str]],
    what: str,
    timeout_s: float = TIMEOUT_S,
    interval_s: float = 0.5,
) -> None:
    """Call ``check`` (what has no data yet; an AssertionError counts as such) every
    ``interval_s`` until it returns nothing; fail the test with the last answer after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            missing = check()
        except AssertionError as exc:  # e.g. a variable without values yet
            missing = [str(exc)]
        if not missing:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: no data for\n  " + "\n  ".join(missing))
        time.sleep(interval_s)
