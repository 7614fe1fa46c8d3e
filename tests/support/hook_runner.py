"""The kubelet's part for the chart's Helm hook pods, in a test cluster that has no kubelet.

Helm creates a hook pod and waits for its phase (``Succeeded``: the hook passed; ``Failed``:
``helm`` fails). Here no kubelet runs containers, so :class:`HookRunner` does what one would
for the hook pods of a namespace: it runs the container's command (``perseus-operator ...``:
from the built operator image's root filesystem when given one, else as ``python -m
perseus_operator.main`` from the source tree) with the container's environment
and a token of the pod's service account (so RBAC applies to the hook exactly as in a pod),
then writes the pod's phase and the container's exit code. Only the container runtime is
stood in for; what the hook does, and how helm reacts to its result, are real.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from support.agent_process import REPO_ROOT, source_env
from support.control_plane import ControlPlane
from support.image_process import image_command, kubeconfig_files

HOOK_TIMEOUT_S = 300.0


@dataclass
class HookRun:
    pod: str
    argv: list[str]
    exit_code: int
    output: str


class HookRunner:
    """Runs each new hook pod of ``namespace`` once, in a background thread.

    :attr:`before_phase` maps a hook pod name suffix to what to do when that hook's command
    has ended, before its phase is written (helm goes on once it reads the phase).
    """

    def __init__(
        self,
        plane: ControlPlane,
        core: Any,
        namespace: str,
        image: Mapping[str, Any] | None = None,
    ) -> None:
        """``image``: run the hooks from the built operator image's root filesystem (its
        entrypoint is the hook's command), as a kubelet would; by default from the sources."""
        self.image = image
        self.plane = plane
        self.core = core
        self.namespace = namespace
        self.runs: list[HookRun] = []
        self.errors: list[BaseException] = []
        self.before_phase: dict[str, Callable[[], object]] = {}
        self._done: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> HookRunner:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(HOOK_TIMEOUT_S)

    def runs_of(self, hook_pod_suffix: str) -> list[HookRun]:
        return [r for r in self.runs if r.pod.endswith(hook_pod_suffix)]

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                for pod in self.core.list_namespaced_pod(self.namespace).items:
                    annotations = pod.metadata.annotations or {}
                    finished = (pod.status.phase or "") in ("Succeeded", "Failed")
                    if (
                        "helm.sh/hook" in annotations
                        and not finished  # a kept hook pod of an earlier run
                        and pod.metadata.uid not in self._done
                    ):
                        self._done.add(pod.metadata.uid)
                        self._run(pod)
            except BaseException as exc:  # surfaced by the test
                self.errors.append(exc)
                return

    def _run(self, pod: Any) -> None:
        (container,) = pod.spec.containers
        if container.command != ["perseus-operator"]:
            raise AssertionError(f"hook pod {pod.metadata.name} runs {container.command}")
        kubeconfig = self.plane.service_account_kubeconfig(
            self.namespace, pod.spec.service_account_name
        )
        pod_env = {
            **{e.name: e.value for e in container.env or () if e.value is not None},
            "PERSEUS_OPERATOR_KUBECONFIG": str(kubeconfig),
        }
        if self.image is None:
            env = {**source_env(), **pod_env}
            env.pop("KUBECONFIG", None)
            argv = [sys.executable, "-m", "perseus_operator.main", *(container.args or ())]
        else:
            scratch = self.plane.workdir / f"hook-{pod.metadata.uid}"
            argv, env = image_command(
                self.image,
                list(container.args or ()),
                scratch=scratch,
                env=pod_env,
                shared=kubeconfig_files(kubeconfig),
                entrypoint=container.command,
            )
        self._set_phase(pod, "Running", None)
        done = subprocess.run(
            argv,
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=HOOK_TIMEOUT_S,
            check=False,
        )
        self.runs.append(
            HookRun(pod.metadata.name, argv, done.returncode, done.stdout + done.stderr)
        )
        for suffix, action in self.before_phase.items():
            if pod.metadata.name.endswith(suffix):
                action()
        phase = "Succeeded" if done.returncode == 0 else "Failed"
        self._set_phase(pod, phase, done.returncode)

    def _set_phase(self, pod: Any, phase: str, exit_code: int | None) -> None:
        name = pod.spec.containers[0].name
        state: dict[str, Any] = {"running": {}}
        if exit_code is not None:
            reason = "Completed" if exit_code == 0 else "Error"
            state = {"terminated": {"exitCode": exit_code, "reason": reason}}
        status = {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": name,
                    "image": pod.spec.containers[0].image,
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": state,
                }
            ],
        }
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace, {"status": status})
