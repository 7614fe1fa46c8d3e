"""The operator as a process against kmock's Kubernetes API, with simulated node agents.

Shared by the operator's integration test and the dashboards' end-to-end test:

- :data:`RESOURCES`: what kmock must declare for kopf (which waits for the discovery of
  namespaces, events and CRDs) and for the Perseus resources;
- :class:`OperatorProcess`: ``python -m perseus_operator.main`` on a kubeconfig, with its
  metrics and liveness ports;
- :class:`SimulatedAgents`: every node's agent, played by a thread that writes node plan
  statuses: profiles while profiling, then the revision applied and per-rank iteration times;
- builders of pods (kind ``Pods`` workloads) and PerseusJobs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

import kubernetes
import pytest

from perseus_api import resources
from perseus_api.node_report import (
    GpuProfilingReport,
    GpuReport,
    GpuStatus,
    NodePlanStatus,
    ProfileRow,
    RankReport,
    StatusCondition,
    status_document,
)
from perseus_api.profile import Profile, parse_profile
from perseus_operator.jobs.running_decisions import expected_iteration_s
from perseus_planner import DEFAULT_PROFILE, bundled_profile
from support.agent_process import REPO_ROOT, source_env
from support.image_process import image_command, kubeconfig_files

JOBS = f"{resources.GROUP}/{resources.VERSION}/perseusjobs"
PLANS = f"{resources.GROUP}/{resources.VERSION}/{resources.NODE_PLAN_PLURAL}"
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
TIMEOUT_S = 60.0

RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {
        "kind": "Namespace",
        "singular": "namespace",
        "namespaced": False,
        "verbs": VERBS,
    },
    "v1/events": {"kind": "Event", "singular": "event", "namespaced": True, "verbs": VERBS},
    # Watched by the operator's pod index.
    "v1/pods": {"kind": "Pod", "singular": "pod", "namespaced": True, "verbs": VERBS},
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
    """The bundled GPT-3 / A100 profile, first ``stages`` stages."""
    lines = bundled_profile(DEFAULT_PROFILE).path.read_text().strip().splitlines()
    column = lines[0].split(",").index("stage")
    return "\n".join([lines[0], *(x for x in lines[1:] if int(x.split(",")[column]) < stages)])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class OperatorProcess:
    """``perseus-operator`` as a process; ``stop()`` returns its output."""

    def __init__(
        self,
        kubeconfig: Path,
        *,
        reconcile_interval_s: float = 0.5,
        metrics_port: int = 0,
        policy_interval_s: float = 15.0,
        extra_env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        image: Mapping[str, Any] | None = None,
        scratch: Path | None = None,
    ) -> None:
        """``image``: run the built image's entrypoint from its root filesystem
        (support.image_process), with ``scratch`` an empty folder for its mounts; by default
        ``python -m perseus_operator.main`` from the sources."""
        self.metrics_port = metrics_port or free_port()
        self.liveness_port = free_port()
        settings = {
            "PERSEUS_OPERATOR_KUBECONFIG": str(kubeconfig),
            "PERSEUS_OPERATOR_RECONCILE_INTERVAL_S": str(reconcile_interval_s),
            "PERSEUS_OPERATOR_METRICS_PORT": str(self.metrics_port),
            "PERSEUS_OPERATOR_METRICS_ADDRESS": "127.0.0.1",
            "PERSEUS_OPERATOR_RELEASE_TIMEOUT_S": "20",
            "PERSEUS_OPERATOR_POLICY_INTERVAL_S": str(policy_interval_s),
            **(extra_env or {}),
        }
        liveness = f"http://127.0.0.1:{self.liveness_port}/healthz"
        if image is None:
            argv = [sys.executable, "-m", "perseus_operator.main", "--liveness", liveness, *args]
            env = {**source_env(), **settings}
            env.pop("KUBECONFIG", None)
        else:
            assert scratch is not None, "an image needs a scratch folder"
            argv, env = image_command(
                image,
                ["--liveness", liveness, *args],
                scratch=scratch,
                env=settings,
                shared=kubeconfig_files(kubeconfig),
            )
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its planner worker processes go with it (kill)
        )

    @property
    def metrics_target(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    def stop(self) -> str:
        """Stop the operator (SIGTERM, then SIGKILL) and return everything it printed."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()
            out, _ = self.proc.communicate(timeout=5)
        return out or ""

    def kill(self) -> None:
        """SIGKILL the operator and its planner workers, as losing its node would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float = TIMEOUT_S) -> Any:
        """``check()``'s first truthy value; fails with the operator's output on time-out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        out = self.stop()
        pytest.fail(f"timed out waiting for {what}; operator output:\n{out[-20000:]}")


# kopf logs its own request retries at ERROR. After SIGTERM it closes its API sessions while
# its resource discovery (one request per API group of the indexed workload kinds) may still
# be in flight: those requests fail with "Connector is closed" and are logged, harmlessly, as
# retries (reproduced: 1 stop in 10 under load, 60 ms after start-up).
_SHUTDOWN_RETRY = re.compile(
    r" ERROR kopf\._core\.reactor\.observation: Request attempt #\d+/\d+ failed"
)


def operator_problems(log: str) -> list[str]:
    """The ERROR and Traceback lines of an operator's output, less kopf's retries of its
    discovery requests after the operator was told to stop."""
    problems, stopping = [], False
    for line in log.splitlines():
        stopping = stopping or "Operator is stopping" in line
        if stopping and _SHUTDOWN_RETRY.search(line):
            continue
        if " ERROR " in line or "Traceback" in line:
            problems.append(line)
    return problems


class ReportLoop:
    """Agents' status reports from a background thread: :meth:`_report_all` every
    ``period_s`` while the context is entered; an error other than a plan deleted between
    the list and the patch stops the loop and lands in :attr:`errors` for the test."""

    period_s: float

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _report_all(self) -> None:
        raise NotImplementedError

    def _after_round(self) -> None:
        """Called after each round of reports."""

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._report_all()
            except kubernetes.client.ApiException:
                pass  # a plan deleted between the list and the patch
            except BaseException as exc:  # surfaced by the test
                self.errors.append(exc)
                return
            self._after_round()
            time.sleep(self.period_s)


class SimulatedAgents(ReportLoop):
    """Every node's agent, played by a thread: for the node plans of ``jobs`` (all when None)
    in ``namespace`` it reports profiles while profiling, then the revision it applied and each
    rank's mean iteration time: ``t_min_s[job]`` times the replica's factor in ``slow``."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        profile: Profile,
        *,
        jobs: Collection[str] | None = None,
        period_s: float = 0.2,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.profile = profile
        self.jobs = None if jobs is None else set(jobs)
        self.period_s = period_s
        self.t_min_s: dict[str, float] = {}
        self.slow: dict[int, float] = {}
        self.iterations = 100
        self.gpu_watts: float | None = None
        """When set, each running plan's GPUs are reported too, every one drawing this many
        watts (its energy counter grows with the wall clock), as the power budgets read it."""
        self._started_s = time.monotonic()
        super().__init__()

    def _after_round(self) -> None:
        self.iterations += 1

    def _report_all(self) -> None:
        plans = self.api.list_namespaced_custom_object(
            resources.GROUP, resources.VERSION, self.namespace, resources.NODE_PLAN_PLURAL
        )["items"]
        fastest_s: dict[str, float] = {}  # per job: a re-targeted replica runs slower
        for obj in plans:
            for seconds in expected_iteration_s(obj).values():
                job = obj["spec"]["job"]
                fastest_s[job] = min(seconds, fastest_s.get(job, seconds))
        for obj in plans:
            spec = obj["spec"]
            if self.jobs is not None and spec["job"] not in self.jobs:
                continue
            t_min_s = self.t_min_s.get(spec["job"])
            profiling: list[GpuProfilingReport] = []
            ranks: list[RankReport] = []
            if spec.get("profiling"):
                profiling = [profiled_report(a, self.profile) for a in spec["assignments"]]
            elif t_min_s is not None:
                expected = expected_iteration_s(obj)
                for a in spec["assignments"]:
                    time_s = t_min_s * self.slow.get(a["dpRank"], 1.0)
                    if a["rank"] in expected:
                        time_s *= expected[a["rank"]] / fastest_s[spec["job"]]
                    ranks.append(
                        RankReport(
                            rank=a["rank"],
                            dp_rank=a["dpRank"],
                            pp_rank=a["stage"],
                            iterations=self.iterations,
                            last_iteration_s=time_s,
                            mean_iteration_s=time_s,
                            revision=spec["revision"],
                        )
                    )
            status = agent_status(spec["revision"], ranks=ranks, profiling=profiling)
            if self.gpu_watts is not None and t_min_s is not None and not spec.get("profiling"):
                energy_j = self.gpu_watts * (time.monotonic() - self._started_s)
                status["gpus"] = [
                    GpuReport(
                        uuid=f"GPU-{spec['node']}-{position}",
                        index=a.get("gpuIndex"),
                        plan=a["plan"],
                        stage=a["stage"],
                        dp_rank=a["dpRank"],
                        rank=a["rank"],
                        status=GpuStatus.APPLIED,
                        energy_j=energy_j,
                    ).model_dump(mode="json", by_alias=True, exclude_none=True)
                    for position, a in enumerate(spec["assignments"])
                ]
            self.api.patch_namespaced_custom_object_status(
                resources.GROUP,
                resources.VERSION,
                self.namespace,
                resources.NODE_PLAN_PLURAL,
                obj["metadata"]["name"],
                {"status": status},
            )


def agent_status(
    revision: int,
    *,
    ranks: Sequence[RankReport] = (),
    profiling: Sequence[GpuProfilingReport] = (),
    reported_at: str | None = None,
    legacy: bool = False,
) -> dict[str, Any]:
    """The status a node agent writes for a plan at ``revision`` it applied (built from the
    models, as the agent does). ``legacy``: as agents before perseus_api.node_report wrote it,
    the report's keys in snake_case (an operator must read both during a rolling upgrade)."""
    status = NodePlanStatus(
        observed_revision=revision,
        reported_at=reported_at or datetime.now(tz=UTC).isoformat(timespec="milliseconds"),
        conditions=[StatusCondition(type="Applied", status="True", reason="Applied")],
        ranks=list(ranks),
        profiling=list(profiling),
    )
    if not legacy:
        return {k: v for k, v in status_document(status).items() if v is not None}
    return {
        "observedRevision": revision,
        "reportedAt": status.reported_at,
        "conditions": [c.model_dump(mode="json", by_alias=True) for c in status.conditions],
        "ranks": [r.model_dump(mode="json") for r in ranks],
        "profiling": [p.model_dump(mode="json") for p in profiling],
    }


