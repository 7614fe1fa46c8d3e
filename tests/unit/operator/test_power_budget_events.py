"""The Events of a PerseusPowerBudget: what each round says (re-solved and why, jobs
re-targeted, Infeasible, Overlapping, over the budget and back), and the gate that keeps a
flapping budget from flooding the API server (issue 35).

The rounds are real ones (:func:`~perseus_operator.power.budget_decisions.decide_budget` on
the bundled GPT-3 and Bloom A100 frontiers)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from perseus_api.power_budget import PerseusPowerBudgetSpec
from perseus_operator.power.budget_decisions import BudgetDecision, DomainJob, decide_budget
from perseus_operator.power.budget_events import (
    BudgetEvent,
    EventGate,
    budget_events,
    event_body,
)
from perseus_planner.frontier import Frontier
from perseus_planner.power.frontier_points import frontier_points

SolveFrontier = Callable[[str, str, int], Frontier]


@pytest.fixture(scope="module")
def jobs(solved_frontier: SolveFrontier) -> list[DomainJob]:
    out = []
    for model, name in (("gpt3-175b", "gpt3"), ("bloom", "bloom")):
        points, indices = frontier_points(name, solved_frontier(model, "a100_sxm", 12), 1)
        out.append(DomainJob("ml", name, points, indices, gpus=8))
    return out


def _t_min_w(jobs: list[DomainJob]) -> float:
    return sum(float(j.points.powers_w[j.t_min_position]) for j in jobs)


def _spec(budget_w: float) -> PerseusPowerBudgetSpec:
    return PerseusPowerBudgetSpec.model_validate(
        {"budgetWatts": budget_w, "nodeSelector": {"matchLabels": {"rack": "a"}}}
    )


def _round(
    spec: PerseusPowerBudgetSpec,
    jobs: list[DomainJob],
    before: BudgetDecision | None = None,
    *,
    generation: int = 1,
    measured_w: float | None = None,
    overlapping: tuple[str, ...] = (),
) -> BudgetDecision:
    return decide_budget(
        spec,
        generation,
        jobs,
        unmanaged_w=0.0,
        measured_w=measured_w,
        memo=None if before is None else before.memo,
        previous=None if before is None else before.status,
        nodes=2,
        overlapping_nodes=overlapping,
    )


def _reasons(events: list[BudgetEvent]) -> list[str]:
    return [e.reason for e in events]


def test_a_first_allocation_says_why_and_which_jobs_it_slowed(jobs: list[DomainJob]) -> None:
    d = _round(_spec(0.85 * _t_min_w(jobs) / 0.95), jobs)
    events = budget_events(d, None)
    assert _reasons(events) == ["Resolved", "Retargeted"]
    resolved, retargeted = events
    assert resolved.type == "Normal" and "(first allocation)" in resolved.message
    assert f"{len(d.retargets)} re-targeted" in resolved.message
    slowed = [r for r in d.retargets if r.target_s is not None]
    assert slowed
    for r in slowed:  # each slowed job named, with its target time and slowdown
        assert f"ml/{r.name} to {r.target_s:.4g} s (+" in retargeted.message


def test_a_steady_round_says_nothing(jobs: list[DomainJob]) -> None:
    spec = _spec(0.85 * _t_min_w(jobs) / 0.95)
    first = _round(spec, jobs, measured_w=0.8 * spec.budget_watts)
    again = _round(spec, jobs, first, measured_w=0.81 * spec.budget_watts)
    assert again.resolved is None
    assert budget_events(again, first.status) == []


def test_infeasible_is_said_when_it_turns_and_when_the_budget_changes(
    jobs: list[DomainJob],
) -> None:
    least_w = sum(float(j.points.powers_w.min()) for j in jobs)
    first = _round(_spec(0.5 * least_w), jobs)
    events = budget_events(first, None)
    [infeasible] = [e for e in events if e.reason == "Infeasible"]
    assert infeasible.type == "Warning"
    assert f"{first.status.missing_watts:.0f} W missing" in infeasible.message
    steady = _round(_spec(0.5 * least_w), jobs, first)
    assert budget_events(steady, first.status) == []  # still infeasible: said once
    lower = _round(_spec(0.4 * least_w), jobs, steady, generation=2)
    [again] = [e for e in budget_events(lower, steady.status) if e.reason == "Infeasible"]
    assert f"{lower.status.missing_watts:.0f} W missing" in again.message  # the new numbers
    assert lower.status.missing_watts > first.status.missing_watts  # type: ignore[operator]


def test_going_over_the_budget_and_back_are_said(jobs: list[DomainJob]) -> None:
    spec = _spec(0.85 * _t_min_w(jobs) / 0.95)
    within = _round(spec, jobs, measured_w=0.9 * spec.budget_watts)
    over = _round(spec, jobs, within, measured_w=1.1 * spec.budget_watts)
    [event] = budget_events(over, within.status)  # the allocation stood: its plans draw that
    assert (event.type, event.reason) == ("Warning", "OverBudget")
    assert f"{1.1 * spec.budget_watts:.0f} W measured" in event.message
    back = _round(spec, jobs, over, measured_w=0.9 * spec.budget_watts)
    assert _reasons(budget_events(back, over.status)) == ["WithinBudget"]
    # A budget lowered reads over it at first (the old plans' draw): no warning for that.
    lowered = _round(_spec(0.8 * spec.budget_watts), jobs, back, generation=2,
                     measured_w=0.9 * spec.budget_watts)  # fmt: skip
    assert "OverBudget" not in _reasons(budget_events(lowered, back.status))


def test_overlapping_nodes_are_named(jobs: list[DomainJob]) -> None:
    spec = _spec(0.85 * _t_min_w(jobs) / 0.95)
    first = _round(spec, jobs)
    shared = _round(spec, jobs, first, overlapping=("node-a2",))
    [event] = budget_events(shared, first.status)
    assert (event.type, event.reason) == ("Warning", "Overlapping")
    assert "node-a2" in event.message


# -- the gate --


def _event(n: int, reason: str = "OverBudget") -> BudgetEvent:
    return BudgetEvent("Warning", reason, f"{1000 + n} W measured of 900 W")


def test_the_same_event_is_posted_once_within_the_dedupe_time() -> None:
    gate = EventGate(burst=5, refill_s=300, dedupe_s=600)
    assert gate.admit("rack-a", [_event(1)], 0.0) == [_event(1)]
    assert gate.admit("rack-a", [_event(1)], 10.0) == []
    assert gate.admit("rack-a", [_event(1)], 601.0) == [_event(1)]


def test_a_flapping_budget_posts_a_burst_then_one_per_refill_and_counts_the_rest() -> None:
    """As client-go's spam filter: 25, then one per 5 minutes, per object."""
    gate = EventGate()
    posted = []
    for n in range(1800):  # a new message every 2 s round for an hour
        posted += gate.admit("rack-a", [_event(n)], 2.0 * n)
    assert 25 + 11 <= len(posted) <= 25 + 12  # the burst, then 3,600 s / 300 s
    assert "earlier event(s) of this budget not posted" in posted[25].message
    assert gate.admit("rack-b", [_event(0)], 3600.0) == [_event(0)]  # per budget
    gate.forget("rack-a")
    assert gate.admit("rack-a", [_event(1)], 3601.0) == [_event(1)]  # forgotten with it


def test_the_event_names_the_cluster_scoped_budget() -> None:
    budget = {"metadata": {"name": "rack-a", "uid": "u-1"}}
    body = event_body(budget, _event(1), "perseus-system", "2026-12-05T00:00:00Z", "perseus-op")
    assert body["metadata"] == {"generateName": "rack-a.", "namespace": "perseus-system"}
    assert body["involvedObject"] == {
        "apiVersion": "perseus.energy/v1alpha1",
        "kind": "PerseusPowerBudget",
        "name": "rack-a",
        "uid": "u-1",
    }
    assert (body["type"], body["reason"], body["count"]) == ("Warning", "OverBudget", 1)
    long = BudgetEvent("Normal", "Retargeted", "x" * 5000)
    assert len(event_body(budget, long, "default", "t", "c")["message"]) == 1000
