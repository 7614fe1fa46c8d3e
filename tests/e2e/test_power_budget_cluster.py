"""A cluster power budget, end to end on a real Kubernetes API server, with emulated GPUs and
training, measured by a real Prometheus.

Set-up: one power domain (the nodes labelled ``topology.example.com/rack=e2e``) of three nodes:
``budget-node-0`` and ``budget-node-1`` with four emulated GPUs each (the bundled GPT-3 / A100
profile's first four stages) and ``budget-node-idle`` with two GPUs no job uses (they idle at
blocking power: the unmanaged draw). A node agent process on each, in Kubernetes mode, asks a
kubelet stand-in which GPUs a pod owns. Two trainings (``perseus_emulation.job``, one pipeline
of four stages each, with the client hooks), one per node, and two PerseusJobs of them planned
from a stored profile (no profiling run: the test stays within minutes). Prometheus scrapes the
agents; the operator (a process, the chart's service account) reads each domain's draw from it
(``PERSEUS_OPERATOR_PROMETHEUS_URL``) every 2 s, over a 10 s averaging window.

The scenarios run in this file's order: the all-max draw measured with no plan, then the jobs
at ``T_min``; a budget at 85 % of the jobs' all-max draw (plus the unmanaged GPUs) met within
three windows, as Prometheus measures it, with both jobs slowed; a lower budget slowing both
more (iteration times measured); an infeasible one (``Infeasible``, with the watts missing,
and the Events); one job ended and deleted, and the other back at ``T_min``; the budget deleted
and the job at ``T_min`` again. The per-GPU power limits of ``PlansAndPowerLimits`` (the
backstop) have their own end-to-end test (``test_power_backstop.py``); where they would be
checked in these scenarios is marked.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from perseus_api import resources
from perseus_api.power_budget import BUDGET_PLURAL
from perseus_operator.jobs.profile_source import PROFILE_KEY
from perseus_operator.workloads.objects import PYTORCH_CONTAINER
from support.agent_process import Agent
from support.cluster_harness import Cluster, require
from support.dashboard_queries import scrape_jobs
from support.emulated_training import BLOCKING_W, GPUS, STAGES, Training
from support.emulated_training_objects import pytorch_job, training_pod
from support.operator_harness import OperatorProcess, cut_profile
from support.power_budget_domain import Domain
from support.prometheus_server import PROMETHEUS, free_port, running_prometheus

try:  # the agents ask a kubelet stand-in which GPUs each pod owns (needs grpcio, protobuf)
    from support.kubelet_pod_resources import KubeletStandIn, StandInPod
except ImportError:  # pragma: no cover - the test extra installs both
    KubeletStandIn = None  # type: ignore[assignment,misc]

NAMESPACE = "power"
RACK = {"topology.example.com/rack": "e2e"}
JOBS = {"job-a": "budget-node-0", "job-b": "budget-node-1"}  # one pipeline per node
IDLE_NODE, IDLE_GPUS = "budget-node-idle", 2  # in the domain, no job: the unmanaged draw
MICROBATCHES = 4  # an iteration of ~1.0 s: more iterations per minute than the 8 of the others
BUDGET = "rack-budget-e2e"
WINDOW_S = 10  # the budget's averaging window (the CRD's least)
ROUND_S = 2.0  # the operator's budget rounds
MARGIN = 0.05  # the budget's default safety margin
# Measured slowdown (iteration time vs the job's measured T_min) vs the allocation's planned one
# (frontier time vs T_min). Over 5 quiet runs on this 2-core machine (load average 8-10 from
# other sessions) it ran -0.61 to +0.65 points off the plan; with one core kept busy
# (load ~15) +0.50 to +0.55 at 85 % and -1.94 to -1.55 at 75 %: a loaded host inflates the
# T_min reference (1.028-1.029 s for 1.009-1.013 s quiet) more than the slower plans, whose
# computations have slack. A lower budget made each job's iterations 5.3 % to 9.0 % longer
# than at 85 %. 3 points keeps a point above the worst of those, and well below what it checks
# (planned slowdowns of 3-14 %, steps of 5 % and more).
SLOWDOWN_TOLERANCE = 0.03


def _perseus_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": resources.API_VERSION,
        "kind": "PerseusJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "workload": {"kind": "PyTorchJob", "name": name},
            "parallelism": {
                "pipelineStages": STAGES,
                "dataParallel": 1,
                "microbatches": MICROBATCHES,
            },
            "policy": {
                "mode": "Intrinsic",
                "granularity": "Instruction",
                "blockingPowerWatts": BLOCKING_W,
            },
            "profiling": {"profileRef": {"configMapName": "gpt3-a100-4-stages"}},
        },
    }


@pytest.fixture(scope="module")
def domain(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Domain]:
    if PROMETHEUS is None:
        require("prometheus is not installed (apt-get install prometheus)")
    if KubeletStandIn is None:
        require("grpcio and protobuf are not installed (pip install perseus-k8s[test,agent])")
    workdir = tmp_path_factory.mktemp("power-budget")
    stack = ExitStack()
    core = cluster.core
    cluster.plane.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    )
    core.create_namespaced_config_map(
        NAMESPACE,
        {"metadata": {"name": "gpt3-a100-4-stages"}, "data": {PROFILE_KEY: cut_profile(STAGES)}},
    )
    agents: dict[str, Agent] = {}
    nodes = [*((node, GPUS, job) for job, node in JOBS.items()), (IDLE_NODE, IDLE_GPUS, None)]
    for node, gpus, job in nodes:
        cluster.node(node, gpus)
        core.patch_node(node, {"metadata": {"labels": RACK}})
        (workdir / node).mkdir()
        # Unix socket paths are limited to 108 bytes, which pytest's tmp paths can exceed.
        socket_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="perseus-")))
        kubelet = stack.enter_context(KubeletStandIn(socket_dir / "kubelet.sock"))
        if job is not None:
            owned = [f"GPU-emu-{node}-{i}" for i in range(gpus)]
            kubelet.set_pods([StandInPod(NAMESPACE, f"{job}-master-0", {PYTORCH_CONTAINER: owned})])
        agents[node] = Agent(
            workdir / node,
            socket_dir,
            num_gpus=gpus,
            kubeconfig=cluster.agent_kubeconfig(node),
            node=node,
            log_level="info",
            pod_resources_socket=kubelet.socket_path,
        )
    operator: OperatorProcess | None = None
    state: Domain | None = None
    try:
        for agent in agents.values():
            agent.start()
        (workdir / "prometheus").mkdir()
        metrics_port = free_port()
        targets = {
            "node-agent": [f"127.0.0.1:{a.port}" for a in agents.values()],
            "operator": f"127.0.0.1:{metrics_port}",
        }
        prom = stack.enter_context(
            running_prometheus(workdir / "prometheus", [], scrape_configs=scrape_jobs(targets))
        )
        operator = OperatorProcess(
            cluster.operator_kubeconfig,
            metrics_port=metrics_port,
            extra_env={
                "PERSEUS_OPERATOR_PROMETHEUS_URL": prom.url,
                "PERSEUS_OPERATOR_BUDGET_INTERVAL_S": str(ROUND_S),
            },
        )
        state = Domain(
            cluster, workdir, agents, operator, prom, namespace=NAMESPACE, budget_name=BUDGET,
            node_selector=RACK, window_s=WINDOW_S, margin_ratio=MARGIN,
        )  # fmt: skip
        for job, node in JOBS.items():
            state.trainings[job] = Training(
                workdir, [agents[node]], hooks=True, replicas=1, microbatches=MICROBATCHES,
                name=job,
            )  # fmt: skip
        yield state
    finally:
        if state is not None:
            for training in state.trainings.values():
                training.stop()
            print("\n".join(["power budget e2e numbers:", *state.log]))
        for agent in agents.values():
            agent.kill_if_running()
        if operator is not None:
            operator.stop()
        stack.close()


# -- scenarios -------------------------------------------------------------------------------


def test_the_jobs_run_at_t_min_under_no_budget(domain: Domain) -> None:
    """The reference numbers: each job's draw and iteration time with every GPU at its highest
    clock (no plan yet), the idle node's draw, then each job at ``T_min``."""
    d = domain
    for job in JOBS:
        d.trainings[job].wait_iterations(2)  # warm
    time.sleep(WINDOW_S + 2)  # a whole window of scrapes at all-max
    now = time.time()
    for job, node in JOBS.items():
        d.all_max_w[job] = d.draw_w([node], now)
        d.all_max_s[job] = d.measure(job).iteration_s
    d.unmanaged_w = d.draw_w([IDLE_NODE], now)
    d.say(f"all-max: {d.all_max_w} W, {d.all_max_s} s/iteration; idle node {d.unmanaged_w:.1f} W")
    # The idle GPUs draw their blocking power, and Prometheus sees it.
    assert d.unmanaged_w == pytest.approx(IDLE_GPUS * BLOCKING_W, rel=0.05)

    custom, core = d.cluster.custom, d.cluster.core
    for job, node in JOBS.items():
        custom.create_namespaced_custom_object(
            "kubeflow.org", "v1", NAMESPACE, "pytorchjobs",
            pytorch_job(job, namespace=NAMESPACE, replica_types=("Master",)),
        )  # fmt: skip
        pod = core.create_namespaced_pod(
            NAMESPACE, training_pod(job, "master", node, namespace=NAMESPACE)
        )
        core.patch_namespaced_pod_status(
            pod.metadata.name, NAMESPACE, {"status": {"phase": "Running"}}
        )
        custom.create_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", _perseus_job(job)
        )
    for job in JOBS:
        d.wait_for(f"{job}'s T_min plan applied", lambda job=job: d.applied(job))
    for job in JOBS:
        d.t_min_s[job] = d.measure(job).iteration_s
        planned = d.job(job)["status"]["frontier"]["tMinSeconds"]
        d.say(f"{job} at T_min: {d.t_min_s[job]:.4f} s (planned {planned:.4f} s)")
        assert d.t_min_s[job] <= d.all_max_s[job] * (1 + SLOWDOWN_TOLERANCE)


