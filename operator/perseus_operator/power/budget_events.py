"""The Kubernetes Events of a PerseusPowerBudget: what a round decided, in words, and a gate
that keeps a flapping budget from flooding the API server with them.

Pure (no I/O; the clock is passed in): the budget controller posts what :func:`budget_events`
returns and :class:`EventGate` lets through. Events say what an operator of the rack wants to
see in ``kubectl describe ppb``: the allocation solved again and why (``Resolved``), the jobs
whose plans it rewrote (``Retargeted``), the budget becoming ``Infeasible`` (with the watts
missing), nodes selected by two budgets (``Overlapping``), the draw going over the budget
(``OverBudget``) and back (``WithinBudget``). A condition's Event comes when it turns (or its
numbers change with the spec), not every round it holds. No ``OverBudget`` in a round that
solved the allocation again: the draw measured then is the old plans', which the new
allocation is about to change (a budget lowered is over at first, by design).

The gate is Kubernetes' own event spam filter (client-go's ``EventSourceObjectSpamFilter``):
per budget, a burst of 25 and then one Event per 5 minutes; plus identical Events (reason and
message) posted once per 10 minutes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from perseus_api.power_budget import (
    BUDGET_KIND,
    BudgetCondition,
    BudgetConditionType,
    PerseusPowerBudgetStatus,
)
from perseus_api.resources import API_VERSION
from perseus_operator.power.budget_decisions import BudgetDecision

__all__ = ["BudgetEvent", "EventGate", "budget_events", "event_body"]

_JOBS_NAMED: Final = 5
_MESSAGE_CHARS: Final = 1000  # the API server keeps up to 1 kB of an event's message


@dataclass(frozen=True)
class BudgetEvent:
    """One Event on a budget: ``type`` Normal or Warning, a CamelCase reason, a message."""

    type: str
    reason: str
    message: str


def budget_events(
    decision: BudgetDecision, previous: PerseusPowerBudgetStatus | None
) -> list[BudgetEvent]:
    """The Events of a round (``previous``: the status before it, None for a new budget)."""
    out = []
    if decision.resolved is not None:
        jobs = decision.status.managed_jobs
        moved = len(decision.retargets)
        out.append(
            BudgetEvent(
                "Normal",
                "Resolved",
                f"allocation solved again ({decision.resolved}): {jobs} job(s), "
                f"{decision.status.allocated_watts or 0:.0f} W allocated of "
                f"{decision.status.budget_watts or 0:.0f} W, {moved} re-targeted",
            )
        )
        if decision.retargets:
            out.append(BudgetEvent("Normal", "Retargeted", _retargeted(decision)))
    now = {c.type: c for c in decision.status.conditions}
    before = {c.type: c for c in (previous.conditions if previous is not None else [])}
    spec_changed = previous is None or previous.observed_generation != (
        decision.status.observed_generation
    )
    for kind, reason in (
        (BudgetConditionType.INFEASIBLE, "Infeasible"),
        (BudgetConditionType.OVERLAPPING, "Overlapping"),
    ):
        cond, old = now.get(kind), before.get(kind)
        if cond is None or cond.status != "True":
            continue
        if _turned(cond, old) or (spec_changed and decision.resolved is not None):
            out.append(BudgetEvent("Warning", reason, cond.message))
    met, was = now.get(BudgetConditionType.MET), before.get(BudgetConditionType.MET)
    if met is not None and was is not None and was.status != met.status:
        if met.status == "False" and decision.resolved is None:
            out.append(BudgetEvent("Warning", "OverBudget", met.message))
        elif met.status == "True" and was.status == "False":
            out.append(BudgetEvent("Normal", "WithinBudget", met.message))
    return out


def _turned(cond: BudgetCondition, old: BudgetCondition | None) -> bool:
    return old is None or old.status != cond.status


def _retargeted(decision: BudgetDecision) -> str:
    assigned = decision.memo.assigned
    parts = []
    for r in decision.retargets[:_JOBS_NAMED]:
        share = assigned.get((r.namespace, r.name))
        if r.target_s is None or share is None:
            parts.append(f"{r.namespace}/{r.name} to T_min")
        else:
            parts.append(
                f"{r.namespace}/{r.name} to {r.target_s:.4g} s "
                f"(+{share.slowdown:.1%}, {share.watts:.0f} W)"
            )
    more = len(decision.retargets) - _JOBS_NAMED
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


@dataclass
class _Budget:
    tokens: float
    refilled_s: float
    recent: dict[tuple[str, str], float] = field(default_factory=dict)  # (reason, message) -> t
    suppressed: int = 0


class EventGate:
    """Which Events to post: an Event identical to one posted within ``dedupe_s`` is dropped,
    and each budget has a bucket of ``burst`` Events, refilled one per ``refill_s``; what the
    bucket holds back is counted in the next Event that goes out.

    Memory is bounded by the budgets (:meth:`forget`) times the distinct Events of the last
    ``dedupe_s``: at most ``burst + dedupe_s / refill_s`` each.
    """

    def __init__(
        self, *, burst: int = 25, refill_s: float = 300.0, dedupe_s: float = 600.0
    ) -> None:
        self._burst = burst
        self._refill_s = refill_s
        self._dedupe_s = dedupe_s
        self._budgets: dict[str, _Budget] = {}

    def admit(self, budget: str, events: Sequence[BudgetEvent], now_s: float) -> list[BudgetEvent]:
        """The ``events`` of ``budget`` to post now (their messages may say how many were
        held back)."""
        state = self._budgets.get(budget)
        if state is None:
            state = self._budgets[budget] = _Budget(float(self._burst), now_s)
        state.recent = {k: t for k, t in state.recent.items() if now_s - t < self._dedupe_s}
        gained = (now_s - state.refilled_s) / self._refill_s
        state.tokens = min(float(self._burst), state.tokens + max(0.0, gained))
        state.refilled_s = now_s
        out = []
        for event in events:
            key = (event.reason, event.message)
            if key in state.recent:
                continue
            if state.tokens < 1.0:
                state.suppressed += 1
                continue
            if state.suppressed:
                event = BudgetEvent(
                    event.type,
                    event.reason,
                    f"{event.message} ({state.suppressed} earlier event(s) of this budget not "
                    f"posted: more than {self._burst}, then one per {self._refill_s:.0f} s)",
                )
                state.suppressed = 0
            state.recent[key] = now_s
            state.tokens -= 1.0
            out.append(event)
        return out

    def forget(self, budget: str) -> None:
        self._budgets.pop(budget, None)


def event_body(
    budget: Mapping[str, Any], event: BudgetEvent, namespace: str, now: str, component: str
) -> dict[str, Any]:
    """The ``v1`` Event about the cluster-scoped ``budget`` object, created in ``namespace``
    (``kubectl describe ppb`` finds it there: it lists the object's Events in every
    namespace)."""
    metadata = budget.get("metadata") or {}
    name = str(metadata.get("name") or "")
    involved = {"apiVersion": API_VERSION, "kind": BUDGET_KIND, "name": name}
    if metadata.get("uid"):
        involved["uid"] = str(metadata["uid"])
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{name}.", "namespace": namespace},
        "involvedObject": involved,
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:_MESSAGE_CHARS],
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "source": {"component": component},
        "reportingComponent": component,
    }
