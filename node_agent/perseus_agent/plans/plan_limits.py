"""Which node plans the agent refuses before binding them to any GPU (pure).

A plan object is refused whole, with a status message saying why and no GPU touched, when:

* its ``spec.namespace`` is not the object's own namespace (a namespaced object speaks for its
  own namespace only; :mod:`perseus_agent.kube.plan_source` refuses it first, this is the same
  rule where the plans are applied);
* this node already has :data:`MAX_PLANS_PER_NODE` plans (a node runs a handful of jobs; a flood
  of plan objects must not make the agent bind and report thousands).

The size of one plan is bounded by its model (:data:`perseus_api.node_plan.MAX_ASSIGNMENTS`,
enforced by the CRD's schema and by the agent's parsing).
"""

from __future__ import annotations

from typing import Final

from perseus_agent.kube import ObjectKey
from perseus_api.node_plan import NodePlan

__all__ = ["MAX_PLANS_PER_NODE", "plan_refusal"]

MAX_PLANS_PER_NODE: Final = 64
"""Plan objects one agent applies at once; later ones wait, refused, until others go."""


def plan_refusal(key: ObjectKey, plan: NodePlan, other_plans: int) -> str | None:
    """Why plan object ``key`` (``namespace, name``) is refused, if it is; ``other_plans``:
    the plans this node applies besides it."""
    namespace = key[0]
    if plan.namespace != namespace:
        return (
            f"spec.namespace is {plan.namespace!r} but the object is in namespace {namespace!r}:"
            " a node plan manages pods of its own namespace only; nothing of it is applied"
        )
    if other_plans >= MAX_PLANS_PER_NODE:
        return (
            f"node {plan.node} already applies {other_plans} node plans, the most one agent "
            f"applies ({MAX_PLANS_PER_NODE}); this one is applied when another is deleted"
        )
    return None
