"""Per-GPU power limits a power budget asks of a job's node plans (pure).

With ``enforcement: PlansAndPowerLimits`` the budget controller
(:mod:`perseus_operator.power.budget_controller`) writes, in the job's annotation
:data:`POWER_LIMITS_ANNOTATION`, the power limit of each of the job's GPUs on each node of its
domain: ``{"node-a": 312.5, "node-b": 312.5}`` (watts per GPU). The job's reconcile writes them
into its node plans' assignments (``powerLimitWatts``) through the same re-target path as the
budget's target time, and the agents set them. When the annotation goes (the budget is deleted
or switches to ``Plans``) the plans are written without limits, and the agents put back the
limits the GPUs had.

The plans are compared with the annotation (not with what this process remembers), so a
restarted operator still removes limits a deleted budget left in the plans.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

from perseus_api import resources
from perseus_api.node_plan import MAX_POWER_LIMIT_W, MIN_POWER_LIMIT_W

__all__ = [
    "MAX_ANNOTATED_NODES",
    "POWER_LIMITS_ANNOTATION",
    "annotation_value",
    "limits_changed",
    "planned_power_limits_w",
    "power_limits_w",
]

POWER_LIMITS_ANNOTATION: Final = f"{resources.GROUP}/power-limits-watts"
"""Written by the operator's power budget controller only: JSON object of node name -> the power
limit, in watts, of each of the job's GPUs on that node (absent: no limits)."""
MAX_ANNOTATED_NODES: Final = 4096
"""Nodes one annotation may name (more than a job spans; bounds what a reconcile reads)."""


def power_limits_w(annotations: object) -> dict[str, float]:
    """The per-node GPU power limits of the job's annotation; empty when absent or unreadable
    (the annotation is the operator's own: a bad one means no limits). Entries that are not a
    node name and a number within the node plan's bounds are left out."""
    if not isinstance(annotations, Mapping):
        return {}
    raw = annotations.get(POWER_LIMITS_ANNOTATION)
    if not isinstance(raw, str) or not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(parsed, dict) or len(parsed) > MAX_ANNOTATED_NODES:
        return {}
    out = {}
    for node, value in parsed.items():
        limit_w = _limit_w(value)
        if isinstance(node, str) and node and limit_w is not None:
            out[node] = limit_w
    return dict(sorted(out.items()))


def annotation_value(limits_w: Mapping[str, float]) -> str | None:
    """The annotation for ``limits_w`` (None: remove it)."""
    if not limits_w:
        return None
    return json.dumps(dict(sorted(limits_w.items())), separators=(",", ":"))


def planned_power_limits_w(node_plans: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The power limit the job's node plans give their GPUs now, by node (nodes whose plan sets
    none are left out; a plan's GPUs all carry the same one)."""
    out = {}
    for plan in node_plans:
        spec = plan.get("spec") or {}
        node = spec.get("node")
        assignments = spec.get("assignments")
        if not isinstance(node, str) or not isinstance(assignments, list):
            continue
        for a in assignments:
            limit_w = _limit_w(a.get("powerLimitWatts")) if isinstance(a, Mapping) else None
            if limit_w is not None:
                out[node] = limit_w
                break
    return out


def limits_changed(wanted_w: Mapping[str, float], node_plans: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the job's node plans carry other limits than ``wanted_w`` asks for on their
    nodes (a plan's node the annotation does not name must carry none)."""
    plans = list(node_plans)
    nodes = {
        (p.get("spec") or {}).get("node") for p in plans if (p.get("spec") or {}).get("assignments")
    }
    wanted = {n: w for n, w in wanted_w.items() if n in nodes}
    return wanted != planned_power_limits_w(plans)


def _limit_w(value: object) -> float | None:
    """``value`` as a power limit within the node plan's bounds, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if MIN_POWER_LIMIT_W <= value <= MAX_POWER_LIMIT_W else None
