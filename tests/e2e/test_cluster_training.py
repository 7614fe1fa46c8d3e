"""The whole system on a real Kubernetes API server, with emulated GPUs and training.

Set-up (see ``conftest.py`` for the control plane and the chart):

- two Nodes with four emulated GPUs each, following the bundled GPT-3 / A100 profile (its
  first four stages); on each a ``perseus-node-agent`` process in Kubernetes mode, acting as
  the chart's agent service account with a token bound to an agent pod on that node, asking
  a kubelet stand-in on the node (the PodResources v1 gRPC API on a Unix socket) which GPUs
  the training pod was given;
- a PyTorchJob (a stand-in object: no training operator runs here) and its Master and Worker
  pods, one per node, bound to the nodes and marked Running as a kubelet would;
- the training itself: ``python -m perseus_emulation.job``, all 2 x 4 ranks of a
  data-parallel x pipeline-parallel 1F1B job with the real pipeline dependencies, calling
  the node agents through ``perseus_client`` and writing one JSON record per iteration
  (replica times, the GPUs' energy counters);
- ``perseus-operator`` as the chart's operator service account; Prometheus scraping the
  agents and the operator.

The scenarios run in this file's order, on one job, as a user would meet them: profiling
(the operator killed and restarted in the middle), the plan applied, a straggler and its
recovery, a node agent killed, the job deleted; then a Stage-granularity job from a stored
profile with no client hooks; last, the dashboards' queries against the scenario's Prometheus.
"""

from __future__ import annotations

import json
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_api import resources
from perseus_api.job import Granularity, Policy, ScheduleName
from perseus_api.profile import Profile, parse_profile
from perseus_operator.jobs.phase_decisions import profile_config_map_name
from perseus_operator.jobs.planning import PlanningInput, choose_plan, solve_frontier
from perseus_operator.jobs.profile_source import BLOCKING_POWER_KEY, PROFILE_KEY
from perseus_operator.workloads.objects import PYTORCH_CONTAINER
from support.agent_process import Agent
from support.cluster_harness import Cluster, require
from support.dashboard_queries import PromClient, missing_data, poll, prometheus, scrape_jobs
from support.emulated_training import (
    BLOCKING_W,
    GPUS,
    MICROBATCHES,
    REPLICAS,
    STAGES,
    TIME_SCALE,
    TIMEOUT_S,
    Training,
    Window,
)
from support.emulated_training_objects import NAMESPACE, perseus_job, pytorch_job, training_pod
from support.operator_harness import OperatorProcess, cut_profile
from support.prometheus_server import PROMETHEUS

try:  # the agents ask a kubelet stand-in which GPUs each pod owns (needs grpcio, protobuf)
    from support.kubelet_pod_resources import KubeletStandIn, StandInPod
except ImportError:  # pragma: no cover - the test extra installs both
    KubeletStandIn = None  # type: ignore[assignment,misc]


