"""Every query of the chart's Grafana dashboards returns data from a real Prometheus.

Set-up, all real processes except the Kubernetes API (kmock, in memory) and the GPUs:

- a ``perseus-node-agent`` (standalone, three emulated GPUs): GPU 0 and GPU 1 follow a plan as
  data-parallel replicas 0 and 1 of job ``ml/gpt3``, GPU 2 follows none;
- two emulated training ranks (``python -m perseus_emulation.rank``) on GPUs 0 and 1
  calling the agent through ``perseus_client``; replica 1 idles a little longer per
  iteration (a straggler);
- the operator (``perseus-operator``) against kmock, with job ``ml/gpt3`` Running (profiled,
  planned, its replica 1 detected as a straggler; the agents of its node plans simulated) and
  job ``ml/bert`` still Profiling;
- a fake dcgm-exporter serving ``DCGM_FI_DEV_*`` series with dcgm-exporter's label names for
  the agent's GPU UUIDs plus a GPU without a Perseus agent; it serves nothing at first;
- Prometheus (Debian package) scraping them with the settings of the chart's PodMonitors
  (``honor_labels: false``, the ``job`` names, the metric relabelings) and the target labels
  the Prometheus Operator adds (``namespace``, ``pod``, ``container``), which no series' own
  label clashes with.

Grafana's ``$__rate_interval``, ``$__range`` and the template variables are substituted as
Grafana would (the variables from their own ``label_values`` queries). First, without
dcgm-exporter, every query that does not need it must return data; then, with it, every query
must, and the joins must carry dcgm-exporter's labels.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from perseus_api import resources
from perseus_api.power_budget import BUDGET_PLURAL
from support.agent_process import NODE, PROFILE, Agent, source_env, write_atomically
from support.dashboard_queries import (
    PromClient,
    Query,
    _finite,
    chart_dashboards,
    dashboard_queries,
    failing,
    load_dashboards,
    missing_data,
    poll,
    prometheus,
    resolve_variables,
    scrape_jobs,
    substitute,
)
from support.factories import pipeline_plan_fields
from support.kmock_server import KmockServer
from support.operator_harness import (
    JOBS,
    RESOURCES,
    VERBS,
    OperatorProcess,
    SimulatedAgents,
    perseus_job,
    pod,
    profile_of,
)
from support.prometheus_server import PROMETHEUS

STAGES, MICROBATCHES = 8, 4
# The operator's jobs (2 pods x 4 GPUs = 2 replicas x 4 stages; their agents simulated).
OPERATOR_STAGES, OPERATOR_MICROBATCHES, OPERATOR_GPUS = 4, 8, 4
NUM_GPUS = 3
BUDGET_RESOURCES: dict[str, dict[str, Any]] = {
    **RESOURCES,
    "v1/nodes": {"kind": "Node", "singular": "node", "namespaced": False, "verbs": VERBS},
    f"{resources.GROUP}/{resources.VERSION}/{BUDGET_PLURAL}": {
        "kind": "PerseusPowerBudget",
        "singular": "perseuspowerbudget",
        "namespaced": False,
        "subresources": {"status"},
        "verbs": VERBS,
    },
}
DCGM_EXTRA_UUID = "GPU-00000000-dcgm-only"  # a GPU on a node without a Perseus agent
# Not the chart's defaults: the dashboards under test are the chart's, rendered with these.
ELECTRICITY = {"pricePerKWh": 0.27, "currency": "EUR", "carbonIntensityGramsPerKWh": 310}
JOULES_PER_KWH = 3.6e6


@pytest.fixture(scope="module", autouse=True)
def _prometheus_installed() -> None:
    if PROMETHEUS is None:
        message = "prometheus is not installed (apt-get install prometheus)"
        if os.environ.get("PERSEUS_REQUIRE_E2E") == "1":
            pytest.fail(message)
        pytest.skip(message)


# -- servers -------------------------------------------------------------------------------------


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
    with KmockServer(BUDGET_RESOURCES) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig", namespace="ml")
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        core = kubernetes.client.CoreV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)
        # A power budget for the jobs' nodes, generous (nothing slowed): its panels have data.
        for app in ("gpt3", "bert"):
            for index in range(2):
                labels = {"topology.example.com/rack": "a"}
                core.create_node({"metadata": {"name": f"{app}-node-{index}", "labels": labels}})
        custom.create_cluster_custom_object(
            resources.GROUP,
            resources.VERSION,
            BUDGET_PLURAL,
            {
                "apiVersion": f"{resources.GROUP}/{resources.VERSION}",
                "kind": "PerseusPowerBudget",
                "metadata": {"name": "rack-a"},
                "spec": {
                    "budgetWatts": 1e6,
                    "nodeSelector": {"matchLabels": {"topology.example.com/rack": "a"}},
                },
            },
        )
        for app in ("gpt3", "bert"):
            for index in range(2):
                core.create_namespaced_pod("ml", pod(app, index, "ml", gpus=OPERATOR_GPUS))
            body = perseus_job(
                app, "ml", app, stages=OPERATOR_STAGES, dp=2, microbatches=OPERATOR_MICROBATCHES
            )
            custom.create_namespaced_custom_object(
                resources.GROUP, resources.VERSION, "ml", "perseusjobs", body
            )
        operator = OperatorProcess(
            kubeconfig, extra_env={"PERSEUS_OPERATOR_BUDGET_INTERVAL_S": "1"}
        )
        try:
            profile = profile_of(OPERATOR_STAGES)
            with SimulatedAgents(custom, "ml", profile, jobs={"gpt3"}) as agents:
                agents.gpu_watts = 250.0

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
                "perseus_emulation.rank",
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


def admin_lock_and_power_cap(agent: Agent) -> None:
    """Before the agent starts: an administrator's lock on GPU 2 (it follows no plan) and a
    power cap on GPU 0, so the clock event reasons panel has another owner's clock to show."""
    from perseus_agent.gpu.base import CLOCK_EVENT_REASONS
    from perseus_agent.gpu.emulated import EmulatedBackend

    gpus = EmulatedBackend.from_csv(
        NUM_GPUS, PROFILE, blocking_power_w=83.64, node_name=NODE, state_file=agent.gpu_state
    )
    try:
        gpus.lock_sm_clock(2, 1110)
        gpus.set_clock_event_reasons(0, CLOCK_EVENT_REASONS["sw_power_cap"])
    finally:
        gpus.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="pdash-"))
    agent = Agent(tmp_path, socket_dir / "run", num_gpus=NUM_GPUS)
    ranks: list[subprocess.Popen[bytes]] = []
    dcgm = None
    stack_context = ExitStack()
    try:
        write_atomically(agent.plan_file, json.dumps(node_plan()))
        admin_lock_and_power_cap(agent)
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


