"""The chart's life with the real ``helm`` CLI (v3.22.0, built by
``scripts/build_test_control_plane.sh``) on a control plane of its own: install, test,
upgrade (a changed value and a CRD change), rollback and uninstall.

- CRDs: ``helm install`` creates them from ``crds/``; Helm never upgrades (nor deletes) them,
  so an upgrade applies ``crds/`` with ``kubectl apply --server-side`` first, as the chart's
  README says. Checked both ways: ``helm upgrade`` alone leaves the CRD as it was, the apply
  changes it, a rollback keeps it (CRD changes must be backward compatible).
- The operator runs as a process as the chart's service account, with the chart's settings
  (its Lease), standing in for the Deployment's pod (no kubelet here); a node agent likewise
  for a DaemonSet pod on a node (emulated GPUs), with the chart's RBAC and admission policy.
- Hook pods (``helm test``, the pre-delete clean-up) are run by :class:`HookRunner`, which
  plays the kubelet: the hook's command runs as the pod's service account and its exit code
  becomes the pod's phase, which helm waits on.
- All of them run from the built images (``make images``; CI builds them): the image's root
  filesystem, read-only, its entrypoint, user and environment (support.image_process), so
  what users deploy is what is tested. Without built images they run from the sources, and
  under ``PERSEUS_REQUIRE_E2E=1`` a missing image fails the test.
- After ``helm uninstall`` no PerseusJob is left and a namespace that had one is deleted (the
  namespace controller runs here): nothing hangs on the jobs' finalizer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from perseus_api import resources
from support.agent_process import Agent
from support.cluster_harness import api_client, require
from support.control_plane import ControlPlane, binaries
from support.helm_render import CHART
from support.hook_runner import HookRunner
from support.image_process import NODE_AGENT, OPERATOR, image
from support.operator_harness import OperatorProcess, perseus_job

RELEASE, NAMESPACE, JOB_NAMESPACE = "perseus", "perseus-system", "ml"
OPERATOR_SA = LEASE = "perseus-operator"  # the chart's names for release "perseus"
AGENT_SA, AGENT_NODE = "perseus-node-agent", "gpu-node-1"
JOB_CRD = f"perseusjobs.{resources.GROUP}"
NEW_COLUMN = {"name": "Revision", "type": "integer", "jsonPath": ".status.revision"}


class Helm:
    """``helm`` as the cluster's admin, with its own config, cache and data directories."""

    def __init__(self, binary: Path, kubeconfig: Path, home: Path) -> None:
        self.binary = binary
        self.env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
            "KUBECONFIG": str(kubeconfig),
        }

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(self.binary), *args, "-n", NAMESPACE],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
        return done

    def history(self) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = json.loads(self("history", RELEASE, "-o", "json").stdout)
        return history


def chart_v2(workdir: Path) -> Path:
    """The chart with version 0.1.1 and one CRD change: a printer column on PerseusJobs."""
    chart = workdir / "chart-v2" / "perseus"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"] = "0.1.1"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    path = chart / "crds" / f"{resources.GROUP}_perseusjobs.yaml"
    crd = yaml.safe_load(path.read_text())
    for version in crd["spec"]["versions"]:
        version.setdefault("additionalPrinterColumns", []).append(NEW_COLUMN)
    path.write_text(yaml.safe_dump(crd))
    return chart


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    helm_binary()  # before starting anything
    found = binaries()
    if isinstance(found, str):
        require(found)
        raise AssertionError("unreachable")
    plane = ControlPlane(
        tmp_path_factory.mktemp("helm-plane"),
        *found,
        controllers=("garbagecollector", "namespace"),
    )
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


def helm_binary() -> Path:
    binary = os.environ.get("PERSEUS_HELM_BIN", "")
    if not binary or not os.access(binary, os.X_OK):
        require(
            f"PERSEUS_HELM_BIN={binary!r} is not an executable helm: build it with "
            '`eval "$(scripts/build_test_control_plane.sh --env)"` (make test does)'
        )
    return Path(binary)


@pytest.fixture(scope="module")
def images() -> dict[str, dict[str, Any] | None]:
    """The built images' records (None: run from the sources; a failure in CI)."""
    return {OPERATOR: image(OPERATOR), NODE_AGENT: image(NODE_AGENT)}


@pytest.fixture(scope="module")
def helm(plane: ControlPlane) -> Helm:
    return Helm(helm_binary(), plane.admin_kubeconfig, plane.workdir / "helm-home")


def crd_columns(custom: Any) -> list[str]:
    """The printer columns of the PerseusJob CRD, as stored."""
    extensions = kubernetes.client.ApiextensionsV1Api(custom.api_client)
    crd = extensions.read_custom_resource_definition(JOB_CRD)
    return [c.name for c in crd.spec.versions[0].additional_printer_columns or ()]


def operator_env(deployment: Any) -> dict[str, str]:
    (container,) = deployment.spec.template.spec.containers
    return {e.name: e.value for e in container.env if e.value is not None}


