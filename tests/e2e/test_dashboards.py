"""Every query of the chart's Grafana dashboards returns data from a real Prometheus.

Set-up, all real processes except the Kubernetes API (kmock, in memory) and the GPUs:

- a ``perseus-node-agent`` (standalone, three emulated GPUs): GPU 0 and GPU 1 follow a plan as
  data-parallel replicas 0 and 1 of job ``ml/gpt3``, GPU 2 follows none;
- two emulated training ranks (``python -m perseus_agent.emulated_rank``) on GPUs 0 and 1
  calling the agent through ``perseus_client``; replica 1 idles a little longer per
  iteration (a straggler);
- the operator (``perseus-operator``) against kmock, with job ``ml/gpt3`` Running (profiled,
  planned, its replica 1 detected as a straggler; the agents of its node plans simulated) and
  job ``ml/bert`` still Profiling;
- a fake dcgm-exporter serving ``DCGM_FI_DEV_*`` series with dcgm-exporter's label names for
  the agent's GPU UUIDs plus a GPU without a Perseus agent; it serves nothing at first;
- Prometheus (Debian package) scraping them with the settings of the chart's PodMonitors
  (``honor_labels``, the ``job`` names).

Grafana's ``$__rate_interval``, ``$__range`` and the template variables are substituted as
Grafana would (the variables from their own ``label_values`` queries). First, without
dcgm-exporter, every query that does not need it must return data; then, with it, every query
must, and the joins must carry dcgm-exporter's labels.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from agent_process import NODE, PROFILE, Agent, source_env, write_atomically
from factories import pipeline_plan_fields
from helm_render import CHART, render
from kmock_server import KmockServer
from operator_harness import (
    JOBS,
    RESOURCES,
    OperatorProcess,
    SimulatedAgents,
    perseus_job,
    pod,
    profile_of,
)
from perseus_api import resources
from prometheus_server import PROMETHEUS, running_prometheus

pytestmark = pytest.mark.e2e

SCRAPE_S = 1.0
RATE_INTERVAL = "5s"  # Grafana: max($__interval + scrape interval, 4 x scrape interval)
RANGE = "5m"  # the dashboard's time range; longer than the test runs
RANGE_WINDOW_S = 10.0  # range queries: the last seconds, one step per scrape
STAGES, MICROBATCHES = 8, 4
# The operator's jobs (2 pods x 4 GPUs = 2 replicas x 4 stages; their agents simulated).
OPERATOR_STAGES, OPERATOR_MICROBATCHES, OPERATOR_GPUS = 4, 8, 4
NUM_GPUS = 3
TIMEOUT_S = 40.0
DCGM_EXTRA_UUID = "GPU-00000000-dcgm-only"  # a GPU on a node without a Perseus agent


@pytest.fixture(scope="module", autouse=True)
def _prometheus_installed() -> None:
    if PROMETHEUS is None:
        message = "prometheus is not installed (apt-get install prometheus)"
        if os.environ.get("PERSEUS_REQUIRE_E2E") == "1":
            pytest.fail(message)
        pytest.skip(message)


# -- the dashboards ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref: str
    expr: str
    instant: bool
    needs_dcgm: bool  # declared so by its legend or panel title

    @property
    def name(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {
        p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))
    }


def dashboard_queries(dashboards: Mapping[str, Mapping[str, Any]]) -> list[Query]:
    queries = []
    for uid, dash in dashboards.items():
        panels = [p for top in dash["panels"] for p in (top, *top.get("panels", []))]
        for panel in panels:
            for target in panel.get("targets", []):
                marker = "(dcgm-exporter)"
                needs = marker in target.get("legendFormat", "") or marker in panel["title"]
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


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """Grafana's interpolation of the built-in and template variables used here."""
    builtins = {"__rate_interval": RATE_INTERVAL, "__range": RANGE, "__interval": "1s"}

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in builtins:
            return builtins[name]
        if name in variables:
            return variables[name]
        return match.group(0)  # e.g. label_replace's "$1"

    return re.sub(r"\$\{(\w+)\}|\$([A-Za-z_]\w*)", value, expr)


# -- servers -------------------------------------------------------------------------------------