JOB = "gpt3"
KEPT_PROFILE = "gpt3-a100-profile"  # the copy of the measured profile a user keeps
NODES = [f"gpu-node-{i}" for i in range(REPLICAS)]  # one pipeline replica each
SETTLE_ITERATIONS = 2  # after a plan change: the iteration it lands in, and one more
# Iteration time under a plan vs. all GPUs at their highest clock (the measured T_min). Over
# eight runs on this 2-core VM the T_min plan ran +0.05% to +1.56% (median ~0.6%): once the
# plan has used up the slack of the computations off the critical path, the emulation's own
# latencies (hooks, the shared GPU state file, thread wake-ups) land on it, and the all-max
# window is measured before the operator and agents start reporting. 1% failed one run in five.
ITERATION_TOLERANCE = 0.02
# The T_min plan's iteration vs the planner's T_min: at the profile's own times (time scale 1)
# it ran +1.14% to +1.78% over the runs of the issue-13 work (emulation_breakdown.py: +0.6%
# with an ideal agent; the rest hooks and hand-offs), at time scale 0.5 +2.4% to +2.6%; then
# +0.4% to +2.5% in 8 full e2e runs, 2 over 2% (a thread wake-up on every hand-off). With the
# hand-offs started on time (EmulatedJob._wait) and the cluster's processes niced: +0.99% to
# +1.06% in 3 runs with a core busy.
PLANNED_TOLERANCE = 0.02
# Energy saved vs what the planner predicted. While the prediction was the frontier point's
# fitted energy it realized 86.7-96.8 % (84-90 % with a core busy, 88.9 % quiet on the last
# profiling fixes): the exponential fits alone cost 5 points (an ideal agent realized 94-95 %).
# Since the plan's estimate replays its clocks on the profile's rows, an ideal agent realizes
# 99.9 % (emulation_breakdown.py) and the e2e 96.9 % and 100.6 % quiet, 101 % and 108 % with
# a core busy. 0.9, the issue's target, keeps 6.9 points below the lowest of those.
SAVINGS_SHARE = 0.9


# -- the emulated training job ---------------------------------------------------------------


def savings(all_max: Window, planned: Window) -> float:
    """Energy saved per iteration at the same throughput, as the planner predicts it: had every
    GPU stayed at its highest clock, it would have idled at blocking power for the rest of the
    planned iteration."""
    idle_s = max(0.0, planned.iteration_s - all_max.iteration_s)
    baseline_j = all_max.energy_j + STAGES * REPLICAS * BLOCKING_W * idle_s
    return 1 - planned.energy_j / baseline_j


def overheads(window: Window) -> str:
    o = window.overheads
    return (
        f"hooks {o['hook_s'] * 1e3:.2f} ms, {o['clock_changes']:.1f} clock changes mid-"
        f"computation lagging {o['clock_lag_s'] * 1e3:.2f} ms, {o['handoffs']:.0f} hand-offs "
        f"{o['handoff_s'] * 1e3:.2f} ms"
        + (f" ({window.stalled} stalled window(s) set aside before it)" if window.stalled else "")
    )


def profile_accuracy(measured: Profile, blocking_w: float | None) -> tuple[str, float]:
    """How the profile the agents measured differs from the one the emulated GPUs follow (the
    bundled one, times scaled), and the savings the planner predicts from the truth on the
    same clocks: the prediction error that profiling alone makes. A report, and that ratio."""
    truth = parse_profile(cut_profile(STAGES), "truth")
    time_errors, energy_errors = [], []
    rows = ["stage,instruction,frequency,time,energy"]
    for key, m in measured.measurements.items():
        true = truth.measurements[key]
        by_clock = {int(f): (t, e) for f, t, e in zip(*_columns(true), strict=True)}
        for f, t, e in zip(*_columns(m), strict=True):
            true_t, true_e = by_clock[int(f)]
            time_errors.append(t / (true_t * TIME_SCALE) - 1)
            energy_errors.append(e / (true_e * TIME_SCALE) - 1)
            rows.append(f"{key[0]},{key[1]},{int(f)},{true_t * TIME_SCALE},{true_e * TIME_SCALE}")
    frontier = solve_frontier(
        PlanningInput(
            "\n".join(rows) + "\n", "truth", ScheduleName.ONE_F_ONE_B, STAGES, MICROBATCHES,
            BLOCKING_W,
        )
    )  # fmt: skip
    ideal = choose_plan(frontier, Policy(granularity=Granularity.INSTRUCTION))
    report = (
        f"profile vs the emulated GPUs': time error median {statistics.median(time_errors):+.2%} "
        f"(range {min(time_errors):+.2%}..{max(time_errors):+.2%}), energy error median "
        f"{statistics.median(energy_errors):+.2%} (range {min(energy_errors):+.2%}.."
        f"{max(energy_errors):+.2%}), blocking power {blocking_w} W (true {BLOCKING_W} W); "
        f"savings predicted from the truth on these clocks {ideal.estimate.savings_ratio:.2%}"
    )
    return report, ideal.estimate.savings_ratio