def _within_three_windows(d: Domain, budget_w: float, since_s: float) -> list[float]:
    """Poll the domain's draw (Prometheus, over the window) until it is within ``budget_w``;
    fail after three windows. Then the draw over each of the next two whole windows, which
    must stay within it. Returns [draw when first within, window 1, window 2]."""
    nodes = [*JOBS.values(), IDLE_NODE]
    while True:
        drawn_w = d.draw_w(nodes)
        if drawn_w <= budget_w:
            break
        elapsed_s = time.time() - since_s
        assert elapsed_s <= 3 * WINDOW_S, (
            f"the domain still draws {drawn_w:.1f} W > {budget_w:.1f} W after {elapsed_s:.1f} s"
        )
        time.sleep(0.5)
    met_after_s = time.time() - since_s
    windows = []
    for _ in range(2):
        time.sleep(WINDOW_S)
        windows.append(d.draw_w(nodes))
    d.say(
        f"budget {budget_w:.1f} W: within it after {met_after_s:.1f} s ({drawn_w:.1f} W); "
        f"the next two windows {windows[0]:.1f} W, {windows[1]:.1f} W"
    )
    assert max(windows) <= budget_w, windows
    return [drawn_w, *windows]


def _slowdowns(d: Domain, status: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Each job's (measured, planned) slowdown vs its measured ``T_min``."""
    out = {}
    for job in status["jobs"]:
        name = job["name"]
        measured_s = d.measure(name).iteration_s
        d.slowed_s[name] = measured_s
        out[name] = (measured_s / d.t_min_s[name] - 1, job["slowdownRatio"])
    return out


def test_a_budget_at_85_percent_is_met_within_three_windows(domain: Domain) -> None:
    d = domain
    budget_w = 0.85 * sum(d.all_max_w.values()) + d.unmanaged_w
    since_s = d.set_budget(budget_w)
    status = d.wait_for("both jobs re-targeted for the budget", lambda: d.retargeted(1))
    assert status["managedJobs"] == 2 and status["nodes"] == 3, status
    assert all(d.target_s(job) is not None for job in JOBS), "both slowed, by the 5 % margin too"
    _within_three_windows(d, budget_w, since_s)

    def met() -> dict[str, Any] | None:
        now = d.budget()["status"]
        conditions = {c["type"]: c for c in now["conditions"]}
        return now if conditions["Met"]["status"] == "True" else None

    status = d.wait_for("the budget's Met condition", met, timeout_s=3 * WINDOW_S)
    # The operator's own reading of the draw: from the same Prometheus, the idle GPUs counted.
    assert status["measuredWatts"] <= budget_w
    assert status["unmanagedWatts"] == pytest.approx(d.unmanaged_w, rel=0.05), status
    slowdowns = _slowdowns(d, status)
    d.say(
        f"85 %: budget {budget_w:.1f} W, status {status['measuredWatts']} W measured, "
        f"{status['allocatedWatts']} W allocated; slowdowns (measured, planned) {slowdowns}"
    )
    for name, (measured, planned) in slowdowns.items():
        assert planned > 0.01, (name, planned)
        assert measured >= planned - SLOWDOWN_TOLERANCE, (name, measured, planned)


def test_a_lower_budget_slows_both_jobs_more(domain: Domain) -> None:
    d = domain
    before_s = dict(d.slowed_s)
    budget_w = 0.75 * sum(d.all_max_w.values()) + d.unmanaged_w
    since_s = d.set_budget(budget_w)
    generation = d.budget()["metadata"]["generation"]
    status = d.wait_for("both jobs re-targeted", lambda: d.retargeted(generation))
    _within_three_windows(d, budget_w, since_s)
    slowdowns = _slowdowns(d, status)
    d.say(f"75 %: budget {budget_w:.1f} W; slowdowns (measured, planned) {slowdowns}; "
          f"iteration {before_s} -> {d.slowed_s} s")  # fmt: skip
    for name, (measured, planned) in slowdowns.items():
        assert measured >= planned - SLOWDOWN_TOLERANCE, (name, measured, planned)
        # Measured, not just planned: each job's iterations take longer than at 85 %.
        assert d.slowed_s[name] > before_s[name] * (1 + SLOWDOWN_TOLERANCE), (name, slowdowns)


def test_an_infeasible_budget_says_by_how_many_watts(domain: Domain) -> None:
    d = domain
    budget_w = 0.4 * sum(d.all_max_w.values()) + d.unmanaged_w
    d.set_budget(budget_w)
    generation = d.budget()["metadata"]["generation"]

    def infeasible() -> dict[str, Any] | None:
        status = d.retargeted(generation)
        if status is None:
            return None
        conditions = {c["type"]: c for c in status["conditions"]}
        return status if conditions["Infeasible"]["status"] == "True" else None

    status = d.wait_for("the budget Infeasible", infeasible)
    conditions = {c["type"]: c for c in status["conditions"]}
    least_w = sum(j["allocatedWatts"] for j in status["jobs"])  # each job at its least power
    missing_w = least_w + status["unmanagedWatts"] - (1 - MARGIN) * budget_w
    d.say(f"40 %: budget {budget_w:.1f} W: {conditions['Infeasible']['message']}; "
          f"least {least_w:.1f} W + unmanaged {status['unmanagedWatts']} W")  # fmt: skip
    assert status["missingWatts"] == pytest.approx(missing_w, abs=1.0)
    assert f"{status['missingWatts']:.0f} W missing" in conditions["Infeasible"]["message"]
    for job in status["jobs"]:  # each at its slowest point, slower than at 75 %
        assert job["slowdownRatio"] > 0.15, job

    # What the rounds decided, as Events on the budget (kubectl describe ppb shows them).
    def infeasible_event() -> list[Any]:
        events = d.events()
        return events if any(e.reason == "Infeasible" for e in events) else []

    events = d.wait_for("the Infeasible event", infeasible_event, timeout_s=30)
    d.say("events: " + "; ".join(f"{e.type} {e.reason}: {e.message}" for e in events))
    reasons = [e.reason for e in events]
    assert {"Resolved", "Retargeted", "Infeasible"} <= set(reasons), reasons
    # One allocation per spec change here: no event repeats itself round after round.
    assert reasons.count("Infeasible") == 1 and reasons.count("Resolved") <= 4, reasons
    [warning] = [e for e in events if e.reason == "Infeasible"]
    assert warning.type == "Warning" and "W missing" in warning.message
    # The backstop (enforcement PlansAndPowerLimits: per-GPU NVML power limits of each GPU's
    # share plus the margin, reset when the budget goes) is checked end to end in
    # tests/e2e/test_power_backstop.py; its limits on these jobs' GPUs would be asserted here.


def test_deleting_one_job_gives_the_other_its_t_min_back(domain: Domain) -> None:
    d = domain
    d.set_budget(0.85 * sum(d.all_max_w.values()) + d.unmanaged_w)
    generation = d.budget()["metadata"]["generation"]
    d.wait_for("both jobs re-targeted", lambda: d.retargeted(generation))
    # job-b's training ends, then its PerseusJob is deleted: its GPUs idle, unmanaged.
    d.trainings.pop("job-b").stop()
    d.cluster.custom.delete_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", "job-b"
    )

    def back() -> dict[str, Any] | None:
        status = d.budget().get("status") or {}
        alone = [j["name"] for j in status.get("jobs", [])] == ["job-a"]
        return status if alone and d.target_s("job-a") is None and d.applied("job-a") else None

    status = d.wait_for("job-a back at T_min", back)
    window = d.measure("job-a")
    d.say(f"job-b gone: job-a {window.iteration_s:.4f} s (T_min {d.t_min_s['job-a']:.4f} s); "
          f"unmanaged {status['unmanagedWatts']} W")  # fmt: skip
    assert status["jobs"][0]["slowdownRatio"] == 0
    assert window.iteration_s <= d.t_min_s["job-a"] * (1 + SLOWDOWN_TOLERANCE)


def test_deleting_the_budget_gives_t_min_back(domain: Domain) -> None:
    d = domain
    unmanaged_w = d.budget()["status"]["unmanagedWatts"]  # job-b's idle GPUs and the idle node
    d.set_budget(0.75 * d.all_max_w["job-a"] + unmanaged_w)
    generation = d.budget()["metadata"]["generation"]
    d.wait_for("job-a slowed again", lambda: d.retargeted(generation) and d.target_s("job-a"))
    d.cluster.custom.delete_cluster_custom_object(
        resources.GROUP, resources.VERSION, BUDGET_PLURAL, BUDGET
    )

    def at_t_min() -> bool:
        plan = d.job("job-a")["status"]["plan"]
        t_min_s = d.job("job-a")["status"]["frontier"]["tMinSeconds"]
        back = d.target_s("job-a") is None and d.applied("job-a") is not None
        return back and math.isclose(plan["targetIterationSeconds"], t_min_s, rel_tol=1e-4)

    d.wait_for("job-a back at T_min once the budget is gone", at_t_min)
    # With PlansAndPowerLimits (tests/e2e/test_power_backstop.py), every GPU's power limit is
    # back at its default here too, once the budget is gone.
