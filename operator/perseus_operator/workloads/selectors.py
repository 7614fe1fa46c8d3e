"""Label selectors: a workload's pod selector, rendered and parsed as ``kubectl`` writes it,
and matched against labels.

Pure functions over :class:`perseus_api.job.LabelSelector`; the operator's watch indexes and
the policies match pods with them exactly as the API server would.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from perseus_api.job import LabelSelector, LabelSelectorRequirement, Workload, WorkloadKind
from perseus_operator.workloads.pods import JOBSET_NAME, PYTORCH_JOB_NAME, WorkloadError


def pod_selector(workload: Workload) -> str:
    """The label selector listing the workload's pods in its namespace."""
    if workload.kind == WorkloadKind.PYTORCH_JOB:
        return f"{PYTORCH_JOB_NAME}={workload.name}"
    if workload.kind in (WorkloadKind.JOB_SET, WorkloadKind.TRAIN_JOB):
        return f"{JOBSET_NAME}={workload.name}"
    if workload.pod_selector is None:
        raise WorkloadError("a workload of kind Pods needs podSelector")
    return render_selector(workload.pod_selector)


def render_selector(selector: LabelSelector) -> str:
    """``selector`` in the API server's string syntax, sorted by key like ``kubectl`` does."""
    parts = [(key, f"{key}={value}") for key, value in selector.match_labels.items()]
    parts += [(req.key, _render_requirement(req)) for req in selector.match_expressions]
    return ",".join(text for _, text in sorted(parts))


def _render_requirement(req: LabelSelectorRequirement) -> str:
    values = ",".join(sorted(set(req.values)))
    if req.operator == "In":
        return f"{req.key} in ({values})"
    if req.operator == "NotIn":
        return f"{req.key} notin ({values})"
    if req.operator == "Exists":
        return req.key
    return f"!{req.key}"


_SET_TERM: Final = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def parse_selector(text: str) -> LabelSelector | None:
    """A selector in the API server's string syntax (what :func:`render_selector` writes, and
    ``k==v``, ``k!=v``); None for the empty selector, which selects everything.

    Raises:
        ValueError: ``text`` is not a selector.
    """
    labels: dict[str, str] = {}
    requirements: list[LabelSelectorRequirement] = []
    # Commas separate terms, except inside the parentheses of a set.
    for term in re.findall(r"(?:[^,(]|\([^)]*\))+", text):
        if not term.strip():
            continue
        found = _SET_TERM.match(term)
        if found is not None:
            key, op, values = found.groups()
            listed = [v.strip() for v in values.split(",") if v.strip()]
            operator = "In" if op == "in" else "NotIn"
            requirements.append(LabelSelectorRequirement(key=key, operator=operator, values=listed))
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            requirements.append(LabelSelectorRequirement(key=key, operator="NotIn", values=[value]))
        elif "=" in term:
            key, value = (s.strip() for s in term.split("=", 1))
            labels[key] = value.removeprefix("=").strip()
        elif term.strip().startswith("!"):
            key = term.strip()[1:].strip()
            requirements.append(LabelSelectorRequirement(key=key, operator="DoesNotExist"))
        else:
            requirements.append(LabelSelectorRequirement(key=term.strip(), operator="Exists"))
    if not labels and not requirements:
        if text.strip():
            raise ValueError(f"not a label selector: {text!r}")
        return None
    return LabelSelector(match_labels=labels, match_expressions=requirements)


def matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Whether a pod with ``labels`` is selected, with the API server's semantics."""
    if any(labels.get(key) != value for key, value in selector.match_labels.items()):
        return False
    return all(_satisfies(req, labels) for req in selector.match_expressions)


def _satisfies(req: LabelSelectorRequirement, labels: Mapping[str, str]) -> bool:
    if req.operator == "In":
        return req.key in labels and labels[req.key] in req.values
    if req.operator == "NotIn":
        # A pod without the label is "not in" any set, as in Kubernetes.
        return labels.get(req.key) not in req.values
    if req.operator == "Exists":
        return req.key in labels
    return req.key not in labels
