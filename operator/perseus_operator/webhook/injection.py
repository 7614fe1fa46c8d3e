"""What the operator's admission webhook adds to a pod of a managed workload (pure).

A training process reaches its node's agent with no hand edit to its pod: when a pod is
created, the API server asks the operator (:mod:`perseus_operator.webhook.injection_server`), and
for a pod that a PerseusJob of its namespace selects (:func:`selecting_job`: the PyTorchJob's or
JobSet's pod label, or the job's ``podSelector``) :func:`build_patch` adds, to each training
container (those requesting ``nvidia.com/gpu``, else the training container), the environment
``perseus_client`` reads:

* ``PERSEUS_HOST_IP`` from the downward API (``status.hostIP``) and
  ``PERSEUS_AGENT_ADDRESS=tcp://$(PERSEUS_HOST_IP):<agent port>``: the agent listens on the
  node's address (:mod:`perseus_agent.serving.tcp_server`), so the pod needs no hostPath volume and
  no extra group, and PodSecurity ``baseline`` (and ``restricted``) admit it;
* ``POD_NAME`` and ``POD_NAMESPACE`` (downward API): who the process is;

and to the pod the label :data:`CLIENT_LABEL` (the agent serves TCP peers only from pods
carrying it) and the annotation :data:`INJECTED_ANNOTATION` (``"true"``, for the reader).

The patch names no PerseusJob: whoever can reach the webhook may post a made-up pod, and the
answer must not tell it the names of a namespace's PerseusJobs (the agent knows a pod's job from
its node plan). It tells only whether some PerseusJob selects such a pod.

Nothing else: no volume, no security context, no capability, no host namespace, so the webhook
can never make a pod more privileged than its author wrote it. A variable the pod already sets
is left as it is (the author's wins), so the patch is idempotent: a pod it was applied to gets
an empty patch (a reinvocation, or a pod created from an injected pod's spec). A pod annotated
``perseus.energy/inject: "false"`` and host-network pods (the agent cannot tell them apart by
address) are left alone.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from perseus_api.job import Workload, WorkloadKind
from perseus_operator.workloads.objects import PYTORCH_CONTAINER
from perseus_operator.workloads.pods import GPU_RESOURCE, JOBSET_NAME, PYTORCH_JOB_NAME
from perseus_operator.workloads.selectors import matches

__all__ = [
    "CLIENT_LABEL",
    "INJECTED_ANNOTATION",
    "OPT_OUT_ANNOTATION",
    "InjectionConfig",
    "admission_response",
    "build_patch",
    "selecting_job",
    "target_containers",
]

CLIENT_LABEL: Final = "perseus.energy/agent-client"
"""Must equal :data:`perseus_agent.serving.tcp_server.CLIENT_LABEL` (a test holds them together)."""
INJECTED_ANNOTATION: Final = "perseus.energy/injected"
OPT_OUT_ANNOTATION: Final = "perseus.energy/inject"
HOST_IP_ENV: Final = "PERSEUS_HOST_IP"
ADDRESS_ENV: Final = "PERSEUS_AGENT_ADDRESS"
"""Must equal :data:`perseus_client.transport.ADDRESS_ENV`."""


@dataclass(frozen=True)
class InjectionConfig:
    agent_port: int = 7460
    """The agents' TCP port (the chart's ``agent.tcp.port``)."""

    def __post_init__(self) -> None:
        if not 0 < self.agent_port < 65536:
            raise ValueError(f"agent_port must be in 1..65535, got {self.agent_port}")


def _labels(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    labels = (pod.get("metadata") or {}).get("labels")
    return labels if isinstance(labels, Mapping) else {}


def _workload(job: Mapping[str, Any]) -> Workload | None:
    spec = job.get("spec")
    raw = spec.get("workload") if isinstance(spec, Mapping) else None
    try:
        return Workload.model_validate(raw)
    except ValidationError:
        return None  # the API server's schema refuses these; a stale object selects nothing


def _selects(workload: Workload, labels: Mapping[str, Any]) -> bool:
    if workload.kind == WorkloadKind.PYTORCH_JOB:
        return labels.get(PYTORCH_JOB_NAME) == workload.name
    if workload.kind in (WorkloadKind.JOB_SET, WorkloadKind.TRAIN_JOB):
        return labels.get(JOBSET_NAME) == workload.name
    assert workload.pod_selector is not None  # Workload's validator
    selector = workload.pod_selector
    if not selector.match_labels and not selector.match_expressions:
        return False  # an empty selector would take every pod of the namespace
    return matches(selector, {str(k): str(v) for k, v in labels.items()})


def selecting_job(pod: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]]) -> str | None:
    """The name of the PerseusJob (of the pod's namespace) whose workload the pod belongs to;
    the first by name when several do (``None``: none)."""
    labels = _labels(pod)
    names = []
    for job in jobs:
        workload = _workload(job)
        name = (job.get("metadata") or {}).get("name")
        if workload is not None and isinstance(name, str) and _selects(workload, labels):
            names.append(name)
    return min(names) if names else None


def _requests_gpus(container: Mapping[str, Any]) -> bool:
    resources = container.get("resources") or {}
    return any(
        (resources.get(section) or {}).get(GPU_RESOURCE) not in (None, 0, "0")
        for section in ("limits", "requests")
    )


def target_containers(pod: Mapping[str, Any]) -> list[int]:
    """Indexes in ``spec.containers`` of the training processes' containers: those requesting
    GPUs, else the one named ``pytorch``, else the first (init containers never)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    gpus = [i for i, c in enumerate(containers) if _requests_gpus(c)]
    if gpus:
        return gpus
    named = [i for i, c in enumerate(containers) if c.get("name") == PYTORCH_CONTAINER]
    return named[:1] or ([0] if containers else [])


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def _wanted_env(config: InjectionConfig) -> list[dict[str, Any]]:
    # PERSEUS_HOST_IP before the address: the kubelet expands $(VAR) from earlier entries only.
    return [
        _field_env(HOST_IP_ENV, "status.hostIP"),
        {"name": ADDRESS_ENV, "value": f"tcp://$({HOST_IP_ENV}):{config.agent_port}"},
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
    ]


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _metadata_ops(
    meta: Mapping[str, Any], field: str, key: str, value: str
) -> list[dict[str, Any]]:
    current = meta.get(field)
    if not isinstance(current, Mapping):
        return [{"op": "add", "path": f"/metadata/{field}", "value": {key: value}}]
    if current.get(key) == value:
        return []
    return [{"op": "add", "path": f"/metadata/{field}/{_pointer(key)}", "value": value}]


def build_patch(
    pod: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]], config: InjectionConfig
) -> tuple[str | None, list[dict[str, Any]]]:
    """``(job, JSON patch)`` for a pod being created: the PerseusJob selecting it and the
    operations adding what its training containers need (see the module); ``(None, [])`` for a
    pod no PerseusJob selects, ``(job, [])`` for one left alone or already injected."""
    job = selecting_job(pod, jobs)
    if job is None:
        return None, []
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = meta.get("annotations")
    if not isinstance(annotations, Mapping):
        annotations = {}
    if str(annotations.get(OPT_OUT_ANNOTATION, "")).lower() == "false" or spec.get("hostNetwork"):
        return job, []
    ops: list[dict[str, Any]] = []
    containers = spec.get("containers") or []
    for index in target_containers(pod):
        env = containers[index].get("env")
        present = {e.get("name") for e in env or () if isinstance(e, Mapping)}
        missing = [e for e in _wanted_env(config) if e["name"] not in present]
        if not missing:
            continue
        path = f"/spec/containers/{index}/env"
        if not isinstance(env, list):
            ops.append({"op": "add", "path": path, "value": missing})
        else:
            ops += [{"op": "add", "path": f"{path}/-", "value": e} for e in missing]
    if not ops and _labels(pod).get(CLIENT_LABEL) == "true":
        return job, []  # injected before (or written by hand): the labels are the author's now
    ops += _metadata_ops(meta, "labels", CLIENT_LABEL, "true")
    ops += _metadata_ops(meta, "annotations", INJECTED_ANNOTATION, "true")
    return job, ops


def admission_response(
    review: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]], config: InjectionConfig
) -> dict[str, Any]:
    """The ``admission.k8s.io/v1`` AdmissionReview answering ``review``: always allowed (the
    webhook adds, it never refuses), with the patch when there is one. ``jobs``: the
    PerseusJobs of the request's namespace."""
    request = review.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    pod = request.get("object")
    if request.get("operation") == "CREATE" and isinstance(pod, Mapping):
        _, ops = build_patch(pod, jobs, config)
        if ops:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
