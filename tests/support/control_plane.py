"""A real Kubernetes control plane on 127.0.0.1 for end-to-end tests: etcd, kube-apiserver and
kube-controller-manager running only its garbage collector; opt-in, more of its controllers,
kube-scheduler and KWOK's controller (fake nodes: pods bound to them run through their phases
as KWOK's stages say, with no kubelet).

The binaries come from ``scripts/build_test_control_plane.sh`` (built from Go modules, cached
outside the repository), found through ``PERSEUS_ETCD_BIN``, ``PERSEUS_KUBE_APISERVER_BIN`` and
``PERSEUS_KUBE_CONTROLLER_MANAGER_BIN`` (``eval "$(scripts/build_test_control_plane.sh --env)"``;
``make test`` does it). The apiserver runs with RBAC authorization and signs service-account
tokens, so a process given :meth:`ControlPlane.service_account_kubeconfig` acts under that
account's permissions only. The garbage collector deletes what an owner reference says goes
with a deleted object, as in any cluster. The scheduler (``PERSEUS_KUBE_SCHEDULER_BIN``) acts
as ``system:kube-scheduler`` under its bootstrap RBAC; KWOK (``PERSEUS_KWOK_BIN``, stages from
``PERSEUS_KWOK_STAGES``) manages only the nodes annotated :data:`KWOK_NODE_ANNOTATION`.
Findings behind the command lines are in ``scripts/control_plane.md``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from support.operator_harness import free_port

READY_TIMEOUT_S = 60.0
# Writes only, at Metadata level (no bodies): a small log, enough to say who changed what when.
AUDIT_POLICY: dict[str, Any] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {
            "level": "Metadata",
            "verbs": ["create", "update", "patch", "delete"],
            "resources": [{"group": "perseus.energy"}, {"group": "coordination.k8s.io"}],
        },
        {"level": "None"},
    ],
}
KUBECTL = shutil.which("kubectl")
# KWOK's own convention for the nodes it fakes (kwokctl's nodes carry it too).
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_VALUE = "fake"
SCHEDULER_USER = "system:kube-scheduler"  # the bootstrap ClusterRoleBinding's subject

# The cluster's own processes (etcd, kube-apiserver, the controllers, Prometheus) run niced:
# on a real cluster they do not share a training node's cores, and here, on 2 cores, they
# would otherwise delay the emulated GPUs' hand-offs and the hooks that the end-to-end tests
# time (the training, the node agents and the operator, the parts under test, keep nice 0).
BACKGROUND = ("nice", "-n", "10")


def optional_binary(variable: str) -> Path | str:
    """The executable ``variable`` names (a component only some tests run), or why not."""
    value = os.environ.get(variable, "")
    if not value:
        return (
            f"{variable} is not set: build it with "
            '`eval "$(scripts/build_test_control_plane.sh --env)"` (make test does)'
        )
    path = Path(value)
    if not os.access(path, os.X_OK) and not path.is_dir():
        return f"{variable}={value} is neither an executable file nor a directory"
    return path


def binaries() -> tuple[Path, Path, Path] | str:
    """``(etcd, kube-apiserver, kube-controller-manager)``, or why they cannot be used."""
    found = []
    for variable in (
        "PERSEUS_ETCD_BIN",
        "PERSEUS_KUBE_APISERVER_BIN",
        "PERSEUS_KUBE_CONTROLLER_MANAGER_BIN",
    ):
        value = os.environ.get(variable, "")
        if not value:
            return (
                f"{variable} is not set: build the test control plane with "
                '`eval "$(scripts/build_test_control_plane.sh --env)"` (make test does)'
            )
        path = Path(value)
        if not os.access(path, os.X_OK):
            return f"{variable}={value} is not an executable file"
        found.append(path)
    if KUBECTL is None:
        return "kubectl is not on PATH"
    return found[0], found[1], found[2]


class ControlPlane:
    """etcd + kube-apiserver + garbage collector in ``workdir``; :meth:`stop` (in reverse order
    of start) always cleans up."""

    def __init__(
        self,
        workdir: Path,
        etcd: Path,
        apiserver: Path,
        controller_manager: Path,
        *,
        controllers: Sequence[str] = ("garbagecollector",),
        controller_manager_flags: Sequence[str] = (),
        scheduler: Path | None = None,
        kwok: Path | None = None,
        kwok_stages: Sequence[Path | dict[str, Any]] = (),
    ) -> None:
        self.workdir = workdir
        self.etcd_bin = etcd
        self.apiserver_bin = apiserver
        self.controller_manager_bin = controller_manager
        self.controllers = list(controllers)
        self.controller_manager_flags = list(controller_manager_flags)
        self.scheduler_bin = scheduler
        self.kwok_bin = kwok
        # Stage files, or Stage objects (written to the workdir); KWOK runs only with some.
        self.kwok_stages = list(kwok_stages)
        if kwok is not None and not self.kwok_stages:
            raise ValueError("KWOK needs stages: without them it moves no node or pod")
        self.scheduler_token = secrets.token_hex(16)
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.admin_token = secrets.token_hex(16)
        self.admin_kubeconfig = workdir / "admin.kubeconfig"
        self.ca_file = workdir / "certs" / "apiserver.crt"
        self.audit_log = workdir / "audit.log"
        self._procs: list[subprocess.Popen[bytes]] = []

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        d = self.workdir
        subprocess.run(
            ["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["openssl", "rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub")],
            check=True,
            capture_output=True,
        )
        (d / "tokens.csv").write_text(
            f"{self.admin_token},admin,admin-uid,system:masters\n"
            f"{self.scheduler_token},{SCHEDULER_USER},scheduler-uid\n"
        )
        (d / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        client_port, peer_port = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                str(self.etcd_bin),
                "--name=perseus-test",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client_port}",
                f"--advertise-client-urls=http://127.0.0.1:{client_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=perseus-test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._spawn(
            "kube-apiserver",
            [
                str(self.apiserver_bin),
                f"--etcd-servers=http://127.0.0.1:{client_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={d / 'certs'}",
                f"--token-auth-file={d / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={d / 'sa.pub'}",
                f"--service-account-signing-key-file={d / 'sa.key'}",
                # No controller manager creates the default service accounts pods would need.
                "--disable-admission-plugins=ServiceAccount",
                "--endpoint-reconciler-type=none",
                # Who wrote what (tests attribute writes to an identity: one leader at a time).
                f"--audit-policy-file={d / 'audit-policy.yaml'}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
            ],
        )
        self._write_kubeconfig(self.admin_kubeconfig, "admin", self.admin_token)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for name, proc in zip(("etcd", "kube-apiserver"), self._procs, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)}")
            done = self.kubectl("get", "--raw", "/readyz", check=False)
            if done.returncode == 0 and done.stdout.strip() == "ok":
                self._start_garbage_collector()
                if self.scheduler_bin is not None:
                    self._start_scheduler(self.scheduler_bin)
                if self.kwok_bin is not None:
                    self._start_kwok(self.kwok_bin)
                return
            time.sleep(0.2)
        raise RuntimeError(f"kube-apiserver not ready in {READY_TIMEOUT_S} s:\n{self.log()}")

    def _start_garbage_collector(self) -> None:
        """Only the garbage collector of kube-controller-manager by default: nothing else (no
        scheduler, no kubelets) acts on what the tests create, but owned objects go with their
        owners. Tests that need more (e.g. ``daemonset``) name them in ``controllers``."""
        self._spawn(
            "kube-controller-manager",
            [
                str(self.controller_manager_bin),
                f"--kubeconfig={self.admin_kubeconfig}",
                f"--controllers={','.join(self.controllers)}",
                "--leader-elect=false",
                "--secure-port=0",  # no health endpoint needed: nothing to serve
                *self.controller_manager_flags,
            ],
        )
        self._check_started("kube-controller-manager")

    def _start_scheduler(self, binary: Path) -> None:
        """kube-scheduler as ``system:kube-scheduler``, one instance (no leader election), no
        serving port (nothing scrapes it)."""
        kubeconfig = self.workdir / "scheduler.kubeconfig"
        self._write_kubeconfig(kubeconfig, SCHEDULER_USER, self.scheduler_token)
        self._spawn(
            "kube-scheduler",
            [
                str(binary),
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                "--bind-address=127.0.0.1",
            ],
        )
        self._check_started("kube-scheduler")

    def _start_kwok(self, binary: Path) -> None:
        """KWOK's controller on the nodes annotated :data:`KWOK_NODE_ANNOTATION` only (other
        tests' bare Nodes stay as they are), with :attr:`kwok_stages`."""
        configs = []
        for i, stage in enumerate(self.kwok_stages):
            if isinstance(stage, dict):
                path = self.workdir / f"kwok-stage-{i}.yaml"
                path.write_text(yaml.safe_dump(stage))
                stage = path
            configs.append(f"--config={stage}")
        self._spawn(
            "kwok",
            [
                str(binary),
                f"--kubeconfig={self.admin_kubeconfig}",
                *configs,
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_VALUE}",
                # Its own server (fake kubelet endpoints, metrics) on a free local port.
                f"--server-address=127.0.0.1:{free_port()}",
                "--node-ip=127.0.0.1",
                "--cidr=10.244.0.0/16",
            ],
        )
        self._check_started("kwok")

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        """Run another component (e.g. a workload controller) with the plane: its output goes
        to :meth:`log` ``(name)``, and :meth:`stop` stops it first."""
        self._spawn(name, argv, env)
        self._check_started(name)

    def _check_started(self, name: str) -> None:
        time.sleep(0.5)
        if self._procs[-1].poll() is not None:
            raise RuntimeError(f"{name} exited:\n{self.log(name)}")

    def stop(self) -> None:
        # The controller manager, then the apiserver: stopped together, the apiserver keeps
        # retrying etcd and does not exit.
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()

    def audit_events(self) -> list[dict[str, Any]]:
        """The writes to Perseus objects and Leases so far (:data:`AUDIT_POLICY`), oldest first:
        each with ``user.username``, ``verb``, ``objectRef``, ``responseStatus.code`` and
        ``stageTimestamp``."""
        if not self.audit_log.exists():
            return []
        lines = self.audit_log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def log(self, name: str = "kube-apiserver") -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-20000:] if path.exists() else ""

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with (self.workdir / f"{name}.log").open("wb") as log:
            self._procs.append(
                subprocess.Popen(
                    [*BACKGROUND, *argv], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
                )
            )

    # -- identities ------------------------------------------------------------------------------

    def _write_kubeconfig(self, path: Path, user: str, token: str) -> None:
        # The apiserver writes a serving certificate and its one-off CA there at start-up.
        cluster = {"server": self.server, "certificate-authority": str(self.ca_file)}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "test", "user": user}}],
            "current-context": user,
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)

    def service_account_kubeconfig(
        self, namespace: str, name: str, *, bound_pod: str | None = None
    ) -> Path:
        """A kubeconfig acting as service account ``namespace/name``. With ``bound_pod`` the
        token is bound to that pod and, the pod being on a node, names the node in the user's
        extra info, as a DaemonSet pod's projected token does."""
        bound = (
            []
            if bound_pod is None
            else ["--bound-object-kind=Pod", f"--bound-object-name={bound_pod}"]
        )
        token = self.kubectl(
            "create", "token", name, "-n", namespace, "--duration=2h", *bound
        ).stdout.strip()
        path = self.workdir / f"sa-{namespace}-{name}-{bound_pod or 'unbound'}.kubeconfig"
        self._write_kubeconfig(path, f"{namespace}-{name}", token)
        return path

    # -- kubectl ---------------------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        stdin: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl`` as admin (or as ``kubeconfig``'s user); fails with its output if
        ``check`` and it exits non-zero."""
        assert KUBECTL is not None
        argv = [
            KUBECTL,
            f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
            f"--cache-dir={self.workdir / 'kubectl-cache'}",
            *args,
        ]
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env)
        if check and done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
            )
        return done

    def apply(self, objects: Sequence[dict[str, Any]], *, kubeconfig: Path | None = None) -> None:
        """``kubectl apply`` of ``objects`` (server-side, so CRDs need no annotation room)."""
        self.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            "-",
            kubeconfig=kubeconfig,
            stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}),
        )
