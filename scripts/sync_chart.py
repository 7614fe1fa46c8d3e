"""Bring the Helm chart up to date with its sources, or check that it is (``--check``).

What is generated in ``helm/perseus/``:

- ``crds/*.yaml``: copies of the repository's ``crds/*.yaml`` (themselves generated from
  ``perseus_api``);
- ``dashboards/*.json``: the Grafana dashboards of ``scripts/grafana_dashboards.py``;
- ``values.schema.json``'s ``properties.defaultPolicy``: the CRD's ``spec.policy`` schema,
  turned from OpenAPI v3 into JSON Schema; and ``properties.clusterPolicy.properties.spec``:
  the PerseusPolicy CRD's ``spec`` schema, likewise.

``tests/integration/test_helm_chart.py`` fails, naming this script, when any of them is stale.

Usage: ``python scripts/sync_chart.py [--check]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "perseus"
CRDS = REPO / "crds"
JOB_CRD = CRDS / "perseus.energy_perseusjobs.yaml"
POLICY_CRD = CRDS / "perseus.energy_perseuspolicies.yaml"


def _dashboards_module() -> ModuleType:
    path = Path(__file__).with_name("grafana_dashboards.py")
    spec = importlib.util.spec_from_file_location("grafana_dashboards", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("grafana_dashboards", module)
    spec.loader.exec_module(module)
    return module


def openapi_to_json_schema(node: Any) -> Any:
    """An OpenAPI v3 (CRD) schema as JSON Schema: ``nullable``, boolean ``exclusiveMinimum``
    and ``exclusiveMaximum`` translated, Kubernetes extensions (CEL rules) dropped, and objects
    closed to unknown fields (the API server prunes them)."""
    if isinstance(node, list):
        return [openapi_to_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
            continue
        if key in ("properties", "patternProperties", "$defs"):
            out[key] = {k: openapi_to_json_schema(v) for k, v in value.items()}
        else:
            out[key] = openapi_to_json_schema(value)
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if node.get(exclusive) is True and bound in out:
            out[exclusive] = out.pop(bound)
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", False)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _spec_schema(crd_path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(crd_path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    spec: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


def policy_schema() -> dict[str, Any]:
    schema: dict[str, Any] = openapi_to_json_schema(_spec_schema(JOB_CRD)["properties"]["policy"])
    schema["description"] = (
        "Default energy policy of PerseusJobs that leave spec.policy fields unset (the CRD's "
        "spec.policy)."
    )
    return schema


def cluster_policy_spec_schema() -> dict[str, Any]:
    schema: dict[str, Any] = openapi_to_json_schema(_spec_schema(POLICY_CRD))
    schema["description"] = "spec of the PerseusPolicy (the CRD's spec)."
    return schema


def expected_files() -> dict[Path, str]:
    """Path -> content of every generated file."""
    files: dict[Path, str] = {}
    for crd in sorted(CRDS.glob("*.yaml")):
        files[CHART / "crds" / crd.name] = crd.read_text()
    for name, text in _dashboards_module().render_all().items():
        files[CHART / "dashboards" / name] = text
    schema_path = CHART / "values.schema.json"
    schema = json.loads(schema_path.read_text())
    schema["properties"]["defaultPolicy"] = policy_schema()
    schema["properties"]["clusterPolicy"]["properties"]["spec"] = cluster_policy_spec_schema()
    files[schema_path] = json.dumps(schema, indent=2) + "\n"
    return files


def stale_files() -> list[Path]:
    """Generated files that differ from their source, plus generated files that have none."""
    expected = expected_files()
    stale = [p for p, text in expected.items() if not p.exists() or p.read_text() != text]
    for folder, pattern in (("crds", "*.yaml"), ("dashboards", "*.json")):
        stale += [p for p in (CHART / folder).glob(pattern) if p not in expected]
    return sorted(stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    stale = stale_files()
    if args.check:
        for path in stale:
            print(f"stale: {path.relative_to(REPO)}")
        return 1 if stale else 0
    expected = expected_files()
    for path in stale:
        if path in expected:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(expected[path])
            print(f"wrote {path.relative_to(REPO)}")
        else:
            path.unlink()
            print(f"removed {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
