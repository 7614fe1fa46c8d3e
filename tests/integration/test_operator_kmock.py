"""The operator process (``python -m perseus_operator.main``) against kmock's Kubernetes API:
create → profile (agents simulated) → optimize → plans written → straggler → re-target →
recover → delete with reset. A second job that cannot be planned is reported and does not
disturb the first."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from agent_process import REPO_ROOT, source_env
from kmock_server import KmockServer
from malformed_jobs import MALFORMED, malformed
from perseus_api import resources
from perseus_api.profile import parse_profile
from perseus_planner import DEFAULT_PROFILE, bundled_profile

NS = "ml"
STAGES, DP, MICROBATCHES, GPUS_PER_POD = 4, 2, 8, 4
JOBS = f"{resources.GROUP}/{resources.VERSION}/perseusjobs"
PLANS = f"{resources.GROUP}/{resources.VERSION}/{resources.NODE_PLAN_PLURAL}"
TIMEOUT_S = 60.0
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}

RESOURCES: dict[str, dict[str, Any]] = {
    # kopf waits for the discovery of namespaces, events and CRDs (to notice new resources).
    "v1/namespaces": {
        "kind": "Namespace",
        "singular": "namespace",
        "namespaced": False,
        "verbs": VERBS,
    },
    "v1/events": {"kind": "Event", "singular": "event", "namespaced": True, "verbs": VERBS},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "singular": "customresourcedefinition",
        "namespaced": False,
        "verbs": VERBS,
    },
    JOBS: {
        "kind": "PerseusJob",
        "singular": "perseusjob",
        "namespaced": True,
        "shortnames": {"pj"},
        "subresources": {"status"},
        "verbs": VERBS,
    },
    PLANS: {
        "kind": resources.NODE_PLAN_KIND,
        "singular": resources.NODE_PLAN_SINGULAR,
        "namespaced": True,
        "subresources": {"status"},
        "verbs": VERBS,
    },
}


def cut_profile(stages: int) -> str:
    lines = bundled_profile(DEFAULT_PROFILE).path.read_text().strip().splitlines()
    column = lines[0].split(",").index("stage")
    return "\n".join([lines[0], *(x for x in lines[1:] if int(x.split(",")[column]) < stages)])


PROFILE = parse_profile(cut_profile(STAGES), "cut")


def wait_for(what: str, check: Callable[[], Any], proc: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        proc.terminate()
    out = proc.communicate(timeout=20)[0]
    pytest.fail(f"timed out waiting for {what}; operator output:\n{out[-20000:]}")


class Agents:
    """Every node's agent, simulated: reports profiles while profiling, then iteration times
    (each replica at ``t_min_s`` times its factor) and the revision it applied."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.t_min_s: float | None = None
        self.slow: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.errors: list[BaseException] = []

    def __enter__(self) -> Agents:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(5)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._report_all()
            except kubernetes.client.ApiException:
                pass  # a plan deleted between the list and the patch
            except BaseException as exc:  # surfaced by the test
                self.errors.append(exc)
                return
            time.sleep(0.2)

    def _report_all(self) -> None:
        plans = self.api.list_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NS, resources.NODE_PLAN_PLURAL
        )["items"]
        for obj in plans:
            spec = obj["spec"]
            status: dict[str, Any] = {
                "observedRevision": spec["revision"],
                "reportedAt": datetime.now(tz=UTC).isoformat(timespec="milliseconds"),
                "conditions": [{"type": "Applied", "status": "True", "reason": "Applied"}],
            }
            if spec.get("profiling"):
                status["profiling"] = [profiled(a) for a in spec["assignments"]]
            elif self.t_min_s is not None:
                status["ranks"] = [
                    {
                        "rank": a["rank"],
                        "dp_rank": a["dp_rank"],
                        "pp_rank": a["stage"],
                        "iterations": 100,
                        "last_iteration_s": self.t_min_s * self.slow.get(a["dp_rank"], 1.0),
                        "mean_iteration_s": self.t_min_s * self.slow.get(a["dp_rank"], 1.0),
                    }
                    for a in spec["assignments"]
                ]
            self.api.patch_namespaced_custom_object_status(
                resources.GROUP,
                resources.VERSION,
                NS,
                resources.NODE_PLAN_PLURAL,
                obj["metadata"]["name"],
                {"status": status},
            )