def _columns(m: Any) -> tuple[Any, Any, Any]:
    return m.frequencies_mhz, m.times_s, m.energies_j


def measure_plan(
    training: Training, baseline: Window, status: dict[str, Any], label: str
) -> tuple[Window, str]:
    """Measure the plan just applied, once settled, and check it saves at least
    :data:`SAVINGS_SHARE` of what the planner predicted (``status.plan``); the window and a
    report of both."""
    training.wait_iterations(SETTLE_ITERATIONS)
    planned = training.measure()
    predicted = status["plan"]["expectedSavingsRatio"]
    saved = savings(baseline, planned)
    report = (
        f"{label}: all-max {baseline.iteration_s:.4f} s {baseline.energy_j:.1f} J/iteration; "
        f"planned {planned.iteration_s:.4f} s {planned.energy_j:.1f} J/iteration; saved "
        f"{saved:.2%}, predicted {predicted:.2%}; planner T_min "
        f"{status['frontier']['tMinSeconds']:.4f} s; emulation overheads per iteration: "
        f"all-max {overheads(baseline)}; planned {overheads(planned)}"
    )
    print(report)
    assert saved >= SAVINGS_SHARE * predicted, report
    return planned, report


# -- the cluster side ------------------------------------------------------------------------


@dataclass
class Scenario:
    cluster: Cluster
    workdir: Path
    agents: list[Agent]
    operator: OperatorProcess
    prom: PromClient
    training: Training | None = None

    def job(self, name: str = JOB) -> dict[str, Any]:
        job: dict[str, Any] = self.cluster.custom.get_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", name
        )
        return job

    def node_plans(self, job: str = JOB) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.custom.list_namespaced_custom_object(
            resources.GROUP,
            resources.VERSION,
            NAMESPACE,
            resources.NODE_PLAN_PLURAL,
            label_selector=f"{resources.JOB_LABEL}={job}",
        )["items"]
        return items

    def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float = TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            for agent in self.agents:
                if agent.proc is not None and agent.proc.poll() is not None:
                    pytest.fail(f"agent {agent.node} exited waiting for {what}:\n{agent.log}")
            if self.operator.proc.poll() is not None:
                pytest.fail(f"the operator exited waiting for {what}:\n{self.operator.stop()}")
            time.sleep(0.2)
        job = json.dumps(self.job().get("status"), indent=1)
        pytest.fail(
            f"timed out waiting for {what}; job status: {job}\n"
            f"operator output:\n{self.operator.stop()[-15000:]}"
        )

    def applied(self, job: str = JOB) -> int | None:
        """The job's plan revision once every agent reports it applied, else None."""
        status = self.job(job).get("status", {})
        plan = status.get("plan")
        if status.get("phase") != "Running" or plan is None:
            return None
        revision = status["revision"]
        plans = self.node_plans(job)
        done = len(plans) == len(NODES) and all(
            p.get("status", {}).get("observedRevision") == revision for p in plans
        )
        return revision if done else None

    def restart_operator(self) -> str:
        """SIGKILL the operator, as a node failure would, and start another; its output."""
        self.operator.kill()
        out = self.operator.stop()
        self.operator = OperatorProcess(
            self.cluster.operator_kubeconfig, metrics_port=self.operator.metrics_port
        )
        return out


def gpus(agent: Agent) -> EmulatedBackend:
    profile = parse_profile(cut_profile(STAGES), "bundled, 4 stages")
    return EmulatedBackend(
        agent.num_gpus,
        profile,
        blocking_power_w=BLOCKING_W,
        node_name=agent.node,
        state_file=agent.gpu_state,
    )


