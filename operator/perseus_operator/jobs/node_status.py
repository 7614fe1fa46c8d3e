"""The node agents' reports as the operator reads them: each PerseusNodePlan's ``status``,
validated against :class:`~perseus_api.node_report.NodePlanStatus` by one function.

Several steps of a reconcile read the same plans (progress, call-ins, the gathered profile;
iterations, the Applied condition, straggler samples), and a finished profiling report holds
hundreds of rows per GPU: a status is validated once per object version (its ``uid`` and
``resourceVersion``, which changes with every write) and the result reused. An object without
a ``resourceVersion`` (tests' fakes) is validated every time.

A malformed status (an agent of another version, or one written by hand) is never a crash: it
reads as no report at all (the plan's agent looks silent, which the job's phases already
handle: waiting, stale telemetry, timeouts), and a warning names the object and what is wrong,
once per object version.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from perseus_api.node_report import NodePlanStatus
from perseus_api.plan import Granularity
from perseus_api.resources import (
    NodePlanObjectError,
    either,
    object_key,
    parse_node_plan_status,
)

__all__ = [
    "PlanReport",
    "expected_iteration_s",
    "node_plan_status",
    "plan_report",
]

log = logging.getLogger(__name__)

_CACHED_MAX: Final = 4096
"""Object versions remembered (the least recently read are forgotten): more than the node
plans of the jobs one operator manages at a time."""

_Version = tuple[str, str, str, str]
"""(namespace, name, uid, resourceVersion) of a node plan: the uid tells apart an object
deleted and created again, or one of another API server, that reuses a resourceVersion."""

_read: OrderedDict[_Version, NodePlanStatus] = OrderedDict()


def node_plan_status(obj: Mapping[str, Any]) -> NodePlanStatus:
    """The agent's report in node plan ``obj``: empty when there is none yet, or when it is
    malformed (logged; see the module's docstring)."""
    version = _version(obj)
    if version is not None and (cached := _read.get(version)) is not None:
        _read.move_to_end(version)
        return cached
    try:
        status = parse_node_plan_status(obj)
    except NodePlanObjectError as exc:
        log.warning("%s; ignoring this report until the node agent writes a valid one", exc)
        status = NodePlanStatus()
    if version is not None:
        _read[version] = status
        if len(_read) > _CACHED_MAX:
            _read.popitem(last=False)
    return status


@dataclass(frozen=True, slots=True)
class PlanReport:
    """What a ``Running`` job's step reads of one of its node plans: its node and revision
    (``spec.node``, ``spec.revision`` as written), each rank's planned iteration time
    (:func:`expected_iteration_s`) and the agent's report. Small and immutable: an index can
    keep one per object version, so that a step does not parse the whole plan (most of it
    the pipeline plans' clocks) again for these."""

    node: Any
    revision: Any
    expected_s: Mapping[int, float]
    status: NodePlanStatus
    power_limits: Mapping[str, Any]
    """The plan as far as its GPUs' power limits go (``spec.node``, and each assignment's
    ``powerLimitWatts``), for :func:`~perseus_operator.jobs.power_limits.limits_changed`."""


def plan_report(obj: Mapping[str, Any]) -> PlanReport:
    """Node plan ``obj`` as :class:`PlanReport`."""
    spec = obj.get("spec") or {}
    assignments = spec.get("assignments")
    if isinstance(assignments, list):
        assignments = [
            {"powerLimitWatts": a.get("powerLimitWatts")} if isinstance(a, Mapping) else a
            for a in assignments
        ]
    limits = {"spec": {"node": spec.get("node"), "assignments": assignments}}
    return PlanReport(
        spec.get("node"),
        spec.get("revision"),
        expected_iteration_s(obj),
        node_plan_status(obj),
        limits,
    )


def expected_iteration_s(plan: Mapping[str, Any]) -> dict[int, float]:
    """Expected iteration time (seconds) of each rank's plan in a node plan's spec."""
    spec = plan.get("spec") or {}
    pipelines = spec.get("plans") or {}
    # camelCase, or snake_case in a plan written by an operator of an older version.
    if spec.get("granularity") == Granularity.STAGE:
        estimate_keys = ("stageEstimate", "stage_estimate")
    else:
        estimate_keys = ("instructionEstimate", "instruction_estimate")
    out: dict[int, float] = {}
    for assignment in spec.get("assignments") or ():
        try:
            estimate = either(pipelines[assignment["plan"]], *estimate_keys)
            seconds = float(either(estimate, "iterationTimeSeconds", "iteration_time_s"))
            rank = int(assignment["rank"])
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(seconds) and seconds > 0:
            out[rank] = seconds
    return out


def _version(obj: Mapping[str, Any]) -> _Version | None:
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        return None
    revision, uid = metadata.get("resourceVersion"), metadata.get("uid")
    if not isinstance(revision, str) or not revision:
        return None
    return (*object_key(obj), uid if isinstance(uid, str) else "", revision)