def test_install_test_upgrade_rollback_uninstall(
    plane: ControlPlane, helm: Helm, images: dict[str, dict[str, Any] | None]
) -> None:
    with api_client(plane.admin_kubeconfig) as api:
        run_lifecycle(plane, helm, api, images)


def agent_on_node(plane: ControlPlane, core: Any, image: dict[str, Any] | None) -> Agent:
    """A node agent as the chart's DaemonSet pod on :data:`AGENT_NODE` would run: its service
    account's token bound to a pod on that node (the chart's admission policy keeps it to that
    node's plans), Kubernetes mode, emulated GPUs."""
    capacity = {"nvidia.com/gpu": "2", "cpu": "16", "memory": "64Gi", "pods": "110"}
    core.create_node(
        {
            "metadata": {"name": AGENT_NODE, "labels": {"kubernetes.io/hostname": AGENT_NODE}},
            "status": {"capacity": capacity, "allocatable": capacity},
        }
    )
    pod = f"{AGENT_SA}-{AGENT_NODE}"
    core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": pod},
            "spec": {
                "nodeName": AGENT_NODE,
                "serviceAccountName": AGENT_SA,
                "containers": [{"name": "agent", "image": "perseus-node-agent"}],
            },
        },
    )
    kubeconfig = plane.service_account_kubeconfig(NAMESPACE, AGENT_SA, bound_pod=pod)
    workdir = plane.workdir / "agent"
    (workdir / "sock").mkdir(parents=True)
    return Agent(workdir, workdir / "sock", kubeconfig=kubeconfig, node=AGENT_NODE, image=image)


def run_lifecycle(
    plane: ControlPlane, helm: Helm, api: Any, images: dict[str, dict[str, Any] | None]
) -> None:
    core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
    apps = kubernetes.client.AppsV1Api(api)
    started = time.monotonic()
    helm("install", RELEASE, str(CHART), "--create-namespace", "--timeout=120s")
    deployment = apps.read_namespaced_deployment(f"{RELEASE}-operator", NAMESPACE)
    assert deployment.spec.replicas == 2
    assert "Revision" not in crd_columns(custom)
    settings = operator_env(deployment)
    assert settings["PERSEUS_OPERATOR_RECONCILE_INTERVAL_S"] == "5"
    operator_image = images[OPERATOR]
    if operator_image is not None:  # the Deployment runs the image as the image's user
        uid = deployment.spec.template.spec.security_context.run_as_user
        assert operator_image["user"] == f"{uid}:{uid}"
    agent = agent_on_node(plane, core, images[NODE_AGENT])
    agent.start()

    kubeconfig = plane.service_account_kubeconfig(NAMESPACE, OPERATOR_SA)
    election = {k: v for k, v in settings.items() if "LEASE" in k or "RETRY" in k or "RENEW" in k}
    election["PERSEUS_OPERATOR_LEADER_ELECTION_NAMESPACE"] = NAMESPACE
    election["PERSEUS_OPERATOR_LEADER_ELECTION_IDENTITY"] = f"{RELEASE}-operator-pod-0"
    with HookRunner(plane, core, NAMESPACE, image=operator_image) as hooks:
        operator = OperatorProcess(
            kubeconfig,
            extra_env=election,
            image=operator_image,
            scratch=plane.workdir / "operator-rootfs",
        )
        # Once the pre-delete hook is done, helm deletes the Deployment (the kubelet then
        # stops its pods) and, a moment later, the RBAC: a pod still running then is denied
        # its Lease renewals (seen: 1 run in 8). The operator is stopped as that pod would be,
        # before helm reads the hook's phase, so that every call it makes is one it may make.
        output: list[str] = []
        hooks.before_phase["-before-uninstall"] = lambda: output.append(operator.stop())
        try:
            operator.wait_for("the operator to lead", lambda: lease_holder(api) != "")
            if operator_image is not None:  # the image's root, not this machine's
                root = Path(f"/proc/{operator.proc.pid}/root").readlink()
                assert root == plane.workdir / "operator-rootfs" / "root", root
            if agent.image is not None and agent.proc is not None:
                root = Path(f"/proc/{agent.proc.pid}/root").readlink()
                assert root.name == "root" and root.parent.name.startswith("rootfs-"), root
            # helm test: passes against the running operator ...
            done = helm("test", RELEASE, "--timeout=120s")
            assert "Succeeded" in done.stdout, done.stdout
            (run,) = hooks.runs_of("-test")
            assert "operator leading and renewing" in run.output, run.output

            # upgrade: helm alone leaves the CRD; the documented apply of crds/ changes it.
            v2 = chart_v2(plane.workdir)
            helm("upgrade", RELEASE, str(v2), "--set", "operator.reconcileIntervalSeconds=7")
            assert "Revision" not in crd_columns(custom)
            plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(v2 / "crds"))
            assert "Revision" in crd_columns(custom)
            deployment = apps.read_namespaced_deployment(f"{RELEASE}-operator", NAMESPACE)
            assert operator_env(deployment)["PERSEUS_OPERATOR_RECONCILE_INTERVAL_S"] == "7"

            # rollback: the value comes back; the CRD stays (Helm never touches crds/).
            helm("rollback", RELEASE, "1")
            deployment = apps.read_namespaced_deployment(f"{RELEASE}-operator", NAMESPACE)
            assert operator_env(deployment)["PERSEUS_OPERATOR_RECONCILE_INTERVAL_S"] == "5"
            assert "Revision" in crd_columns(custom)
            history = [(h["revision"], h["chart"], h["status"]) for h in helm.history()]
            assert history == [
                (1, "perseus-0.1.0", "superseded"),
                (2, "perseus-0.1.1", "superseded"),
                (3, "perseus-0.1.0", "deployed"),
            ]

            # A job with the operator's finalizer, then uninstall: the pre-delete hook deletes
            # it and waits for the operator to release it; the namespace then goes.
            core.create_namespace({"metadata": {"name": JOB_NAMESPACE}})
            body = perseus_job("gpt3", JOB_NAMESPACE, "gpt3", stages=4, dp=2, microbatches=8)
            custom.create_namespaced_custom_object(
                resources.GROUP, resources.VERSION, JOB_NAMESPACE, "perseusjobs", body
            )
            operator.wait_for("the job's finalizer", lambda: job_finalizers(custom) != [])
            # The agent read its node's plans with the chart's rights all along; it goes
            # first, as the DaemonSet's pods do on uninstall, and leaves no clock locked.
            assert agent.healthy(), agent.log
            assert agent.stop() == 0, agent.log
            assert agent.clocks() == [None, None]
            assert "HTTP 403" not in agent.log, agent.log
            helm("uninstall", RELEASE, "--timeout=120s")
            (cleanup,) = hooks.runs_of("-before-uninstall")
            assert cleanup.exit_code == 0, cleanup.output
            assert f"deleting PerseusJob {JOB_NAMESPACE}/gpt3" in cleanup.output
            assert job_finalizers(custom) is None  # gone, not stuck
            # The hook's account and rights went with it.
            accounts = core.list_namespaced_service_account(NAMESPACE).items
            assert [a.metadata.name for a in accounts if "uninstall" in a.metadata.name] == []
        finally:
            log = output[0] if output else operator.stop()
            agent.kill_if_running()
        # Every call was allowed: the operator ran until the uninstall began deleting.
        denied = [line for line in log.splitlines() if "HTTP 403" in line]
        assert denied == [], log[-5000:]
        assert "released the leader Lease" in log, log[-5000:]
        assert hooks.errors == []

    core.delete_namespace(JOB_NAMESPACE)
    deadline = time.monotonic() + 60
    while any(n.metadata.name == JOB_NAMESPACE for n in core.list_namespace().items):
        assert time.monotonic() < deadline, f"namespace {JOB_NAMESPACE} still Terminating"
        time.sleep(0.5)
    # Helm leaves the CRDs (and so users' other custom resources) in place.
    assert "Revision" in crd_columns(custom)
    took_s = time.monotonic() - started
    ran = {k: v["image"] if v else "sources" for k, v in images.items()}
    print(f"\nhelm lifecycle (install .. uninstall, namespace gone): {took_s:.1f} s; ran {ran}")