class PromClient:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, params: Mapping[str, str] | list[tuple[str, str]]) -> Any:
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
        """The series ``expr`` returns at ``at_s`` (instant) or in the window before it."""
        if instant:
            result: list[dict[str, Any]] = self.get(
                "/api/v1/query", {"query": expr, "time": f"{at_s:.3f}"}
            )["result"]
            return [s for s in result if _finite(s["value"][1])]
        result = self.get(
            "/api/v1/query_range",
            {
                "query": expr,
                "start": f"{at_s - RANGE_WINDOW_S:.3f}",
                "end": f"{at_s:.3f}",
                "step": f"{SCRAPE_S:g}",
            },
        )["result"]
        return [s for s in result if any(_finite(v) for _, v in s["values"])]

    def label_values(self, query: str, at_s: float) -> list[str]:
        """Grafana's ``label_values(metric{...}, label)``."""
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert match, f"unsupported variable query {query!r}"
        selector, label = match.groups()
        data: list[str] = self.get(
            f"/api/v1/label/{label}/values",
            [("match[]", selector), ("start", f"{at_s - 60:.3f}"), ("end", f"{at_s:.3f}")],
        )
        return data


def _finite(value: str) -> bool:
    return math.isfinite(float(value))


@contextmanager
def prometheus(workdir: Path, jobs: list[dict[str, Any]]) -> Iterator[PromClient]:
    with running_prometheus(workdir, [], SCRAPE_S, scrape_configs=jobs) as server:
        yield PromClient(int(server.url.rsplit(":", 1)[1]))


def scrape_jobs(targets: Mapping[str, str]) -> list[dict[str, Any]]:
    """Static scrape configs with what the chart's PodMonitors set: job name, honor_labels."""
    rendered = render({"metrics": {"podMonitor": {"enabled": True}}})
    jobs = []
    for monitor in rendered.of_kind("PodMonitor"):
        component = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        (job,) = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
        jobs.append(
            {
                "job_name": job,
                "honor_labels": endpoint["honorLabels"],
                "metrics_path": endpoint["path"],
                "static_configs": [{"targets": [targets[component]]}],
            }
        )
    assert len(jobs) == 2
    jobs.append({"job_name": "dcgm-exporter", "static_configs": [{"targets": [targets["dcgm"]]}]})
    return jobs


class _Server:
    """A tiny HTTP server of one text document, for /metrics."""

    def __init__(self, body: Callable[[], bytes | None]) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = outer.body()
                if data is None:
                    self.send_response(503)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.body = body
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeDcgmExporter:
    """dcgm-exporter's series and label names (``gpu``, ``UUID``, ``device``, ``modelName``,
    ``Hostname``) for the given GPUs; serves 503 until :meth:`enable`."""

    def __init__(self, uuids: list[str]) -> None:
        self.uuids = uuids
        self.enabled = False
        self.server = _Server(self.body)

    def enable(self) -> None:
        self.enabled = True

    def body(self) -> bytes | None:
        if not self.enabled:
            return None
        lines = []
        for metric, value in (("DCGM_FI_DEV_POWER_USAGE", 250.5), ("DCGM_FI_DEV_GPU_UTIL", 87)):
            lines.append(f"# TYPE {metric} gauge")
            for i, uuid in enumerate(self.uuids):
                labels = (
                    f'gpu="{i}",UUID="{uuid}",device="nvidia{i}",'
                    f'modelName="NVIDIA A100-SXM4-40GB",Hostname="dcgm-exporter-x7k2p"'
                )
                lines.append(f"{metric}{{{labels}}} {value}")
        return ("\n".join(lines) + "\n").encode()


@contextmanager
def running_operator(tmp_path: Path) -> Iterator[tuple[OperatorProcess, Callable[[], None]]]:
    """The real operator against kmock, with job ``ml/gpt3`` Running (its agents simulated,
    replica 1 a straggler: re-targeted) and job ``ml/bert`` Profiling (its agents silent).

    Also yields ``replan()``: a spec change of ``ml/gpt3`` that needs a new frontier, so that a
    planner run happens while Prometheus scrapes (panels over ``$__range`` need one).
    """
    with KmockServer(RESOURCES) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig", namespace="ml")
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        core = kubernetes.client.CoreV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)
        for app in ("gpt3", "bert"):
            for index in range(2):
                core.create_namespaced_pod("ml", pod(app, index, "ml", gpus=OPERATOR_GPUS))
            body = perseus_job(
                app, "ml", app, stages=OPERATOR_STAGES, dp=2, microbatches=OPERATOR_MICROBATCHES
            )
            custom.create_namespaced_custom_object(
                resources.GROUP, resources.VERSION, "ml", "perseusjobs", body
            )
        operator = OperatorProcess(kubeconfig)
        try:
            profile = profile_of(OPERATOR_STAGES)
            with SimulatedAgents(custom, "ml", profile, jobs={"gpt3"}) as agents:

                def status() -> dict[str, Any]:
                    job = server.objects(JOBS).get(("ml", "gpt3")) or {}
                    return dict(job.get("status") or {})

                running = operator.wait_for("Running", lambda: status().get("phase") == "Running")
                assert running
                agents.t_min_s["gpt3"] = status()["frontier"]["tMinSeconds"]
                agents.slow = {1: 1.2}
                operator.wait_for("the straggler", lambda: status().get("stragglers"))

                def replan() -> None:  # another blocking power: the same profile, a new frontier
                    custom.patch_namespaced_custom_object(
                        resources.GROUP,
                        resources.VERSION,
                        "ml",
                        "perseusjobs",
                        "gpt3",
                        {"spec": {"policy": {"blockingPowerWatts": 80.0}}},
                    )

                yield operator, replan
        finally:
            operator.stop()


