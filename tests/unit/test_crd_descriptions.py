"""Every field of the user-facing CRDs says what it is, in plain text (``kubectl explain``).

The descriptions come from the pydantic models' field docstrings and descriptions
(:mod:`perseus_api.crd`); ``tests/e2e/test_cluster_api.py`` reads them back from the real
API server's OpenAPI document.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from perseus_api import crd_reference
from perseus_api.crd import (
    get_job_crd,
    get_node_plan_crd,
    get_policy_crd,
    get_power_budget_crd,
)


def undescribed(schema: Mapping[str, Any], path: str, root: bool = False) -> Iterator[str]:
    for name, field in (schema.get("properties") or {}).items():
        where = f"{path}.{name}"
        # The API server describes an object's metadata (ObjectMeta) itself; a CRD may not.
        exempt = root and name == "metadata"
        if not exempt and not str(field.get("description", "")).strip():
            yield where
        yield from undescribed(field, where)
    if isinstance(schema.get("items"), Mapping):
        yield from undescribed(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from undescribed(schema["additionalProperties"], f"{path}{{}}")


def descriptions(schema: Mapping[str, Any]) -> Iterator[str]:
    if "description" in schema:
        yield str(schema["description"])
    for key in ("properties",):
        for field in (schema.get(key) or {}).values():
            yield from descriptions(field)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from descriptions(schema[key])


CRDS = {
    "PerseusJob": get_job_crd,
    "PerseusNodePlan": get_node_plan_crd,
    "PerseusPolicy": get_policy_crd,
    "PerseusPowerBudget": get_power_budget_crd,
}


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_every_field_is_described(kind: str) -> None:
    schema = CRDS[kind]()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert list(undescribed(schema, kind, root=True)) == []


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_descriptions_are_plain_text(kind: str) -> None:
    schema = CRDS[kind]()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    markup = [d for d in descriptions(schema) if "``" in d or re.search(r":[a-z]+:`", d)]
    assert markup == []


def test_the_reference_page_is_current() -> None:
    committed = Path(__file__).resolve().parents[2] / crd_reference.DEFAULT_OUT
    assert committed.read_text(encoding="utf-8") == crd_reference.page(), (
        "docs/reference/crds.md is stale: python -m perseus_api.crd_reference"
    )
