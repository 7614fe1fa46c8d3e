"""Fields of Kubernetes objects as the API server sends them (plain JSON mappings).

Read defensively, as the operator reads everything it did not write: a missing or mistyped
field reads as absent and never raises, so that one odd object makes a clear message
elsewhere rather than a crash here. One module for the operator's modules that read
workloads, pods and jobs (workloads, policies, policy_sync, lifecycle), and for the owner
reference the objects a job makes carry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from perseus_api.job import JOB_KIND
from perseus_api.plan import API_VERSION

__all__ = [
    "INTEGER",
    "PYTORCH_CONTAINER",
    "annotations_of",
    "as_mapping",
    "containers_of",
    "get_path",
    "labels_of",
    "listed",
    "owner_reference",
    "string_map",
    "terminating",
    "training_container",
]

INTEGER: Final = re.compile(r"[0-9]+")
"""A non-negative integer as a label, an annotation or an environment variable writes it."""

PYTORCH_CONTAINER: Final = "pytorch"
"""The container the Kubeflow training operator requires in a PyTorchJob's pods."""


def get_path(obj: object, *path: str) -> Any:
    """``obj[path[0]][path[1]]...``; ``None`` where a step is missing or not a mapping."""
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def as_mapping(value: object) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def string_map(value: object) -> dict[str, str]:
    """``value``'s items as strings, those whose value is ``None`` left out (not a mapping:
    empty)."""
    return {str(k): str(v) for k, v in as_mapping(value).items() if v is not None}


def labels_of(obj: Mapping[str, Any]) -> dict[str, str]:
    """An object's labels (none: empty)."""
    return string_map(get_path(obj, "metadata", "labels"))


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    """An object's annotations (none: empty)."""
    return string_map(get_path(obj, "metadata", "annotations"))


def terminating(obj: Mapping[str, Any]) -> bool:
    """Whether the object is being deleted (``deletionTimestamp`` set; finalizers still run)."""
    return get_path(obj, "metadata", "deletionTimestamp") is not None


def containers_of(pod_or_template: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The containers of a pod or pod template (``spec.containers``; init containers not)."""
    containers = get_path(pod_or_template, "spec", "containers")
    if not isinstance(containers, list):
        return []
    return [c for c in containers if isinstance(c, Mapping)]


def training_container(pod_or_template: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The container that runs the training: the one named ``pytorch`` (the training operator
    requires it), else the first by convention; ``None`` when there is none."""
    containers = containers_of(pod_or_template)
    named = [c for c in containers if c.get("name") == PYTORCH_CONTAINER]
    candidates = named or containers
    return candidates[0] if candidates else None


def listed(items: Sequence[str], limit: int, separator: str = ", ") -> str:
    """The first ``limit`` items joined by ``separator``, then how many more there are."""
    shown = separator.join(items[:limit])
    hidden = len(items) - limit
    return f"{shown}{separator}and {hidden} more" if hidden > 0 else shown


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    """An owner reference to the PerseusJob ``job``: its objects go when it goes."""
    metadata = as_mapping(job.get("metadata"))
    return {
        "apiVersion": API_VERSION,
        "kind": JOB_KIND,
        "name": metadata.get("name", ""),
        "uid": metadata.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }
