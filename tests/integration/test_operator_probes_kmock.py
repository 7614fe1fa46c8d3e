"""Both operator replicas Ready under a kubelet's probes, and a rolling update that finishes.

The chart is rendered; its operator Deployment's container (command line, environment, ports
and probes, as rendered) runs as real ``perseus-operator`` processes, one per "pod", against
kmock's Kubernetes API (the Lease included); a kubelet-like prober
(:mod:`support.kubelet_prober`) runs the container's own startup, liveness and readiness probes
against each. KWOK, the project's fake kubelet, runs no probes (its pods' conditions are
staged), and no real kubelet runs here: the Deployment controller's rolling update is
simulated from the rendered strategy (``maxSurge``/``maxUnavailable``), driven by the prober's
readiness, as the ReplicaSet controller would (a surge pod first; an old pod goes only once the
new one is Ready; the most recently Ready old pod first).

Before the fix the standby answered no probe (kopf's liveness endpoint and the metrics server
started with the Lease): its startup probe failed out and the rollout waited for ever.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.agent_process import REPO_ROOT, source_env
from support.helm_render import NAMESPACE, render
from support.kmock_server import KmockServer
from support.kubelet_prober import Prober
from support.operator_harness import RESOURCES, free_port

LEASES = "coordination.k8s.io/v1/leases"
KMOCK_RESOURCES = {
    **RESOURCES,
    LEASES: {
        "kind": "Lease",
        "singular": "lease",
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch", "update", "delete"},
    },
}
READY_TIMEOUT_S = 120.0
"""A new replica Ready: imports (seconds, on 2 loaded cores), then the startup probe's next
period (5 s) and the readiness probe's first run; a takeover adds kopf's start."""


def operator_container() -> tuple[dict[str, Any], dict[str, Any]]:
    """The rendered operator Deployment and its container (no webhook: no certificate here)."""
    deployment = render({"injection": {"enabled": False}}).one("Deployment", "-operator")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


class Pod:
    """One replica: the container's process, with its ports mapped to free local ones."""

    def __init__(self, name: str, container: dict[str, Any], kubeconfig: Path, tmp: Path) -> None:
        self.name = name
        self.port_map = {int(p["containerPort"]): free_port() for p in container["ports"]}
        args = [self._local(a) for a in container["args"]]
        env = {**source_env(), "PERSEUS_OPERATOR_KUBECONFIG": str(kubeconfig)}
        env.pop("KUBECONFIG", None)
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = self._local(var["value"])
            elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
                env[var["name"]] = name
            else:
                raise AssertionError(f"env {var['name']}: unsupported source {var['valueFrom']}")
        env["PERSEUS_OPERATOR_METRICS_ADDRESS"] = "127.0.0.1"
        env["NUMBA_CACHE_DIR"] = str(tmp / "numba")
        env["MPLCONFIGDIR"] = str(tmp / "matplotlib")
        assert container["command"] == ["perseus-operator"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "perseus_operator.main", *args],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.prober = Prober(container, self.port_map).start()
        self.output = ""

    def _local(self, value: str) -> str:
        """A rendered argument or value with its ports mapped and addresses on loopback."""
        value = value.replace("0.0.0.0", "127.0.0.1")
        for port, local in self.port_map.items():
            if value == str(port):
                return str(local)
            value = re.sub(rf":{port}\b", f":{local}", value)
        return value

    def metrics(self, container: dict[str, Any]) -> str:
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "metrics"]
        url = f"http://127.0.0.1:{self.port_map[port]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def terminate(self, grace_s: float) -> None:
        """What the kubelet does to a deleted pod: SIGTERM, SIGKILL after the grace period."""
        self.prober.stop()
        if self.output or self.proc.stdout is None or self.proc.stdout.closed:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.output, _ = self.proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                import os

                os.killpg(self.proc.pid, signal.SIGKILL)
            self.output, _ = self.proc.communicate(timeout=5)

    def describe(self) -> str:
        probes = "\n".join(f"  {t:7.2f} {k:9} {ok!s:5} {d}" for t, k, ok, d in self.prober.log)
        return f"--- {self.name}: restarts {self.prober.restarts}\n{probes}\n{self.output[-4000:]}"


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def lease_holder(server: KmockServer) -> str:
    lease = server.objects(LEASES).get((NAMESPACE, "perseus-operator")) or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[KmockServer, Path]]:
    with KmockServer(KMOCK_RESOURCES) as server:
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)