@pytest.fixture(scope="module")
def scenario(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    if PROMETHEUS is None:
        require("prometheus is not installed (apt-get install prometheus)")
    workdir = tmp_path_factory.mktemp("training")
    stack = ExitStack()
    cluster.plane.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    )
    if KubeletStandIn is None:
        require("grpcio and protobuf are not installed (pip install perseus-k8s[test,agent])")
    agents = []
    for replica_type, node in zip(("master", "worker"), NODES, strict=True):
        cluster.node(node, GPUS)
        (workdir / node).mkdir()
        # Unix socket paths are limited to 108 bytes, which pytest's tmp paths can exceed.
        socket_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="perseus-")))
        # Each node's kubelet gave the training pod all its GPUs, listed in another order
        # than the node's: the agents must map local ranks by the node's GPU order.
        kubelet = stack.enter_context(KubeletStandIn(socket_dir / "kubelet.sock"))
        gpus = [f"GPU-emu-{node}-{i}" for i in reversed(range(GPUS))]
        kubelet.set_pods(
            [StandInPod(NAMESPACE, f"{JOB}-{replica_type}-0", {PYTORCH_CONTAINER: gpus})]
        )
        agents.append(
            Agent(
                workdir / node,
                socket_dir,
                num_gpus=GPUS,
                kubeconfig=cluster.agent_kubeconfig(node),
                node=node,
                log_level="info",
                pod_resources_socket=kubelet.socket_path,
            )
        )
    operator = OperatorProcess(cluster.operator_kubeconfig)
    state: Scenario | None = None
    try:
        for agent in agents:
            agent.start()
        targets = {
            "node-agent": [f"127.0.0.1:{a.port}" for a in agents],
            "operator": operator.metrics_target,
        }
        (workdir / "prometheus").mkdir()
        prom = stack.enter_context(prometheus(workdir / "prometheus", scrape_jobs(targets)))
        state = Scenario(cluster, workdir, agents, operator, prom)
        yield state
    finally:
        if state is not None and state.training is not None:
            state.training.stop()
        for agent in agents:
            agent.kill_if_running()
        (operator if state is None else state.operator).stop()
        stack.close()


# -- scenarios -------------------------------------------------------------------------------


def test_profiling_survives_an_operator_restart_and_the_plan_saves_energy(
    scenario: Scenario,
) -> None:
    s, core = scenario, scenario.cluster.core
    s.training = training = Training(s.workdir, s.agents, hooks=True)
    training.wait_iterations(2)  # warm
    baseline = training.measure()  # every GPU at its maximum clock: no plan yet

    s.cluster.custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", pytorch_job(JOB)
    )
    for replica_type, node in zip(("master", "worker"), NODES, strict=True):
        pod = core.create_namespaced_pod(NAMESPACE, training_pod(JOB, replica_type, node))
        core.patch_namespaced_pod_status(
            pod.metadata.name, NAMESPACE, {"status": {"phase": "Running"}}
        )
    s.cluster.custom.create_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs",
        perseus_job(JOB, JOB, mode="StragglerAware", granularity="Instruction"),
    )  # fmt: skip

    def profiling_started() -> dict[str, int] | None:
        plans = s.node_plans()
        reported = [
            p for p in plans if p["spec"].get("profiling") and p.get("status", {}).get("profiling")
        ]
        rows = [len(g.get("rows", [])) for p in reported for g in p["status"]["profiling"]]
        if len(reported) == len(NODES) and rows and min(rows) > 0:
            return {p["metadata"]["name"]: p["spec"]["revision"] for p in plans}
        return None

    revisions = s.wait_for("the agents' first profiling rows", profiling_started)
    s.restart_operator()

    def planned() -> dict[str, Any] | None:
        for p in s.node_plans():
            # A profiling plan rewritten would restart the sweep and lose what was measured.
            if p["spec"].get("profiling"):
                assert p["spec"]["revision"] == revisions[p["metadata"]["name"]]
        return s.job()["status"] if s.applied() else None

    status = s.wait_for("the plan applied after profiling", planned)
    profile_map = core.read_namespaced_config_map(profile_config_map_name(JOB), NAMESPACE)
    profile = parse_profile(profile_map.data[PROFILE_KEY], "stored")
    assert profile.num_stages == STAGES
    clocks = sorted({int(f) for f in profile.frequencies_mhz})
    # The whole sweep (1050-1410 MHz every 30 MHz), measured before and after the restart.
    assert clocks == list(range(1050, 1411, 30)), clocks
    blocking = profile_map.data.get(BLOCKING_POWER_KEY)
    print(profile_accuracy(profile, None if blocking is None else float(blocking))[0])

    planned, report = measure_plan(training, baseline, status, "Instruction at T_min")
    assert status["plan"]["expectedSavingsRatio"] > 0.03, report
    assert planned.iteration_s == pytest.approx(baseline.iteration_s, rel=ITERATION_TOLERANCE), (
        report
    )
    t_min_s = status["frontier"]["tMinSeconds"]
    assert planned.iteration_s <= t_min_s * (1 + PLANNED_TOLERANCE), report