def node_plan() -> dict[str, Any]:
    plan = pipeline_plan_fields(num_stages=STAGES, num_microbatches=MICROBATCHES)
    plan["granularity"] = "Stage"
    for stage in plan["stages"]:
        stage["frequency_mhz"] = 1005
    assignments = [
        {
            "gpu_index": dp,
            "plan": "main",
            "stage": 0,
            "dp_rank": dp,
            "rank": dp,
            "pod": f"gpt3-worker-{dp}",
        }
        for dp in (0, 1)
    ]
    return {
        "node": NODE,
        "namespace": "ml",
        "job": "gpt3",
        "revision": 1,
        "granularity": "Stage",
        "plans": {"main": plan},
        "assignments": assignments,
    }


def start_rank(agent: Agent, gpu: int, bubble_s: float, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "perseus_agent.emulated_rank",
                f"--state-file={agent.gpu_state}",
                f"--num-gpus={agent.num_gpus}",
                f"--gpu-index={gpu}",
                f"--rank={gpu}",
                f"--node-name={NODE}",
                f"--profile={PROFILE}",
                "--blocking-power=83.64",
                "--stage=0",
                f"--stages={STAGES}",
                f"--microbatches={MICROBATCHES}",
                "--steps=100000",
                f"--socket={agent.socket_dir / 'agent.sock'}",
                "--time-scale=0.05",
                f"--bubble-s={bubble_s}",
            ],
            env=source_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="pdash-"))
    agent = Agent(tmp_path, socket_dir / "run", num_gpus=NUM_GPUS)
    ranks: list[subprocess.Popen[bytes]] = []
    dcgm = None
    stack_context = ExitStack()
    try:
        write_atomically(agent.plan_file, json.dumps(node_plan()))
        agent.start()
        uuids = sorted(set(re.findall(r'uuid="([^"]+)"', agent.get("/metrics"))))
        assert len(uuids) == NUM_GPUS
        operator, replan = stack_context.enter_context(running_operator(tmp_path))
        dcgm = FakeDcgmExporter([*uuids, DCGM_EXTRA_UUID])
        ranks = [
            start_rank(agent, 0, 0.0, tmp_path / "rank0.log"),
            start_rank(agent, 1, 0.03, tmp_path / "rank1.log"),  # the straggler
        ]
        targets = {
            "node-agent": f"127.0.0.1:{agent.port}",
            "operator": operator.metrics_target,
            "dcgm": dcgm.server.target,
        }
        with prometheus(tmp_path, scrape_jobs(targets)) as prom:
            # Once Prometheus has the operator's counters, a planner run it can see increase.
            poll(
                lambda: (
                    []
                    if prom.values("perseus_planner_seconds_count", True, time.time())
                    else ["perseus_planner_seconds_count"]
                ),
                "the operator's first scrape",
            )
            replan()
            yield {"prom": prom, "dcgm": dcgm, "agent": agent, "ranks": ranks, "tmp": tmp_path}
    finally:
        for rank in ranks:
            rank.terminate()
            rank.wait(10)
        if dcgm is not None:
            dcgm.server.stop()
        stack_context.close()
        agent.kill_if_running()
        shutil.rmtree(socket_dir, ignore_errors=True)


def resolve_variables(prom: PromClient, dash: Mapping[str, Any], at_s: float) -> dict[str, str]:
    """Each variable's value as Grafana picks it: "All" (``.*``) for a multi-value variable,
    else the first value of its query; every query must find values."""
    values: dict[str, str] = {}
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        found = prom.label_values(substitute(var["definition"], values), at_s)
        assert found, f"{dash['uid']}: variable {var['name']} finds no values"
        values[var["name"]] = var["allValue"] if var["multi"] else sorted(found)[0]
    return values


