"""Releasing a deleted job's GPUs: every node plan is first emptied (its agent resets the clocks
and reports the empty revision), then deleted once confirmed; past a deadline, whatever is
left is deleted anyway.

Pure: :func:`decide_release_step` says what one step writes, :func:`decide_release` what the
delete handler does after it; :func:`perseus_operator.jobs.lifecycle.release` reads and writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from perseus_api import resources
from perseus_operator.jobs.node_status import node_plan_status

__all__ = [
    "RELEASE_PENDING",
    "DeleteNodePlan",
    "EmptyNodePlan",
    "Release",
    "ReleaseDecision",
    "ReleaseStep",
    "decide_release",
    "decide_release_step",
]

RELEASE_PENDING: Final = "GPU reset pending"
"""Starts the message of every retry of a deletion that waits for agents (the handlers log
those as the normal course of a deletion, not as the errors kopf takes retries for)."""


@dataclass(frozen=True)
class Release:
    """Where releasing a deleted job's GPUs stands."""

    done: bool
    waiting_for: tuple[str, ...] = ()
    """Nodes whose agents have not yet confirmed the reset."""


@dataclass(frozen=True)
class EmptyNodePlan:
    """Write ``body``: a node plan with no assignment, one revision on."""

    body: Mapping[str, Any]


@dataclass(frozen=True)
class DeleteNodePlan:
    namespace: str
    name: str


@dataclass(frozen=True)
class ReleaseStep:
    """The writes of one step, in order, and where the release stands after them."""

    writes: tuple[EmptyNodePlan | DeleteNodePlan, ...]
    outcome: Release


def decide_release_step(node_plans: Sequence[Mapping[str, Any]]) -> ReleaseStep:
    """One step over the job's ``node_plans``: empty those that still assign GPUs, delete
    those whose agent confirmed the empty revision, wait for the others."""
    writes: list[EmptyNodePlan | DeleteNodePlan] = []
    waiting = []
    for obj in node_plans:
        spec = obj.get("spec") or {}
        node = str(spec.get("node", "?"))
        revision = int(spec.get("revision") or 0)
        if spec.get("assignments"):
            emptied = {**spec, "assignments": [], "plans": {}, "profiling": None}
            emptied["revision"] = revision + 1
            metadata = obj.get("metadata") or {}
            # Only what identifies it: a body with the server's fields (resourceVersion, uid)
            # is refused on create (HTTP 500 from kube-apiserver).
            body = {
                "apiVersion": resources.API_VERSION,
                "kind": resources.NODE_PLAN_KIND,
                "metadata": {
                    "name": metadata.get("name"),
                    "namespace": metadata.get("namespace"),
                    "labels": metadata.get("labels") or {},
                },
                "spec": emptied,
            }
            writes.append(EmptyNodePlan(body))
            waiting.append(node)
        elif node_plan_status(obj).observed_revision == revision:
            writes.append(DeleteNodePlan(*resources.object_key(obj)))
        else:
            waiting.append(node)
    return ReleaseStep(tuple(writes), Release(done=not waiting, waiting_for=tuple(sorted(waiting))))


@dataclass(frozen=True)
class ReleaseDecision:
    """What the delete handler does after one release step.

    Attributes:
        retry_in_s: Seconds until the next step (the finalizer stays); ``None``: finish now.
        force: Finish by deleting the node plans left (:func:`~perseus_operator.jobs.lifecycle.
            force_release`): the agents did not confirm the reset in time.
        message: Why (for the retry, or the warning event when forcing).
    """

    retry_in_s: float | None
    force: bool = False
    message: str = ""

    @property
    def finish(self) -> bool:
        """Whether the finalizer may be removed now."""
        return self.retry_in_s is None


def decide_release(
    outcome: Release, waited_s: float, timeout_s: float, poll_s: float
) -> ReleaseDecision:
    """The next move of a deletion that has waited ``waited_s`` for the agents.

    Done: finish. Agents still resetting: retry in ``poll_s`` (sooner if the deadline is
    nearer), so that the handler never sleeps and many deletions proceed side by side. At
    ``timeout_s``: force (the same bound as before, counted across retries and restarts).
    """
    if outcome.done:
        return ReleaseDecision(retry_in_s=None)
    nodes = ", ".join(outcome.waiting_for)
    remaining_s = timeout_s - waited_s
    if remaining_s <= 0:
        return ReleaseDecision(
            retry_in_s=None,
            force=True,
            message=f"agents of {nodes} did not confirm the reset within {timeout_s:g} s; "
            "deleting their plans anyway",
        )
    return ReleaseDecision(
        retry_in_s=max(min(poll_s, remaining_s), 0.0),
        message=f"{RELEASE_PENDING}: waiting for the agents of {nodes} to reset their GPUs "
        f"({waited_s:.0f} of {timeout_s:g} s)",
    )
