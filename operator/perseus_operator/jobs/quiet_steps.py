"""Quiet steps: a reconcile of a ``Running`` job whose inputs have not changed since its last
step reuses that step's decision instead of reading and deciding everything again.

Most timer ticks of a running job change nothing: the same job, the same pods, the same node
plans, a status that the last step left as it found it. Such a step is remembered
(:class:`QuietStep`); the next one is decided again only if something it would read differs
(:func:`may_reuse`): the job (its spec, status, annotations, by their bytes), what the step
read from the operator's watch indexes (by the indexed bytes:
:meth:`~perseus_operator.cluster.cluster_index.IndexedJobIO.unchanged_since`), or what the
job's memo holds. The straggler detector is the one part that still runs: it counts report
rounds by the clock (an agent that writes only changes stands for a report every interval,
and goes stale when its heartbeat is overdue), so it observes the remembered samples at the
new time, and only a verdict equal to the remembered one lets the decision stand
(:func:`same_verdict`). Everything else a ``Running`` step decides depends on time only when
the status changes (a transition's timestamp), which a quiet step's did not.

So a reused step is the step that would have been taken, at a fraction of its CPU
(``benchmarks/operator_scale.py``). Pure: :mod:`perseus_operator.jobs.lifecycle` carries it out.
"""

from __future__ import annotations

import marshal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from perseus_api.job_status import PerseusJobStatus, Phase
from perseus_api.plan import PipelinePlan
from perseus_operator.jobs.stragglers import RankSample, StragglerVerdict

__all__ = [
    "Observation",
    "QuietStep",
    "is_quiet",
    "may_reuse",
    "same_memo",
    "same_verdict",
    "step_inputs",
]


@dataclass(frozen=True)
class Observation:
    """What the straggler detector was given in a step (``samples``), and what it said
    (``verdict``, and the ``reference_s`` it measured against); ``timed``: every report said
    when it was made (see :func:`is_quiet`)."""

    samples: tuple[RankSample, ...]
    verdict: StragglerVerdict
    reference_s: float | None
    timed: bool


@dataclass(frozen=True)
class QuietStep:
    """A step of a ``Running`` job that left everything as it found it, and what it decided.

    ``inputs``: :func:`step_inputs` of its job; ``reads``: what it read from the indexes (an
    opaque snapshot its JobIO compares); ``memo``: the memo's parts it used (by identity);
    ``observed``: the detector's round; the rest is the step's outcome (the status is shared:
    callers only read it)."""

    inputs: bytes
    reads: object
    memo: tuple[object, ...]
    observed: Observation
    status: PerseusJobStatus
    plan: PipelinePlan | None
    iterations: int
    new_stragglers: int


def step_inputs(body: Mapping[str, Any], default_policy: Mapping[str, Any] | None) -> bytes | None:
    """What a step reads of the job, as bytes: equal bytes, the same job for the step (its
    ``resourceVersion`` and ``managedFields`` aside, which no decision reads). None: not plain
    data (no quiet step for it)."""
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
    except ValueError:
        return None


def same_memo(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether two snapshots of a job's memo hold the same things (objects by identity)."""
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b, strict=True))


def may_reuse(last: QuietStep | None, inputs: bytes | None, memo: Sequence[object]) -> bool:
    """Whether ``last`` may stand for this step as far as the job and the memo tell (the
    reads, then the detector's verdict, are checked next)."""
    return (
        last is not None
        and inputs is not None
        and inputs == last.inputs
        and same_memo(memo, last.memo)
    )


def same_verdict(last: QuietStep, verdict: StragglerVerdict, reference_s: float | None) -> bool:
    """Whether the detector, observing ``last``'s samples now, says what it said then (with
    nothing to re-plan)."""
    seen = last.observed
    return not verdict.changed and verdict == seen.verdict and reference_s == seen.reference_s


def is_quiet(
    status_before: Mapping[str, Any],
    status_after: Mapping[str, Any],
    phase_before: Phase,
    phase_after: Phase,
    *,
    acted: bool,
    events: int,
    observed: Observation | None,
) -> bool:
    """Whether a step may be remembered as quiet: ``Running`` before and after, no action, no
    event, the detector ``observed`` a round, every report timed by its agent (a report
    without ``reportedAt`` counts as made at the step's own time), and a status
    (``status_after``, as the handler writes it) that patches nothing over ``status_before``
    (as read)."""
    return (
        phase_before == Phase.RUNNING
        and phase_after == Phase.RUNNING
        and not acted
        and not events
        and observed is not None
        and observed.timed
        and all(status_before.get(k) == v for k, v in status_after.items())
    )