def test_a_straggler_is_detected_the_other_replica_retargeted_and_recovery_restores_t_min(
    scenario: Scenario,
) -> None:
    s = scenario
    assert s.training is not None, "needs the running job of the first scenario"
    training, slow_node = s.training, NODES[1]
    revision = s.applied()
    assert revision is not None
    fast = training.measure()  # both replicas on the T_min plan
    t_min_s = fast.iteration_s

    for index in range(GPUS):  # e.g. thermal throttling on one node
        gpus(s.agents[1]).set_slowdown(index, 1.2)
    # Replica 0 on the T_min plan, waiting for replica 1; the operator may re-target meanwhile.
    straggling = training.measure(4, steady=False)

    def expected_target_s(status: dict[str, Any]) -> float:
        # T' in planned time (the operator scales the measured slowdown onto the planned
        # T_min), at most T_max, the frontier's slowest point.
        frontier = status["frontier"]
        return float(min(1.2 * frontier["tMinSeconds"], frontier["tMaxSeconds"]))

    def retargeted() -> dict[str, Any] | None:
        # Detection comes while the agents' means still hold iterations from before the
        # slowdown; T' follows (in steps of the re-target tolerance) as they fill.
        status = s.job()["status"]
        target_s = (status.get("plan") or {}).get("targetIterationSeconds", 0.0)
        settled = status.get("stragglers") and abs(target_s / expected_target_s(status) - 1) < 0.03
        return status if settled and (s.applied() or 0) > revision else None

    status = s.wait_for("the straggler detected and the plans re-targeted", retargeted)
    [straggler] = status["stragglers"]
    assert straggler["dataParallelRank"] == 1 and straggler["node"] == slow_node, straggler
    target_s = status["plan"]["targetIterationSeconds"]
    assert target_s == pytest.approx(expected_target_s(status), rel=0.03)
    training.wait_iterations(SETTLE_ITERATIONS)
    slowed = training.measure()
    healthy = NODES[0]
    # Run, the re-targeted plan carries the emulation's own overhead over the profile's
    # times, as the straggler does: it lands near the straggler's wall-clock pace.
    report = (
        f"T_min {t_min_s:.4f} s; straggler {straggling.replica_times_s} s; re-targeted "
        f"{slowed.replica_times_s} s; healthy node {straggling.node_energy_j[healthy]:.1f} -> "
        f"{slowed.node_energy_j[healthy]:.1f} J/iteration; target {target_s:.4f} s (1.2 T_min "
        f"{1.2 * status['frontier']['tMinSeconds']:.4f} s)"
    )
    print(report)
    # The healthy replica now runs slower, most of the way to the straggler's pace but not
    # past it by more than noise, on less energy.
    assert slowed.replica_times_s[0] >= 1.1 * t_min_s, report
    assert slowed.replica_times_s[0] <= slowed.replica_times_s[1] * 1.03, report
    assert slowed.node_energy_j[healthy] < 0.98 * straggling.node_energy_j[healthy], report

    for index in range(GPUS):
        gpus(s.agents[1]).set_slowdown(index, 1.0)
    after = s.applied() or 0

    def recovered() -> dict[str, Any] | None:
        status = s.job()["status"]
        done = not status.get("stragglers") and (s.applied() or 0) > after
        return status if done else None

    status = s.wait_for("the recovery back to the T_min plan", recovered)
    training.wait_iterations(SETTLE_ITERATIONS)
    back = training.measure()
    report = (
        f"recovered: {back.replica_times_s} s, {back.energy_j:.1f} J/iteration; before the "
        f"straggler {fast.replica_times_s} s, {fast.energy_j:.1f} J/iteration; target "
        f"{status['plan']['targetIterationSeconds']:.4f} s, revision {s.applied()}; emulation "
        f"overheads per iteration: before {overheads(fast)}; after {overheads(back)}"
    )
    print(report)
    # Back at the planner's T_min, as the first plan was. Not slower than before the straggler;
    # it may be faster: "before" carries that window's own hand-off and hook times (one run
    # measured 1.654 s before and 1.599 s after, for T_min 1.576 s).
    assert back.iteration_s <= status["frontier"]["tMinSeconds"] * (1 + PLANNED_TOLERANCE), report
    assert back.iteration_s <= t_min_s * (1 + ITERATION_TOLERANCE), report
    assert back.energy_j == pytest.approx(fast.energy_j, rel=0.02), report


