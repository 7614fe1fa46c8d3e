"""What the operator keeps in memory for one job between reconcile steps (:class:`JobMemo`),
what a step returns (:class:`Outcome`), and what of a step the next may reuse
(:func:`remember_step`, :mod:`perseus_operator.jobs.quiet_steps`). Everything here can be
rebuilt from the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from perseus_api.job_status import PerseusJobStatus, Phase
from perseus_api.plan import PipelinePlan
from perseus_operator.jobs.job_decisions import Event
from perseus_operator.jobs.profile_store import GpuProducts
from perseus_operator.jobs.quiet_steps import (
    LastStep,
    Observation,
    Reusable,
    Settled,
    unchanged,
)
from perseus_operator.jobs.stragglers import StragglerDetector
from perseus_planner import Frontier

__all__ = ["JobMemo", "Outcome", "remember_step"]


@dataclass
class JobMemo:
    """In-memory state of one job; everything here can be rebuilt from the cluster."""

    frontier: Frontier | None = None
    frontier_key: str = ""
    frontier_generation: int | None = None
    """The job generation the frontier was checked against its stored profile for."""
    detector: StragglerDetector | None = None
    detector_key: str = ""
    retarget_s: float | None = None
    """The straggler target the current plans were written for (None: T_min for all)."""
    power_target_s: float | None = None
    """The power budget's target the current plans were written for (None: none)."""
    plan: PipelinePlan | None = None
    """The plan of the healthy replicas now (for the savings metrics)."""
    gpu_products: GpuProducts = field(default_factory=GpuProducts)
    tmin_plan: PipelinePlan | None = None
    """The plan for the policy without a straggler target, chosen for ``tmin_for``: the same
    at every re-plan of the job (a straggler's onset and recovery), and tens to hundreds of
    milliseconds of a worker thread holding the interpreter's lock to build."""
    tmin_for: tuple[Frontier | None, str] = (None, "")
    """The frontier (by identity) and the policy (as JSON) ``tmin_plan`` was chosen for."""
    last_step: LastStep | None = None
    """What the last step decided, as far as the next may reuse it
    (:mod:`perseus_operator.jobs.quiet_steps`)."""

    def used(self) -> tuple[object, ...]:
        """What a ``Running`` step takes from the memo (see :class:`quiet_steps.Reusable`)."""
        return (
            self.frontier,
            self.frontier_key,
            self.frontier_generation,
            self.detector,
            self.detector_key,
            self.retarget_s,
            self.power_target_s,
            self.plan,
        )


@dataclass
class Outcome:
    status: PerseusJobStatus
    events: list[Event] = field(default_factory=list)
    plan: PipelinePlan | None = None
    """The plan now in effect (for metrics)."""
    iterations: int = 0
    """Most iterations a rank of the job has reported."""
    new_stragglers: int = 0
    detector_state: str | None = None
    """JSON for :data:`STRAGGLER_STATE_ANNOTATION` (None: leave it as it is)."""


def remember_step(
    memo: JobMemo,
    *,
    settled: Settled | None,
    resumed: bool,
    observed: Observation | None,
    acted: bool,
    outcome: Outcome,
    before: object,
    inputs: bytes,
    snapshot: object | None,
) -> None:
    """Keep what a step decided for the job's next step, as far as it may reuse it
    (:mod:`perseus_operator.jobs.quiet_steps`): the stages before the Running stage
    (``settled``; ``resumed``: taken over from the last step) when they left the status as it
    was read (``before``), the whole step when it did too, with no action (``acted``) and the
    detector's round ``observed``. ``snapshot``: what the step read (None: nothing kept)."""
    if snapshot is None or settled is None:
        return
    if not resumed and not unchanged(before, settled.status.model_dump(**_AS_WRITTEN)):
        return
    whole = None
    if (
        observed is not None
        and observed.timed
        and not acted
        and not outcome.events
        and outcome.status.phase == Phase.RUNNING
        and unchanged(before, outcome.status.model_dump(**_AS_WRITTEN))
    ):
        plan, iterations, new = outcome.plan, outcome.iterations, outcome.new_stragglers
        whole = Reusable(memo.used(), observed, outcome.status, plan, iterations, new)
    memo.last_step = LastStep(inputs, snapshot, settled, whole)


_AS_WRITTEN: Final[dict[str, Any]] = {"mode": "json", "by_alias": True}
"""How the handler writes a status (what "unchanged" compares)."""