def profiled_report(assignment: Mapping[str, Any], profile: Profile) -> GpuProfilingReport:
    """A finished profiling report of the assignment's GPU: the profile's rows of its stage."""
    stage = assignment["stage"]
    rows = []
    for name in ("forward", "backward"):
        m = profile.get(stage, name)
        for clock, t, e in zip(m.frequencies_mhz, m.times_s, m.energies_j, strict=True):
            rows.append(
                ProfileRow(
                    stage=stage,
                    instruction=name,
                    frequency_mhz=int(clock),
                    time_s=float(t),
                    energy_j=float(e),
                    samples=2,
                )
            )
    clocks = sorted({r.frequency_mhz for r in rows}, reverse=True)
    index = assignment["localRank"]  # as if the kubelet gave each pod GPUs 0..n-1
    return GpuProfilingReport(
        uuid=f"GPU-{assignment.get('pod')}-{index}",
        index=index,
        stage=stage,
        rank=assignment["rank"],
        frequencies_mhz=clocks,
        applied_mhz=list(clocks),
        frequency_index=len(clocks),
        measured_iterations=2 * len(clocks),
        dropped_iterations=0,
        done=True,
        rows=rows,
        blocking_power_w=80.0,
        blocking_s=1.0,
    )


def profiled(assignment: Mapping[str, Any], profile: Profile) -> dict[str, Any]:
    """:func:`profiled_report` as the agent writes it in ``status.profiling``."""
    return profiled_report(assignment, profile).model_dump(mode="json", by_alias=True)


def pod(app: str, index: int, namespace: str, gpus: int) -> dict[str, Any]:
    """Pod ``<app>-<index>`` on node ``<app>-node-<index>``, node rank from its environment."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{app}-{index}", "namespace": namespace, "labels": {"app": app}},
        "spec": {
            "nodeName": f"{app}-node-{index}",
            "containers": [
                {
                    "name": "trainer",
                    "image": "trainer",
                    "env": [{"name": "JOB_COMPLETION_INDEX", "value": str(index)}],
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
        "status": {"phase": "Running"},
    }


def perseus_job(
    name: str, namespace: str, app: str, *, stages: int, dp: int, microbatches: int
) -> dict[str, Any]:
    """A PerseusJob over the pods labelled ``app=<app>``, quick to profile and to react."""
    return {
        "apiVersion": resources.API_VERSION,
        "kind": "PerseusJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "workload": {"kind": "Pods", "podSelector": {"matchLabels": {"app": app}}},
            "parallelism": {
                "pipelineStages": stages,
                "dataParallel": dp,
                "microbatches": microbatches,
            },
            "policy": {"blockingPowerWatts": 83.64},
            "profiling": {"iterationsPerFrequency": 2, "warmupIterations": 1},
            "stragglers": {"persistenceReports": 2, "warmupIterations": 0},
        },
    }


def profile_of(stages: int) -> Profile:
    return parse_profile(cut_profile(stages), f"bundled, {stages} stages")
