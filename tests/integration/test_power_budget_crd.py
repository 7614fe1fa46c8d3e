"""The PerseusPowerBudget CRD: generated from its model, its sample, CEL rules and columns.

The drift test of every CRD (``tests/integration/test_crd.py``) covers this one's file too;
here: what is particular to it, checked against the model and the CRD's own schema (JSON
Schema validation, as there; CEL rules need a real API server, so each rule is checked to be
in the CRD beside the model's validator that gives the same message).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from perseus_api import crd
from perseus_api.job import Policy
from perseus_api.power_budget import (
    MARGIN_RULES,
    NODE_SELECTOR_RULES,
    Enforcement,
    PerseusPowerBudgetSpec,
    PerseusPowerBudgetStatus,
    PowerBudgetSpecError,
    parse_power_budget,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE = REPO_ROOT / "crds" / "samples" / "perseuspowerbudget.yaml"
CHART_CRD = REPO_ROOT / "helm" / "perseus" / "crds" / "perseus.energy_perseuspowerbudgets.yaml"


def _schema() -> dict[str, Any]:
    (version,) = crd.get_power_budget_crd()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _json_schema(node: Any) -> Any:
    """Structural schema -> JSON Schema draft 4 (``nullable`` as a null type, no extensions)."""
    if isinstance(node, list):
        return [_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k != "nullable"}  # fmt: skip
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
    return out


def _errors(instance: Any, schema: dict[str, Any] | None = None) -> list[str]:
    validator = jsonschema.Draft4Validator(_json_schema(schema or _schema()))
    return sorted(".".join(map(str, e.absolute_path)) for e in validator.iter_errors(instance))


def _sample() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(SAMPLE.read_text(encoding="utf-8"))
    return document


def test_sample_validates_and_parses() -> None:
    sample = _sample()
    assert sample["kind"] == "PerseusPowerBudget" and "namespace" not in sample["metadata"]
    assert _errors(sample) == []
    spec = parse_power_budget(sample)
    assert spec.budget_watts == 42000 and spec.enforcement is Enforcement.PLANS
    assert spec.planned_watts == pytest.approx(39900)
    assert spec.node_selector.match_labels == {"topology.example.com/rack": "a12"}


def test_names_scope_columns_and_chart_copy() -> None:
    definition = crd.get_power_budget_crd()
    spec = definition["spec"]
    assert definition["metadata"]["name"] == "perseuspowerbudgets.perseus.energy"
    assert spec["scope"] == "Cluster" and spec["names"]["shortNames"] == ["ppb"]
    (version,) = spec["versions"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Budget W", "Measured W", "Headroom W", "Jobs", "Met", "Enforcement", "Age",
    ]  # fmt: skip
    status = _schema()["properties"]["status"]["properties"]
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".status."):
            field = path.split(".")[2].split("[")[0]
            assert field in status, path
    # The chart ships the same file (scripts/sync_chart.py copies it).
    assert CHART_CRD.read_text(encoding="utf-8") == crd.crd_files()[CHART_CRD.name]


def _with(path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(_sample()["spec"])
    node = spec
    *parents, last = path.split(".")
    for name in parents:
        node = node[name]
    node[last] = value
    return spec


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("budgetWatts", 0, "budgetWatts"),
        ("budgetWatts", -5, "budgetWatts"),
        ("averagingWindowSeconds", 5, "averagingWindowSeconds"),
        ("safetyMarginRatio", 1.0, "safetyMarginRatio"),
        ("enforcement", "PowerLimitsOnly", "enforcement"),
        ("rebalanceBandRatio", 0.9, "rebalanceBandRatio"),
    ],
)
def test_bad_fields_are_rejected_by_model_and_schema(path: str, value: Any, field: str) -> None:
    spec = _with(path, value)
    assert _errors(spec, _schema()["properties"]["spec"]) == [field]
    with pytest.raises(ValidationError):
        PerseusPowerBudgetSpec.model_validate(spec)


@pytest.mark.parametrize(
    ("spec_path", "value", "at", "rule"),
    [
        ("nodeSelector", {}, ("nodeSelector",), NODE_SELECTOR_RULES[0]),
        ("budgetWatts", 1.02, (), MARGIN_RULES[0]),  # less 5 %: under 1 W
    ],
)
def test_cross_field_rules_are_in_model_and_crd(
    spec_path: str, value: Any, at: tuple[str, ...], rule: tuple[str, str]
) -> None:
    spec = _with(spec_path, value)
    node = _schema()["properties"]["spec"]
    assert _errors(spec, node) == []  # the per-field schema lets it through: the rule does not
    for name in at:
        node = node["properties"][name]
    expression, message = rule
    assert {"rule": expression, "message": message} in node["x-kubernetes-validations"]
    with pytest.raises(ValidationError, match=message.split(":")[0][:40]):
        PerseusPowerBudgetSpec.model_validate(spec)


def test_parse_errors_name_the_budget() -> None:
    with pytest.raises(PowerBudgetSpecError, match=r"metadata\.name is missing"):
        parse_power_budget({"spec": {}})
    with pytest.raises(PowerBudgetSpecError, match=r"PerseusPowerBudget rack: invalid spec: "):
        parse_power_budget({"metadata": {"name": "rack"}, "spec": {"budgetWatts": 10}})


def test_status_serializes_to_the_crd_schema() -> None:
    status = PerseusPowerBudgetStatus.model_validate(
        {
            "budgetWatts": 42000.0,
            "measuredWatts": 40100.5,
            "headroomWatts": 1899.5,
            "allocatedWatts": 36000.0,
            "unmanagedWatts": 4100.5,
            "nodes": 12,
            "managedJobs": 1,
            "jobs": [
                {
                    "namespace": "ml",
                    "name": "gpt3",
                    "allocatedWatts": 36000.0,
                    "slowdownRatio": 0.004,
                    "weight": 1.0,
                    "gpus": 64,
                }
            ],
            "conditions": [{"type": "Met", "status": "True", "reason": "WithinBudget"}],
        }
    )
    body = status.model_dump(by_alias=True, mode="json")
    assert _errors(body, _schema()["properties"]["status"]) == []


def test_power_weight_on_the_job_policy() -> None:
    assert Policy().power_weight == 1.0
    assert Policy.model_validate({"powerWeight": 2.5}).power_weight == 2.5
    with pytest.raises(ValidationError):
        Policy.model_validate({"powerWeight": 0})
    job_policy = crd.get_job_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = job_policy["properties"]["spec"]["properties"]["policy"]["properties"]["powerWeight"]
    assert field["type"] == "number" and "default" not in field  # the operator fills defaults
