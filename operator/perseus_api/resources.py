"""The Kubernetes objects through which the operator and the node agents talk.

``PerseusNodePlan`` (group ``perseus.energy``, version ``v1alpha1``, plural ``perseusnodeplans``,
short name ``pnp``) is a namespaced custom resource, one per (job, node), in the job's
namespace, written by the operator and read by the agent of that node::

    apiVersion: perseus.energy/v1alpha1
    kind: PerseusNodePlan
    metadata:
      name: gpt3-gpu-node-1          # node_plan_name(job, node)
      namespace: ml                  # the job's namespace (NodePlan.namespace)
      labels:
        perseus.energy/node: gpu-node-1   # label_value(node): agents list/watch by this label
        perseus.energy/job: gpt3          # label_value(job)
    spec:                            # a NodePlan document (perseus_api.node_plan), field names
      node: gpu-node-1               # as in the model (snake_case), api_version/kind included
      job: gpt3
      revision: 7
      ...
    status:                          # written by the node agent only (status subresource):
      observedRevision: 7            # a NodePlanStatus (perseus_api.node_report), camelCase
      ...

Agents select their plans by the node label across all namespaces (field selectors on custom
resources are limited to ``metadata.name``/``metadata.namespace``), and check ``spec.node`` too.

``status`` is the agent's report, one model for both programs:
:class:`~perseus_api.node_report.NodePlanStatus` (its fields and their meaning are documented
there; the CRD's status schema is generated from it). The agent writes
:func:`~perseus_api.node_report.status_document` of it, all fields together on every update (a
JSON merge patch: a field that no longer applies is written as null, which removes it); the
operator reads it once per object with :func:`parse_node_plan_status`. The rule for rolling
upgrades: keys are camelCase (``meanIterationSeconds``, ``dpRank``, ``observedRevision``);
readers accept an older agent's snake_case ones too (``mean_iteration_s``, ``dp_rank``) and
ignore unknown ones; a writer nulls every old spelling of a top-level key it writes, so a status
never carries both. The ``Applied`` condition's reason is one of :data:`REASON_APPLIED`,
:data:`REASON_FAILED`, :data:`REASON_INVALID_SPEC`, :data:`REASON_AGENT_STOPPED` and
:data:`REASON_DRIVER_UPGRADE`.

A GPU is used by one job at a time: when two plans on a node claim the same GPU, the older
plan keeps it and the newer one reports that GPU ``Failed``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Final

from pydantic import ValidationError

from perseus_api.conventions import snake_name
from perseus_api.errors import ApiError, validation_summary
from perseus_api.node_plan import NodePlan
from perseus_api.node_report import NodePlanStatus
from perseus_api.plan import API_VERSION

__all__ = [
    "API_VERSION",
    "CONDITION_APPLIED",
    "GROUP",
    "JOB_LABEL",
    "NODE_LABEL",
    "NODE_PLAN_KIND",
    "NODE_PLAN_PLURAL",
    "NODE_PLAN_SHORT_NAMES",
    "NODE_PLAN_SINGULAR",
    "REASON_AGENT_STOPPED",
    "REASON_APPLIED",
    "REASON_DRIVER_UPGRADE",
    "REASON_FAILED",
    "REASON_INVALID_SPEC",
    "STATUS_OBSERVED_REVISION",
    "STATUS_REPORTED_AT",
    "VERSION",
    "NodePlanObjectError",
    "either",
    "label_value",
    "node_label_selector",
    "node_plan_name",
    "node_plan_object",
    "object_key",
    "object_name",
    "parse_node_plan_object",
    "parse_node_plan_status",
    "without_snake_case_keys",
]

GROUP: Final = "perseus.energy"
VERSION: Final = "v1alpha1"
NODE_PLAN_KIND: Final = "PerseusNodePlan"
NODE_PLAN_PLURAL: Final = "perseusnodeplans"
NODE_PLAN_SINGULAR: Final = "perseusnodeplan"
NODE_PLAN_SHORT_NAMES: Final = ("pnp",)

NODE_LABEL: Final = f"{GROUP}/node"
"""Label of a node plan: the node it is for (``label_value(node)``)."""
JOB_LABEL: Final = f"{GROUP}/job"
"""Label of a node plan: the job it belongs to (``label_value(job)``)."""

STATUS_OBSERVED_REVISION: Final = "observedRevision"
STATUS_REPORTED_AT: Final = "reportedAt"
"""When the agent wrote the report (RFC 3339); a live agent rewrites it every report interval."""
CONDITION_APPLIED: Final = "Applied"
REASON_APPLIED: Final = "Applied"
"""Every GPU of the plan is at its clock (or clamped, or waiting for its training process)."""
REASON_FAILED: Final = "Failed"
"""At least one GPU could not be set (the condition's message and ``gpus`` say why)."""
REASON_INVALID_SPEC: Final = "InvalidSpec"
"""The spec is not a valid NodePlan for this node; nothing is applied."""
REASON_AGENT_STOPPED: Final = "AgentStopped"
"""The node agent stopped and reset the plan's clocks; it applies the plan again on restart."""
REASON_DRIVER_UPGRADE: Final = "DriverUpgrade"
"""The node's GPU driver is being upgraded: the agent reset the plan's clocks and released NVML;
it applies the plan again when the upgrade is done."""

assert f"{GROUP}/{VERSION}" == API_VERSION

_MAX_NAME: Final = 253  # DNS-1123 subdomain
_MAX_LABEL_VALUE: Final = 63
_HASH_CHARS: Final = 10
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?)?$")


