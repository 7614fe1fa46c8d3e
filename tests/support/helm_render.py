"""Render and lint the Helm chart ``helm/perseus`` offline, for tests.

Uses PyPI ``helm-python-sdk`` (import ``helm_python``), which embeds Helm's own engine, so no
``helm`` binary is needed. Tests that use this module skip when the package is missing (it is in
the ``test`` extra).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "helm" / "perseus"
RELEASE = "perseus"
NAMESPACE = "perseus-system"

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")


@dataclass(frozen=True)
class Rendered:
    """One rendering of the chart: its objects (CRDs excluded, as Helm installs those from
    ``crds/`` apart from the templates) and its NOTES.txt."""

    objects: list[dict[str, Any]]
    notes: str
    files: dict[str, str]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o.get("kind") == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"{len(found)} {kind} named *{name_suffix}"
        return found[0]


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@functools.cache
def _chart() -> Any:
    return helm_python.Chart.load(str(CHART))


def default_values() -> dict[str, Any]:
    values: dict[str, Any] = _chart().values
    return values


def render(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Rendered:
    """Render the chart with ``values`` over its defaults, as ``helm template`` would.

    Raises:
        helm_python.HelmValuesError: the values violate values.schema.json.
        helm_python.HelmRenderError: a template fails (e.g. its ``fail`` call).
    """
    files = _chart().render(dict(values or {}), name=release, namespace=namespace)
    objects: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects.extend(d for d in yaml.safe_load_all(text) if d)
    return Rendered(objects, notes, files)


def crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(c["data"]) for c in sorted(_chart().crds, key=lambda c: c["filename"])]


def lint(values: Mapping[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """``helm lint`` findings: ``{"messages": [{"severity", "path", "error"}], "errors"}``."""
    report: dict[str, Any] = helm_python.lint(str(CHART), dict(values or {}), **options)
    return report


def validate_values(values: Mapping[str, Any]) -> None:
    """Check ``values`` (merged over the defaults) against values.schema.json.

    Raises:
        helm_python.HelmValuesError: naming the offending key.
    """
    _chart().validate_schema(_chart().merge_values(dict(values)))


def walk(node: Any) -> Iterator[Any]:
    """Every value in a nested structure of dicts and lists."""
    yield node
    if isinstance(node, Mapping):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)