def test_the_dashboards_show_the_scenarios_data(scenario: Scenario) -> None:
    """Every query of the chart's dashboards (those not on dcgm-exporter) returns data from the
    Prometheus that scraped the agents and the operator through the scenarios so far: the job
    running its plan after a straggler came and went. The power-budget panels need a
    PerseusPowerBudget, which these scenarios do not have: tests/e2e/test_dashboards.py makes
    one and checks them."""

    def missing() -> list[str]:
        return [
            query
            for query in missing_data(scenario.prom, time.time())
            if "perseus_power_budget_" not in query
        ]

    poll(missing, "the cluster scenarios")


def test_a_killed_agent_comes_back_and_no_gpu_stays_locked_once_the_job_is_deleted(
    scenario: Scenario,
) -> None:
    s = scenario
    assert s.training is not None, "needs the running job of the first scenarios"
    training, agent = s.training, s.agents[0]
    revision = s.applied()
    assert revision is not None
    before = training.measure()

    agent.stop(signal.SIGKILL)  # no reset: its GPUs keep the clocks it locked
    agent.metrics_port = agent.port or 0  # where Prometheus scrapes it
    assert any(clock is not None for clock in agent.clocks())
    restarted_at = datetime.now(tz=UTC)
    agent.start()

    def reapplied() -> bool:
        [plan] = [p for p in s.node_plans() if p["spec"]["node"] == agent.node]
        status = plan.get("status") or {}
        reported = status.get(resources.STATUS_REPORTED_AT)
        fresh = reported is not None and datetime.fromisoformat(reported) > restarted_at
        gpus = status.get("gpus") or []
        return (
            fresh
            and status.get("observedRevision") == revision
            and len(gpus) == GPUS
            and all(g["status"] == "Applied" for g in gpus)
        )

    # Its ranks call in again (they retry every second here) and follow the plan again.
    s.wait_for("the restarted agent to apply the plan again", reapplied)
    training.wait_iterations(SETTLE_ITERATIONS)
    after = training.measure()
    print(f"agent restarted: {before.iteration_s:.4f} -> {after.iteration_s:.4f} s, "
          f"{before.energy_j:.1f} -> {after.energy_j:.1f} J/iteration")  # fmt: skip
    # As fast as the plan runs: at the planner's T_min, and not slower than before the kill
    # (a faster window is no regression; see the recovery test).
    t_min_s = s.job()["status"]["frontier"]["tMinSeconds"]
    assert after.iteration_s <= t_min_s * (1 + PLANNED_TOLERANCE)
    assert after.iteration_s <= before.iteration_s * (1 + ITERATION_TOLERANCE)
    assert after.energy_j == pytest.approx(before.energy_j, rel=0.02)

    # The user keeps a copy of the profile the job measured (the last scenario plans from it):
    # the job's own ConfigMap is owned by the job and goes with it.
    core = s.cluster.core
    measured = core.read_namespaced_config_map(profile_config_map_name(JOB), NAMESPACE)
    core.create_namespaced_config_map(
        NAMESPACE,
        {"metadata": {"name": KEPT_PROFILE}, "data": {"profile.csv": measured.data[PROFILE_KEY]}},
    )
    s.cluster.custom.delete_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", JOB
    )

    def released() -> bool:
        jobs = s.cluster.custom.list_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs"
        )["items"]
        return not jobs and not s.node_plans()

    s.wait_for("the job and its node plans to go", released)

    def profile_collected() -> bool:
        names = {c.metadata.name for c in core.list_namespaced_config_map(NAMESPACE).items}
        return profile_config_map_name(JOB) not in names and KEPT_PROFILE in names

    s.wait_for("the garbage collector to delete the job's profile ConfigMap", profile_collected)
    # The training goes on; with no plan, every GPU is back at its default clocks.
    assert [a.clocks() for a in s.agents] == [[None] * GPUS] * len(s.agents)
    training.wait_iterations(2)
    assert [a.clocks() for a in s.agents] == [[None] * GPUS] * len(s.agents)


