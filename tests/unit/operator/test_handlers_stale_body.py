"""A handler that waited for the job's lock reconciles from the status last decided, not from
the body it was called with (kopf applies a patch only after its handler returns)."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from perseus_api.job_status import PerseusJobStatus, Phase
from perseus_operator import handlers
from perseus_operator.jobs.lifecycle import Outcome


class Metrics:
    def observe_job(self, *_: Any, **__: Any) -> None:
        pass


def body(uid: str = "uid-1", status: dict[str, Any] | None = None) -> kopf.Body:
    raw: dict[str, Any] = {
        "apiVersion": "perseus.energy/v1alpha1",
        "kind": "PerseusJob",
        "metadata": {"namespace": "ml", "name": "gpt3", "uid": uid},
        "spec": {},
    }
    if status is not None:
        raw["status"] = status
    return kopf.Body(raw)


@pytest.fixture
def operator(monkeypatch: pytest.MonkeyPatch) -> tuple[kopf.Memo, list[int]]:
    """An operator whose reconcile moves a job one revision on from the status it is given."""
    seen: list[int] = []

    async def one_revision_on(raw: dict[str, Any], *_: Any, **__: Any) -> Outcome:
        revision = int((raw.get("status") or {}).get("revision") or 0)
        seen.append(revision)
        return Outcome(status=PerseusJobStatus(phase=Phase.RUNNING, revision=revision + 1))

    monkeypatch.setattr(handlers, "reconcile", one_revision_on)
    state = handlers._Operator(
        kube=None,  # type: ignore[arg-type]
        planner=None,  # type: ignore[arg-type]
        metrics=Metrics(),  # type: ignore[arg-type]
        policies=None,  # type: ignore[arg-type]
    )
    memo = kopf.Memo()
    memo["perseus"] = state
    return memo, seen


def run(memo: kopf.Memo, job: kopf.Body) -> kopf.Patch:
    patch = kopf.Patch()
    indexes = handlers._Indexes({}, {}, {})  # type: ignore[arg-type]
    asyncio.run(handlers._reconcile(job, patch, memo, indexes))
    return patch


def test_a_stale_body_does_not_take_the_revision_back(
    operator: tuple[kopf.Memo, list[int]],
) -> None:
    memo, seen = operator
    stale = body()  # both handlers were called before the first status write
    assert run(memo, stale)["status"]["revision"] == 1
    assert run(memo, stale)["status"]["revision"] == 2  # not 1 again
    assert seen == [0, 1]


def test_a_new_job_of_the_same_name_starts_from_its_own_status(
    operator: tuple[kopf.Memo, list[int]],
) -> None:
    memo, seen = operator
    run(memo, body("uid-1"))
    assert run(memo, body("uid-2"))["status"]["revision"] == 1
    assert seen == [0, 0]


def test_a_status_the_api_does_not_show_is_written_again(
    operator: tuple[kopf.Memo, list[int]],
) -> None:
    """The diff is against the body: if kopf could not apply a patch, the next one carries
    the fields again."""
    memo, _ = operator
    run(memo, body())
    patch = run(memo, body(status={"revision": 0}))
    assert patch["status"]["revision"] == 2 and patch["status"]["phase"] == "Running"