def test_every_dashboard_query_returns_data_with_and_without_dcgm_exporter(
    stack: dict[str, Any],
) -> None:
    prom: PromClient = stack["prom"]
    dashboards = chart_dashboards({"dashboards": {"electricity": ELECTRICITY}})
    assert dashboards.keys() == load_dashboards().keys()
    queries = dashboard_queries(dashboards)
    assert len(queries) >= 40

    # Without dcgm-exporter: every panel has data, only the dcgm-exporter queries are empty.
    poll(lambda: missing_data(prom, time.time()), "without dcgm-exporter")
    without_s = time.time()
    variables = {uid: resolve_variables(prom, d, without_s) for uid, d in dashboards.items()}
    constants = {"price_per_kwh": "0.27", "currency": "EUR", "carbon_g_per_kwh": "310"}
    assert variables["perseus-job"] == {"namespace": "ml", "job": "gpt3", **constants}
    assert variables["perseus-cluster"] == constants
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
        (s["metric"]["gpu"], s["metric"].get("dp_rank"), s["metric"].get("job_name"))
        for s in with_dcgm
    )
    # The training job is job_name; the scrape job stays in `job`, on every series alike.
    assert managed == [("0", "0", "gpt3"), ("1", "1", "gpt3"), ("2", None, None)]
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
    # A Perseus lock is told from a power cap and from an administrator's lock.
    title = "Clock event reasons: who holds the clock"
    reasons = {
        (s["metric"]["gpu"], s["metric"].get("reason") or s["metric"].get("kind"))
        for q in queries
        if q.panel == title
        for s in prom.values(substitute(q.expr, variables["perseus-node"]), q.instant, with_s)
        if any(_finite(v) and float(v) > 0 for _, v in s["values"])
    }
    assert {
        ("0", "sw_power_cap"),
        ("0", "user_defined_clocks"),
        ("2", "user_defined_clocks"),
        ("2", "locked"),
    } <= reasons, reasons
    assert ("1", "sw_power_cap") not in reasons and ("0", "locked") not in reasons
    check_energy_cost_and_co2(prom, queries, variables, with_s)


def check_energy_cost_and_co2(
    prom: PromClient,
    queries: list[Query],
    variables: dict[str, dict[str, str]],
    at_s: float,
) -> None:
    """The kWh stats are the GPUs' energy counters (and the operator's estimate of the energy
    saved) over the time range, and the cost and CO2e stats those kWh times the price and the
    carbon intensity the chart was given."""
    price = ELECTRICITY["pricePerKWh"]
    grams_per_kwh = ELECTRICITY["carbonIntensityGramsPerKWh"]
    for uid, selector in (
        ("perseus-cluster", ""),
        ("perseus-job", '{job_namespace="ml", job_name="gpt3"}'),
    ):

        def stat(title: str, expr: str | None = None, uid: str = uid) -> float:
            if expr is None:
                (query,) = [q for q in queries if q.dashboard == uid and q.panel == title]
                assert query.instant
                expr = substitute(query.expr, variables[uid])
            (series,) = prom.values(expr, True, at_s)
            return float(series["value"][1])

        used_j = stat("", f"sum(increase(perseus_gpu_energy_joules_total{selector}[5m]))")
        saved_j = stat("", f"sum(increase(perseus_job_energy_saved_joules_total{selector}[5m]))")
        used_kwh, saved_kwh = stat("Energy used"), stat("Energy saved (estimated)")
        assert used_j > 0 and saved_j > 0, (uid, used_j, saved_j)
        assert used_kwh == pytest.approx(used_j / JOULES_PER_KWH, rel=1e-9), uid
        assert saved_kwh == pytest.approx(saved_j / JOULES_PER_KWH, rel=1e-9), uid
        assert stat("Cost of the energy used ($currency)") == pytest.approx(used_kwh * price)
        assert stat("Cost saved ($currency)") == pytest.approx(saved_kwh * price)
        kg = grams_per_kwh / 1000
        assert stat("CO2e emitted") == pytest.approx(used_kwh * kg)
        assert stat("CO2e avoided (estimated)") == pytest.approx(saved_kwh * kg)


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
