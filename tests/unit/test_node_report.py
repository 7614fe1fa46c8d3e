"""The PerseusNodePlan status (perseus_api.node_report): one model that the agent writes and the
operator reads, camelCase on the wire, and readable in an older agent's snake_case during a
rolling upgrade."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from perseus_agent.plans.plan_status import invalid_status, report_status, stopped_status
from perseus_api import resources
from perseus_api.node_report import (
    GpuProfilingReport,
    NodePlanStatus,
    NodeReport,
    legacy_keys,
    status_document,
    wire_name,
)
from perseus_operator.jobs.node_status import node_plan_status
from support.factories import OLD_AGENT_STATUS, merge_patch, node_report

SNAKE = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)+$")


def _keys(node: Any, path: str = "") -> Iterator[str]:
    """Every key in a JSON document, as a dotted path."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield f"{path}{key}"
            yield from _keys(value, f"{path}{key}.")
    elif isinstance(node, list):
        for item in node:
            yield from _keys(item, f"{path}[].")


def _plan(status: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "ml", "name": "gpt3-n1"}, "spec": {}, "status": status}


def test_wire_names_are_camel_case_with_units_spelled_out() -> None:
    assert wire_name("mean_iteration_s") == "meanIterationSeconds"
    assert wire_name("applied_mhz") == "appliedMHz"
    assert wire_name("blocking_power_w") == "blockingPowerWatts"
    assert wire_name("energy_j") == "energyJoules"
    assert wire_name("dp_rank") == "dpRank"
    assert wire_name("observed_revision") == resources.STATUS_OBSERVED_REVISION
    assert wire_name("reported_at") == resources.STATUS_REPORTED_AT
    assert wire_name("rows") == "rows"


def test_an_old_agents_snake_case_status_and_a_new_one_read_alike() -> None:
    old = NodePlanStatus.model_validate(OLD_AGENT_STATUS)
    new_document = report_status(node_report())
    new = NodePlanStatus.model_validate(new_document)
    assert new.model_dump(exclude={"reported_at", "conditions"}) == old.model_dump(
        exclude={"reported_at", "conditions"}
    )
    assert old.ranks[0].mean_iteration_s == 0.5 and old.gpus[0].dp_rank == 2
    assert old.profiling[0].rows[0].energy_j == 3.0
    # Through the operator's one reader, too.
    assert node_plan_status(_plan(OLD_AGENT_STATUS)) == old
    assert node_plan_status(_plan(new_document)).ranks == old.ranks


def test_the_agent_writes_no_snake_case_key() -> None:
    documents = [
        report_status(node_report()),
        invalid_status("broken", 3),
        stopped_status(3, reset_ok=True),
    ]
    for document in documents:
        assert [k for k in _keys(document) if SNAKE.match(k.rsplit(".", 1)[-1])] == []
    assert "meanIterationSeconds" in documents[0]["ranks"][0]
    assert "appliedMHz" in documents[0]["gpus"][0]


def test_the_agents_patch_over_an_old_agents_status_leaves_no_old_key() -> None:
    """A merge patch keeps what it does not name: each top-level key an old agent wrote is
    named (rewritten, or nulled), and the lists, replaced whole, carry only the new keys."""
    assert set(legacy_keys()) <= set(status_document(NodePlanStatus()))
    for document in (report_status(node_report()), invalid_status("broken", 3)):
        merged = merge_patch(OLD_AGENT_STATUS, document)
        assert [k for k in _keys(merged) if SNAKE.match(k.rsplit(".", 1)[-1])] == []
    stopped = merge_patch(OLD_AGENT_STATUS, stopped_status(4, reset_ok=True))
    assert NodePlanStatus.model_validate(stopped).gpus == []  # the old report is gone
    assert stopped["conditions"][0]["reason"] == resources.REASON_AGENT_STOPPED
    # An invalid spec's status keeps the last reportedAt, as before the model.
    assert stopped["reportedAt"] == OLD_AGENT_STATUS["reportedAt"]


def test_report_fields_are_nulled_when_nothing_is_applied() -> None:
    bad = invalid_status("spec.node is n2, not this node", None)
    report_keys = {wire_name(name) for name in NodeReport.model_fields}
    assert {k for k, v in bad.items() if v is None} == report_keys | {"observedRevision"}
    assert "reportedAt" not in bad
    assert NodePlanStatus.model_validate(bad).conditions[0].reason == "InvalidSpec"


def test_a_status_reads_the_same_once_the_api_server_dropped_its_null_fields() -> None:
    for written in (OLD_AGENT_STATUS, report_status(node_report())):
        stored = merge_patch({}, written)
        assert "uuid" not in stored["gpus"][1]  # the API server drops it
        assert NodePlanStatus.model_validate(stored) == NodePlanStatus.model_validate(written)


def test_an_older_agents_profile_rows_without_stage_or_samples_are_the_reports() -> None:
    entry = {**OLD_AGENT_STATUS["profiling"][0]}
    entry["rows"] = [{k: v for k, v in entry["rows"][0].items() if k not in ("stage", "samples")}]
    [row] = GpuProfilingReport.model_validate(entry).rows
    assert (row.stage, row.samples) == (1, 1)


def test_a_newer_agents_extra_keys_are_ignored() -> None:
    status = {**OLD_AGENT_STATUS, "somethingNew": 1}
    status["ranks"] = [{**OLD_AGENT_STATUS["ranks"][0], "p99IterationSeconds": 0.7}]
    assert NodePlanStatus.model_validate(status) == NodePlanStatus.model_validate(OLD_AGENT_STATUS)


@pytest.mark.parametrize(
    ("status", "problem"),
    [
        ({"observedRevision": "seven"}, "observedRevision"),
        ({"ranks": [{"rank": 0, "iterations": 3}]}, "ranks.0.lastIterationSeconds"),
        ({"gpus": "all"}, "gpus"),
        ("not an object", "status is not an object"),
    ],
)
def test_a_malformed_status_is_reported_once_not_crashed_on(
    status: Any, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    plan = _plan(status)
    plan["metadata"]["resourceVersion"] = f"{id(status)}"
    with caplog.at_level(logging.WARNING, logger="perseus_operator.jobs.node_status"):
        assert node_plan_status(plan) == NodePlanStatus()
        assert node_plan_status(plan) == NodePlanStatus()  # the same version: not logged again
    [record] = caplog.records
    assert record.getMessage().startswith("PerseusNodePlan ml/gpt3-n1: ")
    assert problem in record.getMessage()
    with pytest.raises(resources.NodePlanObjectError, match=re.escape(problem)):
        resources.parse_node_plan_status(plan)


def test_no_status_yet_is_an_empty_one() -> None:
    assert node_plan_status({"metadata": {"name": "x"}}) == NodePlanStatus()
    assert node_plan_status(_plan({})) == NodePlanStatus()


def test_a_status_is_validated_once_per_object_version() -> None:
    plan = _plan(OLD_AGENT_STATUS)
    plan["metadata"]["resourceVersion"] = "41"
    first = node_plan_status(plan)
    assert node_plan_status(plan) is first  # the same version: not validated again
    changed = {**plan, "metadata": {**plan["metadata"], "resourceVersion": "42"}}
    changed["status"] = {**OLD_AGENT_STATUS, "observedRevision": 5}
    assert node_plan_status(changed).observed_revision == 5
    # Without a resourceVersion (a fake), every read validates what is there now.
    unversioned = _plan(dict(OLD_AGENT_STATUS))
    assert node_plan_status(unversioned).observed_revision == 4
    unversioned["status"]["observedRevision"] = 6
    assert node_plan_status(unversioned).observed_revision == 6
