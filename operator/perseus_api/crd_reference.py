"""The CRD reference page of the documentation, generated from the CRDs themselves.

``python -m perseus_api.crd_reference [--out FILE] [--check]`` writes (or checks)
``docs/reference/crds.md``: for each resource its names, scope and printer columns, then
every field with its type, bounds and description, as the API server publishes them (the
descriptions are the pydantic models' field docstrings, see :mod:`perseus_api.crd`). The
page is drift-tested like the CRD files, so it cannot say what the API does not do.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from perseus_api.crd import (
    get_job_crd,
    get_node_plan_crd,
    get_policy_crd,
    get_power_budget_crd,
)

DEFAULT_OUT: Final = Path("docs/reference/crds.md")

_INTRO: Final = """# Custom resources

Generated from the CRDs by `python -m perseus_api.crd_reference` (do not edit by hand;
`make test` fails when this page is stale). The same text is what `kubectl explain` shows,
for example `kubectl explain perseusjob.spec.policy --recursive`.

Users write `PerseusJob`, `PerseusPolicy` and `PerseusPowerBudget`; the operator writes
`PerseusNodePlan` for the node agents, which report in its status.
"""


def _type_of(field: Mapping[str, Any]) -> str:
    kind = str(field.get("type", "any"))
    if kind == "array" and isinstance(field.get("items"), Mapping):
        return f"[]{_type_of(field['items'])}"
    if kind == "object" and isinstance(field.get("additionalProperties"), Mapping):
        return f"map[string]{_type_of(field['additionalProperties'])}"
    if "enum" in field:
        return " | ".join(str(v) for v in field["enum"])
    return kind


def _bounds(field: Mapping[str, Any]) -> str:
    """Minimum, maximum, length and pattern constraints, in words."""
    parts = []
    low, high = field.get("minimum"), field.get("maximum")
    if low is not None:
        parts.append(f"{'>' if field.get('exclusiveMinimum') else '>='} {low}")
    if high is not None:
        parts.append(f"{'<' if field.get('exclusiveMaximum') else '<='} {high}")
    if field.get("maxLength") is not None:
        parts.append(f"length {field.get('minLength', 0)}-{field['maxLength']}")
    if field.get("default") is not None:
        parts.append(f"default {field['default']}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _rows(schema: Mapping[str, Any], path: str, required: Sequence[str]) -> Iterator[str]:
    for name, field in (schema.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        kind = _type_of(field)
        if name in required:
            kind += ", required"
        bounds = _bounds(field)
        description = _cell(str(field.get("description", "")))
        if bounds:
            description = f"{description} ({bounds})" if description else f"({bounds})"
        yield f"| `{where}` | {_cell(kind)} | {description} |"
        for rule in field.get("x-kubernetes-validations", []):
            yield f"| `{where}` | rule | {_cell(str(rule.get('message', '')))} |"
        inner = field
        suffix = ""
        while True:  # lists of lists, maps of lists: down to the object that has fields
            if isinstance(inner.get("items"), Mapping):
                inner, suffix = inner["items"], suffix + "[]"
            elif isinstance(inner.get("additionalProperties"), Mapping):
                inner, suffix = inner["additionalProperties"], suffix + "{}"
            else:
                break
        yield from _rows(inner, where + suffix, inner.get("required", []))


def render(crds: Sequence[Mapping[str, Any]]) -> str:
    """The page for ``crds``, in the order given."""
    out = [_INTRO]
    for crd in crds:
        spec = crd["spec"]
        names, version = spec["names"], spec["versions"][0]
        schema = version["schema"]["openAPIV3Schema"]
        out.append(f"## {names['kind']}\n")
        out.append(_cell(str(schema.get("description", ""))) + "\n")
        short = ", ".join(names.get("shortNames", []))
        out.append(
            f"`{spec['group']}/{version['name']}`, {spec['scope'].lower()}, plural "
            f"`{names['plural']}`" + (f", short name `{short}`" if short else "") + ".\n"
        )
        columns = version.get("additionalPrinterColumns", [])
        if columns:
            shown = ", ".join(f"{c['name']} (`{c['jsonPath']}`)" for c in columns)
            out.append(f"`kubectl get` shows: {shown}.\n")
        props = {k: v for k, v in schema["properties"].items() if k in ("spec", "status")}
        out.append("| field | type | description |\n|---|---|---|")
        out.extend(_rows({"properties": props}, "", schema.get("required", [])))
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def page() -> str:
    """The reference page of every CRD the project defines."""
    return render([get_job_crd(), get_policy_crd(), get_power_budget_crd(), get_node_plan_crd()])


def main(argv: Sequence[str] | None = None) -> int:
    """Write the page, or with ``--check`` exit 1 when the committed one is stale."""
    parser = argparse.ArgumentParser(
        prog="python -m perseus_api.crd_reference",
        description="Generate the CRD reference page of the documentation.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"file ({DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    return write_page(
        args.out, page(), check=args.check, regenerate="python -m perseus_api.crd_reference"
    )


def write_page(out: Path, text: str, *, check: bool, regenerate: str) -> int:
    """Write a generated reference page, or with ``check`` exit status 1 (naming the command
    ``regenerate`` that rewrites it) when the committed page differs; returns the exit status."""
    if check:
        current = out.read_text(encoding="utf-8") if out.is_file() else ""
        if current != text:
            print(f"{out} is stale; regenerate it: {regenerate}", file=sys.stderr)
            return 1
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