def failing(
    prom: PromClient, queries: list[Query], variables: Mapping[str, Mapping[str, str]], at_s: float
) -> list[str]:
    """Names of the queries that return no (finite) data at ``at_s``."""
    return [
        q.name
        for q in queries
        if not prom.values(substitute(q.expr, variables[q.dashboard]), q.instant, at_s)
    ]


def poll(check: Callable[[], list[str]], what: str, timeout_s: float = TIMEOUT_S) -> None:
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
        time.sleep(0.5)


def test_every_dashboard_query_returns_data_with_and_without_dcgm_exporter(
    stack: dict[str, Any],
) -> None:
    prom: PromClient = stack["prom"]
    dashboards = load_dashboards()
    queries = dashboard_queries(dashboards)
    assert len(queries) >= 30
    variables: dict[str, dict[str, str]] = {}

    def own_queries_fail() -> list[str]:
        now = time.time()
        variables.update({uid: resolve_variables(prom, d, now) for uid, d in dashboards.items()})
        return failing(prom, [q for q in queries if not q.needs_dcgm], variables, now)

    # Without dcgm-exporter: every panel has data, only the dcgm-exporter queries are empty.
    poll(own_queries_fail, "without dcgm-exporter")
    without_s = time.time()
    assert variables["perseus-job"] == {"namespace": "ml", "job": "gpt3"}
    assert variables["perseus-node"] == {"node": ".*", "gpu": ".*"}
    dcgm_queries = [q for q in queries if q.needs_dcgm]
    assert len(dcgm_queries) >= 3
    assert failing(prom, dcgm_queries, variables, without_s) == [q.name for q in dcgm_queries]
    for rank in stack["ranks"]:
        assert rank.poll() is None, "an emulated rank stopped early"

    # With dcgm-exporter: every query has data.
    stack["dcgm"].enable()
    poll(lambda: failing(prom, queries, variables, time.time()), "with dcgm-exporter")
    with_s = time.time()

    def run(title: str, at_s: float, dashboard: str = "perseus-node") -> list[dict[str, Any]]:
        (q,) = [q for q in queries if q.dashboard == dashboard and q.panel == title]
        return prom.values(substitute(q.expr, variables[dashboard]), q.instant, at_s)

    # The GPU table joins dcgm-exporter's model name where it has it, and lists all GPUs anyway.
    without = run("GPUs", without_s)
    with_dcgm = run("GPUs", with_s)
    assert len(without) == len(with_dcgm) == NUM_GPUS
    assert not any("modelName" in s["metric"] for s in without)
    assert {s["metric"].get("modelName") for s in with_dcgm} == {"NVIDIA A100-SXM4-40GB"}
    managed = sorted(
        (s["metric"]["gpu"], s["metric"].get("dp_rank"), s["metric"].get("job")) for s in with_dcgm
    )
    assert managed == [("0", "0", "gpt3"), ("1", "1", "gpt3"), ("2", None, "perseus-node-agent")]
    # The GPU without a Perseus agent shows up only through dcgm-exporter.
    (power,) = [q for q in queries if q.dashboard == "perseus-cluster" and q.needs_dcgm]
    result = prom.values(substitute(power.expr, {}), power.instant, with_s)
    assert result and all(float(v) == 250.5 for s in result for _, v in s["values"] if _finite(v))
    # The straggler is visible: replica 1 is slower than replica 0.
    (slowdown,) = [q for q in queries if q.panel == "Slowdown vs. the fastest replica"]
    ratios = {
        s["metric"]["dp_rank"]: float(s["value"][1])
        for s in prom.values(substitute(slowdown.expr, variables["perseus-job"]), True, with_s)
    }
    assert ratios["0"] == pytest.approx(1.0) and ratios["1"] > 1.05, ratios


def test_a_query_that_returns_nothing_is_caught(stack: dict[str, Any]) -> None:
    """The check itself: a misspelled metric, a label no series has and a query that does not
    parse all fail."""
    prom: PromClient = stack["prom"]
    prom_ready = Query("x", "y", "A", "sum(perseus_gpu_power_watts)", True, False)
    poll(lambda: failing(prom, [prom_ready], {"x": {}}, time.time()), "agent series")
    bad = [
        Query("x", "typo", "A", "sum(perseus_gpu_power_wats)", True, False),
        Query("x", "label", "A", 'perseus_gpu_power_watts{exported_job="gpt3"}', False, False),
    ]
    assert failing(prom, bad, {"x": {}}, time.time()) == ["x / typo / A", "x / label / A"]
    with pytest.raises(AssertionError, match="bad_data"):
        prom.values("sum(perseus_gpu_power_watts", True, time.time())