def test_stage_granularity_from_a_stored_profile_needs_no_client_hooks(
    scenario: Scenario,
) -> None:
    """The training does not call the agents at all; each GPU is locked at its stage's clock,
    planned from a profile stored in a ConfigMap (no profiling run)."""
    s, core = scenario, scenario.cluster.core
    if s.training is not None:
        s.training.stop()
    s.training = training = Training(s.workdir, s.agents, hooks=False)
    training.wait_iterations(2)
    baseline = training.measure()

    # The profile the first job measured, kept by the user (see the scenario before).
    assert core.read_namespaced_config_map(KEPT_PROFILE, NAMESPACE).data[PROFILE_KEY]
    # Its stages are alike, so at T_min every stage is critical: one clock per stage only pays
    # with some slack, here up to 5% longer iterations.
    job = perseus_job("gpt3-stage", JOB, mode="Intrinsic", granularity="Stage", maxSlowdown=0.05)
    job["spec"]["profiling"]["profileRef"] = {"configMapName": KEPT_PROFILE}
    s.cluster.custom.create_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", job
    )
    s.wait_for("the Stage plan applied", lambda: s.applied("gpt3-stage"))
    status = s.job("gpt3-stage")["status"]
    assert status["granularity"] == "Stage"
    for plan in s.node_plans("gpt3-stage"):
        spec = plan["spec"]
        [agent] = [a for a in s.agents if a.node == spec["node"]]
        # One pod per node holding all its GPUs: local rank r runs on the node's r-th GPU.
        stage_clock = {
            a["localRank"]: spec["plans"][a["plan"]]["stages"][a["stage"]]["frequencyMHz"]
            for a in spec["assignments"]
        }
        assert agent.clocks() == [stage_clock[i] for i in range(GPUS)], spec["node"]
        assert min(stage_clock.values()) < 1410, stage_clock

    planned, report = measure_plan(training, baseline, status, "Stage, no hooks")
    assert status["plan"]["expectedSavingsRatio"] > 0.01, report
    assert planned.iteration_s <= baseline.iteration_s * 1.05 * (1 + ITERATION_TOLERANCE), report