def test_helm_test_fails_when_no_operator_leads(
    plane: ControlPlane, helm: Helm, images: dict[str, dict[str, Any] | None]
) -> None:
    """The check can fail: with no operator process holding the Lease, ``helm test`` fails."""
    with api_client(plane.admin_kubeconfig) as api:
        core = kubernetes.client.CoreV1Api(api)
        helm("install", RELEASE, str(CHART), "--create-namespace", "--timeout=120s")
        try:
            with HookRunner(plane, core, NAMESPACE, image=images[OPERATOR]) as hooks:
                done = helm("test", RELEASE, "--timeout=120s", check=False)
            assert done.returncode != 0, done.stdout
            (run,) = hooks.runs_of("-test")
            # (never held on a fresh cluster; released when the other test's operator stopped)
            assert "FAIL: " in run.output and "leader Lease" in run.output, run.output
        finally:
            # No job exists: the pre-delete hook finds nothing to wait for.
            with HookRunner(plane, core, NAMESPACE, image=images[OPERATOR]) as cleanup:
                helm("uninstall", RELEASE, "--timeout=120s")
            assert cleanup.errors == []


def lease_holder(api: Any) -> str:
    try:
        lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(LEASE, NAMESPACE)
    except kubernetes.client.ApiException:
        return ""
    return str(lease.spec.holder_identity or "")


def job_finalizers(custom: Any) -> list[str] | None:
    """The job's finalizers; None when it is gone."""
    try:
        job = custom.get_namespaced_custom_object(
            resources.GROUP, resources.VERSION, JOB_NAMESPACE, "perseusjobs", "gpt3"
        )
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return list(job["metadata"].get("finalizers") or [])