def wait_ready(pods: list[Pod], what: str) -> float:
    """Seconds until every pod is Ready; fails with their probe logs on time-out or restart."""
    start = time.monotonic()
    while time.monotonic() - start < READY_TIMEOUT_S:
        restarted = [p for p in pods if p.prober.restarts]
        exited = [p for p in pods if p.proc.poll() is not None]
        if restarted or exited:
            break
        if all(p.prober.ready for p in pods):
            return time.monotonic() - start
        time.sleep(0.1)
    for pod in pods:
        pod.terminate(5)
    pytest.fail(f"{what}: not all Ready\n" + "\n".join(p.describe() for p in pods))


def test_both_replicas_are_ready_and_a_rolling_update_finishes(
    cluster: tuple[KmockServer, Path], tmp_path: Path
) -> None:
    server, kubeconfig = cluster
    deployment, container = operator_container()
    spec = deployment["spec"]
    replicas = spec["replicas"]
    surge = spec["strategy"]["rollingUpdate"]["maxSurge"]
    unavailable = spec["strategy"]["rollingUpdate"]["maxUnavailable"]
    grace_s = float(spec["template"]["spec"].get("terminationGracePeriodSeconds", 30))
    assert (replicas, surge, unavailable) == (2, 1, 0)  # the chart's defaults, as simulated
    names = iter(f"perseus-operator-{suffix}" for suffix in "abcdefgh")
    old = [Pod(next(names), container, kubeconfig, tmp_path) for _ in range(replicas)]
    new: list[Pod] = []
    try:
        first_ready_s = wait_ready(old, "the first two replicas")
        holder = lease_holder(server)
        assert holder in {p.name for p in old}
        for pod in old:
            text = pod.metrics(container)
            leading = pod.name == holder
            assert metric(text, "perseus_operator_leader") == (1.0 if leading else 0.0), pod.name
            assert metric(text, "perseus_operator_build_info") == 1.0
            assert metric(text, "process_resident_memory_bytes")
            # The handlers' series only where kopf runs: the leader.
            assert (metric(text, "perseus_jobs") is not None) == leading, pod.name
        # The rolling update: one surge pod at a time (maxSurge 1), an old pod deleted only
        # once the new one is Ready (maxUnavailable 0), the most recently Ready old one first.
        steps = []
        while old:
            pod = Pod(next(names), container, kubeconfig, tmp_path)
            new.append(pod)
            ready_s = wait_ready([*new, *old], f"surge pod {pod.name}")
            victim = max(old, key=lambda p: p.prober.ready_since or 0.0)
            old.remove(victim)
            victim.terminate(grace_s)
            steps.append((pod.name, round(ready_s, 1), victim.name))
            assert not victim.prober.restarts, victim.describe()
        settled_s = wait_ready(new, "the new replicas after the rollout")
        # The last old pod may have led: it gives the Lease up as it stops, and a new replica
        # takes it at its next attempt, a moment after both are Ready (standbys are Ready).
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            holder_after = lease_holder(server)
            leaders = [metric(p.metrics(container), "perseus_operator_leader") for p in new]
            if holder_after in {p.name for p in new} and sorted(leaders) == [0.0, 1.0]:
                break
            assert time.monotonic() < deadline, (holder_after, leaders)
            time.sleep(0.2)
        print(
            f"\nfirst replicas Ready in {first_ready_s:.1f} s (leader {holder}); rollout "
            f"(new pod, s to Ready, old pod deleted): {steps}; settled {settled_s:.1f} s; "
            f"leader after: {holder_after}"
        )
    finally:
        for pod in [*old, *new]:
            pod.terminate(10)
    for pod in new:
        assert not pod.prober.restarts, pod.describe()
