"""Quiet steps: a reconcile of a ``Running`` job whose inputs have not changed since its last
step reuses what that step decided instead of reading and deciding everything again.

Most timer ticks of a running job change nothing: the same job, the same pods, the same node
plans, a status that the last step left as it found it. What such a step decided is
remembered (:class:`LastStep`), at two depths:

* **The whole step** (:class:`Reusable`): the next step is decided again only if something it
  would read differs: the job (its spec, status, annotations, by their bytes:
  :func:`step_inputs`), what it read from the operator's watch indexes (by the indexed bytes:
  :meth:`~perseus_operator.jobs.job_observation.ReadSnapshots.changes_since`), or what the
  job's memo holds (:func:`same_memo`). The straggler detector is the one part that still
  runs: it counts report rounds by the clock (an agent that writes only changes stands for a
  report every interval, and goes stale when its heartbeat is overdue), so it observes the
  remembered samples at the new time, and only a verdict equal to the remembered one lets the
  decision stand (:func:`same_verdict`).
* **The stages before the Running stage** (:class:`Settled`: the generation, the workload and
  its ranks, the GPU conflict check), when only the job's own node plans changed (an agent
  wrote a report): those stages read neither those plans nor the memo, so the step resumes
  at the Running stage with what they decided.

Everything those parts decide depends on time only where the status changes (a transition's
timestamp), and only a status left as it was read is remembered (:func:`unchanged`). So a
reused step is the step that would have been taken, at a fraction of its CPU
(``benchmarks/operator_scale.py``). Pure: :mod:`perseus_operator.jobs.lifecycle` carries it out.
"""

from __future__ import annotations

import marshal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from perseus_api.job import PerseusJobSpec
from perseus_api.job_status import PerseusJobStatus
from perseus_api.plan import PipelinePlan
from perseus_operator.jobs.stragglers import RankSample, StragglerVerdict
from perseus_operator.workloads.ranks import RankPlacement

__all__ = [
    "LastStep",
    "Observation",
    "Reusable",
    "Settled",
    "same_memo",
    "same_verdict",
    "step_inputs",
    "unchanged",
]


@dataclass(frozen=True)
class Observation:
    """What the straggler detector was given in a step (``samples``), and what it said
    (``verdict``, and the ``reference_s`` it measured against); ``timed``: every report said
    when it was made (one that does not counts as made at the step's own time: such a round
    is not reused)."""

    samples: tuple[RankSample, ...]
    verdict: StragglerVerdict
    reference_s: float | None
    timed: bool


@dataclass(frozen=True)
class Settled:
    """What the stages before the Running stage decided: the job's status as read
    (``before``), its spec, where its ranks run, and the status they left (as read)."""

    before: PerseusJobStatus
    spec: PerseusJobSpec
    ranks: tuple[RankPlacement, ...]
    status: PerseusJobStatus


@dataclass(frozen=True)
class Reusable:
    """A whole step of a ``Running`` job that acted on nothing and left the status as read.

    ``memo``: the memo's parts it used (:meth:`~perseus_operator.jobs.lifecycle.JobMemo.used`);
    ``observed``: the detector's round; the rest is the step's outcome (the status is shared:
    callers only read it)."""

    memo: tuple[object, ...]
    observed: Observation
    status: PerseusJobStatus
    plan: PipelinePlan | None
    iterations: int
    new_stragglers: int


@dataclass(frozen=True)
class LastStep:
    """The last step of a job, as far as the next one may reuse it: ``inputs``
    (:func:`step_inputs`) and ``reads`` (its JobIO's snapshot) say what it saw."""

    inputs: bytes
    reads: object
    settled: Settled | None
    whole: Reusable | None


def step_inputs(body: Mapping[str, Any], default_policy: Mapping[str, Any] | None) -> bytes | None:
    """What a step reads of the job, as bytes: equal bytes, the same job for the step (its
    ``resourceVersion`` and ``managedFields`` aside, which no decision reads). None: not plain
    data (nothing is reused for it)."""
    metadata = body.get("metadata") or {}
    try:
        return marshal.dumps(
            (
                body.get("apiVersion"),
                body.get("kind"),
                {
                    k: v
                    for k, v in metadata.items()
                    if k not in ("resourceVersion", "managedFields")
                },
                body.get("spec"),
                body.get("status"),
                dict(default_policy) if default_policy is not None else None,
            )
        )
    except (ValueError, AttributeError):
        return None


def same_memo(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether two snapshots of a job's memo hold the same things (objects by identity)."""
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b, strict=True))


def same_verdict(last: Reusable, verdict: StragglerVerdict, reference_s: float | None) -> bool:
    """Whether the detector, observing ``last``'s samples now, says what it said then (with
    nothing to re-plan)."""
    seen = last.observed
    return not verdict.changed and verdict == seen.verdict and reference_s == seen.reference_s


def unchanged(before: object, after: Mapping[str, Any]) -> bool:
    """Whether status ``after`` (dumped as the handler writes it) patches nothing over the
    status ``before`` (as read)."""
    if not isinstance(before, Mapping):
        return False
    return all(before.get(k) == v for k, v in after.items())
