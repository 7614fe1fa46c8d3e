"""The node agents' reports as the operator reads them: each PerseusNodePlan's ``status``,
validated against :class:`~perseus_api.node_report.NodePlanStatus` by one function.

A malformed status (an agent of another version, or one written by hand) is never a crash: it
reads as no report at all (the plan's agent looks silent, which the job's phases already
handle: waiting, stale telemetry, timeouts), and a warning names the object and what is wrong,
once per object and problem, so a reconcile loop does not repeat it every pass.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

from perseus_api.node_report import NodePlanStatus
from perseus_api.resources import NodePlanObjectError, parse_node_plan_status

__all__ = ["node_plan_status"]

log = logging.getLogger(__name__)

_WARNED_MAX: Final = 1024
"""Distinct malformed statuses remembered so as to warn once each (the oldest are forgotten)."""

_warned: OrderedDict[str, None] = OrderedDict()


def node_plan_status(obj: Mapping[str, Any]) -> NodePlanStatus:
    """The agent's report in node plan ``obj``: empty when there is none yet, or when it is
    malformed (logged; see the module's docstring)."""
    try:
        return parse_node_plan_status(obj)
    except NodePlanObjectError as exc:
        _warn_once(f"{exc}; ignoring this report until the node agent writes a valid one")
        return NodePlanStatus()


def _warn_once(message: str) -> None:
    if message in _warned:
        _warned.move_to_end(message)
        return
    _warned[message] = None
    if len(_warned) > _WARNED_MAX:
        _warned.popitem(last=False)
    log.warning("%s", message)
