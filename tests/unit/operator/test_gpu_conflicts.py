"""Which of two PerseusJobs on the same GPUs keeps them (issue 18, item 12)."""

from __future__ import annotations

from typing import Any

import pytest

from perseus_operator.jobs.gpu_conflicts import (
    GpuClaim,
    claims_of_node_plans,
    decide_gpu_conflict,
    planned_gpus,
)

NS = "ml"


def claim(job: str, created: str, *gpus: tuple[str, int]) -> GpuClaim:
    """A claim of the GPUs of processes ``(node, local rank)`` of pod ``p``."""
    return GpuClaim(NS, job, created, frozenset(_keys(*gpus)))


def _keys(*gpus: tuple[str, int]) -> set[tuple[str, str]]:
    return {(node, f"p#{local}") for node, local in gpus}


def node_plan(job: str, node: str, *local_ranks: int) -> dict[str, Any]:
    """The operator's form: GPUs named by pod and local rank, never by a node GPU index."""
    assignments = [
        {"pod": "p", "container": "c", "local_rank": i, "plan": "p", "stage": 0, "rank": i}
        for i in local_ranks
    ]
    return {"spec": {"job": job, "namespace": NS, "node": node, "assignments": assignments}}


def job(name: str, created: str | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": NS}
    if created is not None:
        metadata["creationTimestamp"] = created
    return {"metadata": metadata}


def test_the_older_job_keeps_shared_gpus_and_the_newer_is_told_which_job_holds_them() -> None:
    old = claim("old", "2026-12-01T10:00:00Z", ("n1", 0), ("n1", 1))
    new = claim("new", "2026-12-01T10:00:05Z", ("n1", 1), ("n2", 0))
    assert decide_gpu_conflict(old, [new]) is None
    conflict = decide_gpu_conflict(new, [old])
    assert conflict is not None
    assert conflict.holder == old
    assert conflict.shared == (("n1", "p#1"),)
    assert conflict.message.startswith(
        "GPUs n1/p#1 are planned by the older PerseusJob ml/old, created 2026-12-01T10:00:00Z"
    )


def test_same_creation_time_falls_back_to_the_name_and_unknown_times_are_newest() -> None:
    a = claim("a", "2026-12-01T10:00:00Z", ("n", 0))
    b = claim("b", "2026-12-01T10:00:00+00:00", ("n", 0))
    assert decide_gpu_conflict(a, [b]) is None
    conflict = decide_gpu_conflict(b, [a])
    assert conflict is not None and conflict.holder.job == "a"
    unknown = claim("0-unknown", "", ("n", 0))
    assert decide_gpu_conflict(a, [unknown]) is None
    assert decide_gpu_conflict(unknown, [a]) is not None


@pytest.mark.parametrize("others", [[], [claim("x", "2020-01-01T00:00:00Z", ("n", 7))]])
def test_no_shared_gpu_no_conflict(others: list[GpuClaim]) -> None:
    assert decide_gpu_conflict(claim("me", "2026-12-01T10:00:00Z", ("n", 0)), others) is None


def test_the_oldest_holder_is_named_and_a_job_never_conflicts_with_itself() -> None:
    me = claim("me", "2026-12-01T12:00:00Z", ("n", 0), ("n", 1))
    older = claim("older", "2026-12-01T11:00:00Z", ("n", 0))
    oldest = claim("oldest", "2026-12-01T09:00:00Z", ("n", 1))
    conflict = decide_gpu_conflict(me, [older, oldest, me])
    assert conflict is not None and conflict.holder.job == "oldest"
    assert decide_gpu_conflict(me, [me]) is None


def test_many_shared_gpus_are_listed_briefly() -> None:
    gpus = [("n", i) for i in range(8)]
    conflict = decide_gpu_conflict(
        claim("me", "2026-12-01T12:00:00Z", *gpus), [claim("o", "2026-12-01T11:00:00Z", *gpus)]
    )
    assert conflict is not None
    assert "n/p#0, n/p#1, n/p#2, n/p#3 and 4 more" in conflict.message


def test_claims_come_from_the_node_plans_of_jobs_that_still_exist() -> None:
    plans = [
        node_plan("a", "n1", 0, 1),
        node_plan("a", "n2", 0),
        node_plan("gone", "n1", 2),  # its job was deleted: the garbage collector removes it
        node_plan("released", "n3"),  # emptied for a deletion: claims nothing
        {"spec": {"job": "a", "namespace": NS, "node": "n4", "assignments": [{"oops": 1}]}},
    ]
    jobs = [job("a", "2026-12-01T10:00:00Z"), job("released", None)]
    claims = claims_of_node_plans(plans, jobs)
    assert claims == [claim("a", "2026-12-01T10:00:00Z", ("n1", 0), ("n1", 1), ("n2", 0))]
    assert planned_gpus(plans) == _keys(("n1", 0), ("n1", 1), ("n2", 0), ("n1", 2))
    # A plan of an older operator, by node GPU index, claims nothing it can tell.
    legacy = {
        "spec": {"job": "a", "namespace": NS, "node": "n5", "assignments": [{"gpu_index": 0}]}
    }
    assert planned_gpus([legacy]) == frozenset()