def profiled(assignment: dict[str, Any]) -> dict[str, Any]:
    stage = assignment["stage"]
    rows = []
    for name in ("forward", "backward"):
        m = PROFILE.get(stage, name)
        for clock, t, e in zip(m.frequencies_mhz, m.times_s, m.energies_j, strict=True):
            rows.append(
                {
                    "stage": stage,
                    "instruction": name,
                    "frequency_mhz": int(clock),
                    "time_s": float(t),
                    "energy_j": float(e),
                    "samples": 2,
                }
            )
    return {
        "stage": stage,
        "index": assignment["gpu_index"],
        "done": True,
        "rows": rows,
        "blocking_power_w": 80.0,
        "blocking_s": 1.0,
    }


def pod(index: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"gpt3-{index}", "namespace": NS, "labels": {"app": "gpt3"}},
        "spec": {
            "nodeName": f"node-{index}",
            "containers": [
                {
                    "name": "trainer",
                    "image": "trainer",
                    "env": [{"name": "JOB_COMPLETION_INDEX", "value": str(index)}],
                    "resources": {"limits": {"nvidia.com/gpu": str(GPUS_PER_POD)}},
                }
            ],
        },
        "status": {"phase": "Running"},
    }


def perseus_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": resources.API_VERSION,
        "kind": "PerseusJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "workload": {"kind": "Pods", "podSelector": {"matchLabels": {"app": "gpt3"}}},
            "parallelism": {"pipelineStages": STAGES, "dataParallel": DP, "microbatches": 8},
            "policy": {"blockingPowerWatts": 83.64},
            "profiling": {"iterationsPerFrequency": 2, "warmupIterations": 1},
            "stragglers": {"persistenceReports": 2, "warmupIterations": 0},
        },
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[KmockServer, Path]]:
    with KmockServer(RESOURCES) as server:
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


PORTS: dict[str, int] = {}


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except (OSError, urllib.error.URLError):
        return 0, ""


