"""GPU driver upgrades (issue 17, item 2): while the GPU Operator's upgrade state label of the
node says the driver is being replaced, the agent resets its clocks, releases NVML, says so in
its plans' status and its metrics, and takes the GPUs back afterwards.

The decision is pure (:mod:`perseus_agent.modes.driver_upgrade`); the release is checked through the
real nvidia-ml-py bindings on the emulated ``libnvidia-ml.so.1``
(``tests/support/fake_nvml.py``), and
end to end with the real agent process (NVML backend on that library) against an emulated API
server (kmock) holding the Node and the PerseusNodePlans.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.modes.driver_upgrade import (
    HOLD_STATES,
    RELEASE_STATES,
    UPGRADE_STATE_LABEL,
    releases_gpus,
)
from perseus_api import resources
from perseus_api.node_plan import NodePlan
from support.factories import pipeline_plan_fields
from support.fake_nvml import FakeNvml, FakeNvmlUnavailableError, build_fake_nvml, read_state

TIMEOUT_S = 30.0
NODE = "gpu-node-1"

# Every state of k8s-operator-libs pkg/upgrade/consts.go, in the order a node passes them.
UPGRADE_STATES = [
    ("", False),
    ("upgrade-required", False),
    ("cordon-required", False),
    ("wait-for-jobs-required", False),  # training still runs: keep its savings
    ("pod-deletion-required", True),
    ("drain-required", True),
    ("node-maintenance-required", True),
    ("post-maintenance-required", True),
    ("pod-restart-required", True),  # the driver pod is replaced: no NVML handle may be open
    ("validation-required", True),
    ("uncordon-required", False),
    ("upgrade-done", False),
    ("upgrade-failed", False),
]


@pytest.mark.parametrize(("state", "release"), UPGRADE_STATES)
def test_the_gpus_are_released_from_pod_deletion_to_validation(state: str, release: bool) -> None:
    assert releases_gpus(state) is release
    assert state in (RELEASE_STATES if release else HOLD_STATES)


def test_no_label_or_an_unknown_state_keeps_the_gpus() -> None:
    assert UPGRADE_STATE_LABEL == "nvidia.com/gpu-driver-upgrade-state"
    assert not releases_gpus(None)
    assert not releases_gpus("some-future-state")
    assert {s for s, _ in UPGRADE_STATES} == RELEASE_STATES | HOLD_STATES


# -- NVML through the real bindings ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> FakeNvml:
    try:
        return FakeNvml(build_fake_nvml(tmp_path_factory.mktemp("fake_nvml")))
    except FakeNvmlUnavailableError as exc:
        pytest.skip(str(exc))


def test_release_shuts_nvml_down_and_reopen_initializes_it_again(
    fake: FakeNvml, tmp_path: Path
) -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py (the agent extra) is not installed")
    state = tmp_path / "nvml"
    code = textwrap.dedent(
        """
        from perseus_agent.errors import GpuReleasedError
        from perseus_agent.gpu.nvml import NvmlBackend
        from perseus_agent.gpu.releasable import ReleasableBackend

        b = ReleasableBackend(NvmlBackend(), NvmlBackend)
        assert [d.index for d in b.devices()] == [0, 1]
        b.lock_sm_clock(0, 1200)
        b.reset_sm_clock(0)
        b.release()
        assert b.released
        try:
            b.sm_clock_mhz(0)
        except GpuReleasedError as exc:
            print("RELEASED", exc.reason, exc.gpu_index)
        assert [d.index for d in b.devices()] == [0, 1]  # known without NVML
        b.reopen()
        print("CLOCK", b.sm_clock_mhz(1))
        b.close()
        """
    )
    result = fake.run_python(code, state=state)
    assert result.returncode == 0, result.stderr
    assert "RELEASED driver_upgrade 0" in result.stdout
    assert "CLOCK 1410" in result.stdout
    calls = read_state(state)
    assert calls["calls.nvmlShutdown"] == 2  # the release, then the close
    assert calls["calls.nvmlInitWithFlags"] == 2


# -- the real agent process against an emulated API server ----------------------------------------


def _plan(revision: int, mhz: int) -> NodePlan:
    fields = pipeline_plan_fields(num_stages=2, num_microbatches=2)
    for stage in fields["stages"]:
        stage["frequency_mhz"] = mhz
    return NodePlan.model_validate(
        {
            "node": NODE,
            "namespace": "ml",
            "job": "gpt3",
            "revision": revision,
            "granularity": "Stage",
            "plans": {"main": fields},
            "assignments": [
                {"gpu_index": 0, "plan": "main", "stage": 0, "rank": 0},
                {"gpu_index": 1, "plan": "main", "stage": 1, "rank": 1},
            ],
        }
    )


def _wait(condition: Any, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            pytest.fail(f"agent exited ({proc.returncode}) waiting for {what}:\n{log.read_text()}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()}")


def test_the_agent_lets_go_of_nvml_during_a_driver_upgrade_and_takes_the_gpus_back(
    fake: FakeNvml, tmp_path: Path, socket_dir: Path
) -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py (the agent extra) is not installed")
    kubernetes = pytest.importorskip("kubernetes")
    pytest.importorskip("kmock")
    from support.kmock_server import KmockServer

    plural = f"{resources.GROUP}/{resources.VERSION}/{resources.NODE_PLAN_PLURAL}"
    info = {
        "kind": resources.NODE_PLAN_KIND,
        "singular": resources.NODE_PLAN_SINGULAR,
        "namespaced": True,
        "subresources": {"status"},
    }
    nodes = {"kind": "Node", "singular": "node", "namespaced": False}
    nvml = tmp_path / "nvml"
    log = tmp_path / "agent.log"
    with KmockServer({plural: info, "v1/nodes": nodes}) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        core = kubernetes.client.CoreV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)
        args = (resources.GROUP, resources.VERSION, "ml", resources.NODE_PLAN_PLURAL)
        name = f"gpt3-{NODE}"
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})

        def label(state: str) -> None:
            core.patch_node(NODE, {"metadata": {"labels": {UPGRADE_STATE_LABEL: state}}})

        def status() -> dict[str, Any]:
            obj = server.objects(plural).get(("ml", name)) or {}
            return dict(obj.get("status") or {})

        def locks() -> tuple[int, int]:
            s = read_state(nvml)
            return s.get("gpu0.sm_locked_max_mhz", 0), s.get("gpu1.sm_locked_max_mhz", 0)

        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "perseus_agent.main", f"--kubeconfig={kubeconfig}",
                    "--gpu-backend=nvml", f"--node-name={NODE}", "--metrics-port=0",
                    "--metrics-address=127.0.0.1", f"--socket-dir={socket_dir / 'run'}",
                    f"--state-dir={tmp_path / 'state'}", "--report-interval=0.2",
                    "--node-poll-interval=0.2",
                    "--gpu-ownership=local-rank-index",  # no kubelet here: GPU r is local rank r
                ],
                env=fake.env(gpus=2, state=nvml),
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            port_re = re.compile(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics")
            _wait(lambda: port_re.search(log.read_text()), "the metrics server", proc, log)
            match = port_re.search(log.read_text())
            assert match is not None
            metrics_url = f"http://127.0.0.1:{match.group(1)}/metrics"

            def released_metric() -> float | None:
                import urllib.request

                with urllib.request.urlopen(metrics_url, timeout=5) as response:
                    text = response.read().decode()
                found = re.search(
                    r'^perseus_agent_driver_upgrade_released\{node="' + NODE + r'"\} (\S+)$',
                    text,
                    re.MULTILINE,
                )
                return float(found.group(1)) if found else None

            first = resources.node_plan_object(_plan(1, 1200))
            custom.create_namespaced_custom_object(*args, first)
            _wait(lambda: locks() == (1200, 1200), "the plan's clocks", proc, log)
            _wait(lambda: status().get("observedRevision") == 1, "a report", proc, log)
            assert released_metric() == 0.0

            # Training is drained, then the driver pod is replaced: the agent lets go.
            label("wait-for-jobs-required")
            label("pod-deletion-required")
            shutdowns = lambda: read_state(nvml).get("calls.nvmlShutdown", 0)  # noqa: E731
            _wait(lambda: shutdowns() == 1, "nvmlShutdown", proc, log)
            assert locks() == (0, 0)  # reset before NVML was shut down
            assert released_metric() == 1.0
            _wait(
                lambda: status().get("conditions", [{}])[0].get("reason") == "DriverUpgrade",
                "the DriverUpgrade status",
                proc,
                log,
            )
            [condition] = status()["conditions"]
            assert condition["status"] == "False"
            assert f"{UPGRADE_STATE_LABEL}=pod-deletion-required" in condition["message"]
            assert status().get("gpus") is None

            # While released: NVML stays shut (no GPU call at all), and a new revision is only
            # recorded.
            label("pod-restart-required")
            new = _plan(2, 1005).model_dump(mode="json", by_alias=True)
            custom.patch_namespaced_custom_object(*args, name, {"spec": new})
            _wait(lambda: status().get("observedRevision") == 2, "the held revision", proc, log)
            calls_before = {k: v for k, v in read_state(nvml).items() if k.startswith("calls.")}
            time.sleep(1.0)  # some scrapes and report intervals (the test's own waits are ok)
            released_metric()
            calls_after = {k: v for k, v in read_state(nvml).items() if k.startswith("calls.")}
            assert calls_after == calls_before
            assert status()["conditions"][0]["reason"] == "DriverUpgrade"

            # The new driver is validated: the agent takes the GPUs back, at the new revision.
            label("validation-required")
            label("uncordon-required")
            _wait(lambda: locks() == (1005, 1005), "the clocks again", proc, log)
            _wait(lambda: status()["conditions"][0]["reason"] == "Applied", "Applied", proc, log)
            assert status()["observedRevision"] == 2
            assert read_state(nvml)["calls.nvmlInitWithFlags"] == 2
            assert released_metric() == 0.0
            text = log.read_text()
            assert "releasing NVML until it is done" in text
            assert "applying 1 plan(s) again" in text

            proc.terminate()
            assert proc.wait(timeout=TIMEOUT_S) == 0
            assert locks() == (0, 0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=TIMEOUT_S)
            client.close()


# -- the gate in process: plans that come and go while released, a driver not back yet ------------


class _Writer:
    """What the gate writes (the ReportWriter's two methods it uses)."""

    def __init__(self) -> None:
        self.statuses: dict[tuple[str, str], dict[str, Any]] = {}
        self.forgotten: list[tuple[str, str]] = []

    def submit(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses[(namespace, name)] = status

    def forget(self, namespace: str, name: str) -> None:
        self.forgotten.append((namespace, name))


def test_the_gate_holds_plan_changes_and_retries_a_driver_that_is_not_back(
    tmp_path: Path,
) -> None:
    from perseus_agent.clocks.clock_owners import ClockOwnerGuard
    from perseus_agent.clocks.reset_state import ResetState
    from perseus_agent.errors import GpuLibraryNotFoundError
    from perseus_agent.gpu.releasable import ReleasableBackend
    from perseus_agent.modes.driver_release import DriverUpgradeGate
    from perseus_agent.plans.job_plans import JobPlans
    from support.fake_gpu import FakeBackend

    hardware = FakeBackend(num_gpus=2)
    opens: list[str] = []

    def reopen() -> FakeBackend:
        if not opens:
            opens.append("failed")
            raise GpuLibraryNotFoundError("NVML cannot be used: driver not loaded")
        opens.append("ok")
        return hardware

    gpus = ReleasableBackend(hardware, reopen)
    guard = ClockOwnerGuard(gpus)
    plan = _plan(1, 1200).model_copy(update={"node": "n1"})
    jobs = JobPlans(guard, ResetState(tmp_path), "n1")
    gate = DriverUpgradeGate(jobs, gpus, guard, jobs.metrics)
    writer = _Writer()
    a, b = ("ml", "a"), ("ml", "b")
    jobs.set_plan(a, plan)
    assert hardware.locked() == {0: 1200, 1: 1200}

    assert gate.handle("driver", ("", ""), None, "pod-deletion-required", writer)
    assert gate.released and gpus.released and hardware.locked() == {}
    assert writer.statuses[a]["conditions"][0]["reason"] == "DriverUpgrade"
    # Meanwhile: plan a is deleted, plan b arrives (on other GPUs: none to lock now).
    assert gate.handle("delete", a, None, "", writer) and writer.forgotten == [a]
    assert gate.handle("plan", b, _plan(3, 900).model_copy(update={"node": "n1"}), "", writer)
    assert writer.statuses[b]["observedRevision"] == 3
    assert not gate.handle("invalid", a, None, "bad spec", writer)  # reported as usual
    calls = len(hardware.calls)

    # Done, but the new driver is not loaded yet: still released, and nothing touched.
    assert gate.handle("driver", ("", ""), None, "upgrade-done", writer)
    assert gate.released and opens == ["failed"] and len(hardware.calls) == calls
    # The agent loop retries: now the library opens, and the plans of now are applied.
    assert gate.retry() == [b]
    assert not gate.released and opens == ["failed", "ok"]
    assert jobs.objects() == [b] and hardware.locked() == {0: 900, 1: 900}
    assert gate.handle("driver", ("", ""), None, "", writer)  # nothing more to do
    assert jobs.objects() == [b]