class NodePlanObjectError(ApiError):
    """A PerseusNodePlan object is malformed; the message names it (namespace/name)."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]


def node_plan_name(job: str, node: str) -> str:
    """Name of the node plan of ``job`` on ``node``: ``<job>-<node>`` when that is a DNS-1123
    subdomain (as Kubernetes requires of object names), else :func:`object_name` of it with a
    hash of ``job`` and ``node``, so that pairs that sanitize alike still get distinct names.
    (``job`` ``a`` on node ``b-c`` and ``job`` ``a-b`` on node ``c`` share a name; the
    operator's jobs do not.)
    """
    return object_name(f"{job}-{node}", hashed=f"{job}\0{node}")


def object_name(raw: str, *, hashed: str | None = None, max_chars: int = _MAX_NAME) -> str:
    """``raw`` when it is a DNS-1123 subdomain of at most ``max_chars`` characters; otherwise
    (upper case, other characters, too long) its lower-cased ``[a-z0-9]`` runs joined by ``-``,
    cut to fit, plus a hash of ``hashed`` (default: ``raw``) so that names cut alike stay
    distinct."""
    if len(raw) <= max_chars and _DNS_SUBDOMAIN.match(raw):
        return raw
    suffix = _digest(raw if hashed is None else hashed)
    head = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    head = head[: max_chars - _HASH_CHARS - 1].rstrip("-")
    return f"{head}-{suffix}" if head else suffix


def label_value(value: str) -> str:
    """``value`` if it is a valid label value, else a stable valid one derived from it.

    Label values are at most 63 characters of ``[A-Za-z0-9_.-]``, starting and ending with an
    alphanumeric; node names may be longer. Operator and agent both use this function, so the
    agent's selector matches what the operator writes.
    """
    if len(value) <= _MAX_LABEL_VALUE and _LABEL_VALUE.match(value):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", value)
    head = cleaned[: _MAX_LABEL_VALUE - _HASH_CHARS - 1].strip("_.-")
    suffix = _digest(value)
    return f"{head}-{suffix}" if head else suffix


def node_label_selector(node: str) -> str:
    """Label selector of the node plans of ``node``."""
    return f"{NODE_LABEL}={label_value(node)}"


def node_plan_object(plan: NodePlan) -> dict[str, Any]:
    """The whole PerseusNodePlan object for ``plan`` (without status), ready to create."""
    return {
        "apiVersion": API_VERSION,
        "kind": NODE_PLAN_KIND,
        "metadata": {
            "name": node_plan_name(plan.job, plan.node),
            "namespace": plan.namespace,
            "labels": {NODE_LABEL: label_value(plan.node), JOB_LABEL: label_value(plan.job)},
        },
        "spec": plan.model_dump(mode="json", by_alias=True),
    }


def either(obj: Mapping[str, Any], *keys: str) -> Any:
    """``obj``'s value under the first of ``keys`` it has (a node plan's spec key in camelCase,
    then in the snake_case of an older operator).

    Raises:
        KeyError: ``obj`` has none of ``keys``.
    """
    for key in keys:
        if key in obj:
            return obj[key]
    raise KeyError(keys[0])


def without_snake_case_keys(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch writing the camelCase ``spec`` over a stored one that an operator of an
    older version wrote in snake_case: every snake_case twin of a key is set to null (removed).

    The API server keeps unknown keys of a node plan's spec (the CRD preserves them while
    agents of either spelling run), and a merge patch merges objects (``plans``, their
    estimates) key by key, so without this the stored plan would hold ``num_stages`` beside
    ``numStages``. Lists are replaced whole by a merge patch and need nothing.
    """
    out: dict[str, Any] = {}
    for key, value in spec.items():
        out[key] = without_snake_case_keys(value) if isinstance(value, Mapping) else value
    for key in spec:
        snake = snake_name(key)
        if snake != key and snake not in out:
            out[snake] = None
    return out


def object_key(body: Mapping[str, Any]) -> tuple[str, str]:
    """``(namespace, name)`` of an object; empty strings where missing."""
    metadata = body.get("metadata")
    if not isinstance(metadata, Mapping):
        return "", ""
    namespace, name = metadata.get("namespace"), metadata.get("name")
    return (
        namespace if isinstance(namespace, str) else "",
        name if isinstance(name, str) else "",
    )


def parse_node_plan_object(body: Mapping[str, Any]) -> NodePlan:
    """The NodePlan in a PerseusNodePlan object's spec.

    Raises:
        NodePlanObjectError: The object has no name or its spec is not a valid NodePlan; the
            message names the object and says what is wrong, on one line.
    """
    namespace, name = object_key(body)
    where = f"{NODE_PLAN_KIND} {namespace or '?'}/{name or '?'}"
    if not name:
        raise NodePlanObjectError(f"{where}: metadata.name is missing")
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise NodePlanObjectError(f"{where}: spec is missing or not an object")
    try:
        return NodePlan.model_validate(spec)
    except ValidationError as exc:
        raise NodePlanObjectError(f"{where}: invalid spec: {validation_summary(exc)}") from None


def parse_node_plan_status(body: Mapping[str, Any]) -> NodePlanStatus:
    """The agent's report in a PerseusNodePlan object's status (empty when it has none yet).

    Raises:
        NodePlanObjectError: The status is not a valid NodePlanStatus; the message names the
            object and says what is wrong, on one line.
    """
    status = body.get("status")
    if status is None:
        return NodePlanStatus()
    namespace, name = object_key(body)
    where = f"{NODE_PLAN_KIND} {namespace or '?'}/{name or '?'}"
    if not isinstance(status, Mapping):
        raise NodePlanObjectError(f"{where}: status is not an object")
    try:
        return NodePlanStatus.model_validate(dict(status))
    except ValidationError as exc:
        raise NodePlanObjectError(
            f"{where}: invalid status (the node agent's report): {validation_summary(exc)}"
        ) from None