def metric(text: str, line_start: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def operator_process(
    cluster: tuple[KmockServer, Path], tmp_path: Path
) -> Iterator[subprocess.Popen[str]]:
    _, kubeconfig = cluster
    PORTS.update(metrics=free_port(), liveness=free_port())
    env = {
        **source_env(),
        "PERSEUS_OPERATOR_KUBECONFIG": str(kubeconfig),
        "PERSEUS_OPERATOR_RECONCILE_INTERVAL_S": "0.5",
        "PERSEUS_OPERATOR_METRICS_PORT": str(PORTS["metrics"]),
        "PERSEUS_OPERATOR_METRICS_ADDRESS": "127.0.0.1",
        "PERSEUS_OPERATOR_RELEASE_TIMEOUT_S": "20",
    }
    env.pop("KUBECONFIG", None)
    liveness = f"http://127.0.0.1:{PORTS['liveness']}/healthz"
    proc = subprocess.Popen(
        [sys.executable, "-m", "perseus_operator.main", "--liveness", liveness],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield proc
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def test_operator_runs_a_job_through_its_life(
    cluster: tuple[KmockServer, Path], operator_process: subprocess.Popen[str]
) -> None:
    server, kubeconfig = cluster
    client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    proc = operator_process
    for index in range(2):
        core.create_namespaced_pod(NS, pod(index))

    def job(name: str = "gpt3") -> dict[str, Any]:
        return server.objects(JOBS).get((NS, name)) or {}

    def plans() -> dict[str, dict[str, Any]]:
        return {name: obj["spec"] for (_, name), obj in server.objects(PLANS).items()}

    def plan_of_replicas() -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for spec in plans().values():
            for a in spec["assignments"]:
                out.setdefault(a["dp_rank"], set()).add(a["plan"])
        return out

    custom.create_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NS, "perseusjobs", perseus_job("gpt3")
    )
    # Malformed jobs (the in-memory API does not apply the CRD's schema): each is reported
    # precisely, and the good job goes on.
    for case, mutation, _, _ in MALFORMED:
        bad = perseus_job(f"bad-{case}")
        bad["spec"] = malformed(bad["spec"], mutation)
        custom.create_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NS, "perseusjobs", bad
        )
    with Agents(custom) as agents:
        wait_for(
            "the profiling plans",
            lambda: len(plans()) == 2 and all(p.get("profiling") for p in plans().values()),
            proc,
        )
        status = wait_for(
            "Running",
            lambda: job().get("status", {}).get("phase") == "Running" and job()["status"],
            proc,
        )
        for case, _, phase, message in MALFORMED:
            verdict = wait_for(
                f"{case}'s verdict", lambda c=case: job(f"bad-{c}").get("status"), proc
            )
            assert verdict["phase"] == phase, case
            assert message in verdict["message"], (case, verdict["message"])

        assert server.objects("v1/configmaps").get((NS, "gpt3-profile")) is not None
        assert plan_of_replicas() == {0: {"tmin"}, 1: {"tmin"}}
        t_min = status["frontier"]["tMinSeconds"]
        assert status["plan"]["targetIterationSeconds"] == pytest.approx(t_min)
        agents.t_min_s = t_min
        wait_for(
            "PlanApplied",
            lambda: any(
                c["type"] == "PlanApplied" and c["status"] == "True"
                for c in job()["status"].get("conditions", [])
            ),
            proc,
        )

        agents.slow = {1: 1.2}
        wait_for("the straggler", lambda: job()["status"].get("stragglers"), proc)
        wait_for("re-targeted plans", lambda: plan_of_replicas().get(0) == {"retargeted"}, proc)
        assert plan_of_replicas()[1] == {"tmin"}

        agents.slow = {}
        wait_for("the recovery", lambda: plan_of_replicas() == {0: {"tmin"}, 1: {"tmin"}}, proc)
        wait_for("the status to follow", lambda: job()["status"]["stragglers"] == [], proc)

        # The operator's own endpoints.
        assert get(PORTS["liveness"], "/healthz")[0] == 200
        status_code, text = get(PORTS["metrics"], "/metrics")
        assert status_code == 200
        assert metric(text, 'perseus_jobs{phase="Running"}') == 1.0
        assert metric(text, 'perseus_jobs{phase="Failed"}') == sum(
            1 for _, _, phase, _ in MALFORMED if phase == "Failed"
        )
        assert metric(text, 'perseus_straggler_events_total{job="gpt3",namespace="ml"}') == 1.0
        saved = metric(text, 'perseus_job_expected_savings_ratio{job="gpt3",namespace="ml"}')
        assert saved is not None and 0 < saved < 0.5
        assert (metric(text, "perseus_planner_seconds_count") or 0) >= 1

        custom.delete_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NS, "perseusjobs", "gpt3"
        )
        wait_for("the job to go", lambda: not job(), proc)
        assert plans() == {}  # emptied, confirmed by the agents, then deleted
        assert not agents.errors

    events = [
        e for e in server.objects("v1/events").values() if e["involvedObject"]["name"] == "gpt3"
    ]
    reasons = {e["reason"] for e in events}
    assert {
        "Phase",
        "Profiled",
        "PlanWritten",
        "StragglerDetected",
        "StragglerRecovered",
    } <= reasons
    proc.terminate()
    log = proc.communicate(timeout=20)[0]
    problems = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not problems, log
