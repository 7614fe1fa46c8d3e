"""Upgrading from the snake_case node plan spec to the camelCase one breaks nothing.

Operators before the change wrote a PerseusNodePlan's spec in snake_case (``dp_rank``,
``num_stages``, ``unit_time_s``); the new operator writes camelCase with units spelled out
(``dpRank``, ``numStages``, ``unitTimeSeconds``), like the status beside it. During the
rollout a new agent meets old objects, the new operator overwrites old objects, and plan
files written by hand or by ``perseus plan`` keep their snake_case keys: each is tested here.
The real API server's side (an old object stored and rewritten) is in
``tests/e2e/test_cluster_api.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.modes.standalone_mode import load_plan
from perseus_api import resources
from perseus_api.crd import get_node_plan_crd
from perseus_api.node_plan import NodePlan
from support.factories import merge_patch, pipeline_plan_fields


def _plan(revision: int = 3, mhz: int = 1200, straggler: bool = False) -> NodePlan:
    """A node plan as the operator writes one: GPUs by process, profiling and two plans."""
    fields = pipeline_plan_fields(num_stages=2)
    fields["target_iteration_time_s"] = 1.5
    for stage in fields["stages"]:
        stage["frequency_mhz"] = mhz
    plans = {"tmin": fields, **({"straggler": pipeline_plan_fields()} if straggler else {})}
    return NodePlan.model_validate(
        {
            "node": "gpu-node-1",
            "namespace": "ml",
            "job": "gpt3",
            "revision": revision,
            "granularity": "Instruction",
            "plans": plans,
            "assignments": [
                {
                    "pod": "gpt3-worker-0",
                    "pod_uid": "uid-0",
                    "container": "pytorch",
                    "local_rank": local,
                    "plan": "tmin",
                    "stage": local,
                    "dp_rank": 1,
                    "rank": 2 + local,
                }
                for local in (0, 1)
            ],
            "profiling": {
                "frequencies_mhz": [1410, 1200],
                "iterations_per_frequency": 3,
                "warmup_iterations": 1,
            },
        }
    )


def _old_object(plan: NodePlan) -> dict[str, Any]:
    """The object an operator of the older version wrote for ``plan``: its spec by field name
    (``model_dump(mode="json")``, as ``node_plan_object`` did then)."""
    body = resources.node_plan_object(plan)
    return {**body, "spec": plan.model_dump(mode="json")}


def _keys(node: Any, under_plans: bool = False) -> Iterator[str]:
    """Every field name in a spec document (the names of ``plans`` are the user's, skipped)."""
    if isinstance(node, list):
        for item in node:
            yield from _keys(item)
    elif isinstance(node, Mapping):
        for key, value in node.items():
            if not under_plans:
                yield key
            yield from _keys(value, under_plans=key == "plans" and not under_plans)


def test_the_old_object_is_in_snake_case() -> None:
    keys = set(_keys(_old_object(_plan())["spec"]))
    assert {"dp_rank", "local_rank", "num_stages", "unit_time_s", "frequencies_mhz"} <= keys


def test_the_operator_writes_camel_case_only() -> None:
    spec = resources.node_plan_object(_plan())["spec"]
    keys = set(_keys(spec))
    assert not [k for k in keys if "_" in k], keys
    assert {"dpRank", "localRank", "podUid", "numStages", "unitTimeSeconds"} <= keys
    assert {"frequencyMHz", "frequenciesMHz", "tMinSeconds", "blockingPowerWatts"} <= keys
    assert spec["plans"]["tmin"]["instructionEstimate"]["iterationTimeSeconds"] == 1.0
    # The status beside it spells its keys alike (node_report.wire_name).
    assert "targetIterationTimeSeconds" in spec["plans"]["tmin"]


def test_a_new_agent_reads_an_old_operators_object() -> None:
    plan = _plan()
    old = json.loads(json.dumps(_old_object(plan)))
    assert resources.parse_node_plan_object(old) == plan


def test_a_new_agent_reads_the_new_operators_object() -> None:
    plan = _plan()
    new = json.loads(json.dumps(resources.node_plan_object(plan)))
    assert resources.parse_node_plan_object(new) == plan


@pytest.mark.parametrize("straggler", [False, True])
def test_the_new_operators_patch_of_an_old_object_leaves_camel_case_only(straggler: bool) -> None:
    """The operator merge-patches an existing node plan's spec: objects (``plans``, their
    estimates, ``profiling``) merge key by key, so the snake_case keys must be removed by the
    patch itself, or the stored spec would hold both spellings (which no reader accepts)."""
    stored = _old_object(_plan(revision=3, mhz=1200))
    wanted = _plan(revision=4, mhz=1005, straggler=straggler)
    spec = resources.node_plan_object(wanted)["spec"]
    patched = merge_patch(stored["spec"], resources.without_snake_case_keys(spec))
    assert not [k for k in _keys(patched) if "_" in k]
    assert NodePlan.model_validate(patched) == wanted
    # What the plain camelCase patch would have stored: both spellings, refused.
    mixed = merge_patch(stored["spec"], spec)
    with pytest.raises(ValueError, match="Extra inputs"):
        NodePlan.model_validate(mixed)


def test_the_patch_of_a_new_object_only_adds_nulls_for_absent_keys() -> None:
    spec = resources.node_plan_object(_plan())["spec"]
    patched = merge_patch(spec, resources.without_snake_case_keys(spec))
    assert patched == merge_patch({}, spec)


def _spec_schema() -> dict[str, Any]:
    (version,) = get_node_plan_crd()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def _objects(node: Mapping[str, Any], path: str = "spec") -> Iterator[tuple[str, Any]]:
    if node.get("type") == "object":
        yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _objects(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), Mapping):
            yield from _objects(node[key], f"{path}[]")


def test_the_crd_keeps_an_old_objects_keys_and_requires_none_it_lacks() -> None:
    """The API server must neither prune an old object's snake_case keys (an agent reads
    them until the new operator rewrites the object), nor refuse it for lacking a camelCase
    key, nor add a camelCase default beside a snake_case value (``dpRank: 0`` beside
    ``dp_rank: 1``)."""
    for path, node in _objects(_spec_schema()):
        assert node.get("x-kubernetes-preserve-unknown-fields") is True, path
        assert all(name == name.lower() for name in node.get("required", [])), path
        for name, field in (node.get("properties") or {}).items():
            assert "default" not in field, f"{path}.{name}"


@pytest.mark.parametrize("spelling", ["snake_case", "camelCase"])
def test_a_standalone_agents_plan_file_may_use_either_spelling(
    tmp_path: Path, spelling: str
) -> None:
    plan = _plan()
    document = plan.model_dump(mode="json", by_alias=spelling == "camelCase")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    assert load_plan(path, "gpu-node-1") == plan


def test_the_operator_reads_old_and_new_objects_alike() -> None:
    """The operator reads stored node plans of both spellings: the other jobs' GPUs (conflicts)
    and each rank's expected iteration time (stragglers)."""
    from perseus_operator.jobs.gpu_conflicts import planned_gpus
    from perseus_operator.jobs.running_decisions import expected_iteration_s

    plan = _plan()
    old, new = _old_object(plan), resources.node_plan_object(plan)
    assert (
        planned_gpus([old])
        == planned_gpus([new])
        == {
            ("gpu-node-1", "gpt3-worker-0#0"),
            ("gpu-node-1", "gpt3-worker-0#1"),
        }
    )
    assert expected_iteration_s(old) == expected_iteration_s(new) == {2: 1.0, 3: 1.0}
