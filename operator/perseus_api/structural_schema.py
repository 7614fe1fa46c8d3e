"""Kubernetes *structural* schemas (``apiextensions.k8s.io/v1``) from pydantic models.

The pydantic JSON Schema of a model becomes a structural schema: ``$ref`` inlined,
``X | None`` as ``nullable``, numeric ``exclusiveMinimum`` in the OpenAPI v3.0 form, no
``title``, no ``additionalProperties: false`` (the API server prunes unknown fields instead),
and the CEL rules the models carry in ``x-kubernetes-validations`` kept where they are. A JSON
Schema construct without a structural equivalent is an error here rather than a CRD the API
server rejects. :mod:`perseus_api.crd` builds the CRDs from these schemas.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import BaseModel

__all__ = ["SchemaConversionError", "ordered_keywords", "structural_schema"]

# Pydantic keywords copied unchanged; any other keyword is an error (see _convert_keyword).
_PASSTHROUGH: Final = frozenset(
    {
        "type",
        "default",
        "enum",
        "format",
        "pattern",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "required",
        "x-kubernetes-validations",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-int-or-string",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
    }
)
# Output order of the keywords of a schema node: what a reader looks for first comes first.
_KEY_ORDER: Final = (
    "description",
    "type",
    "format",
    "nullable",
    "enum",
    "default",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "items",
    "additionalProperties",
    "properties",
    "required",
)


class SchemaConversionError(ValueError):
    """A model's JSON Schema uses a construct that has no structural-schema equivalent."""


def structural_schema(
    model: type[BaseModel], mode: Literal["validation", "serialization"] = "validation"
) -> dict[str, Any]:
    """The Kubernetes structural schema of ``model``'s camelCase JSON form.

    Raises:
        SchemaConversionError: The model's schema cannot be expressed structurally.
    """
    raw = model.model_json_schema(by_alias=True, mode=mode)
    definitions = raw.get("$defs", {})
    return _convert(raw, definitions, model.__name__)


def _convert(node: Mapping[str, Any], defs: Mapping[str, Any], where: str) -> dict[str, Any]:
    node = _unwrap_nullable(_inline_ref(node, defs, where), defs, where)
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_convert_keyword(key, value, node, defs, where))
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise SchemaConversionError(f"{where}: no type (an untyped field such as Any?)")
    return ordered_keywords(out)


def _inline_ref(node: Mapping[str, Any], defs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``node`` with its ``$ref`` replaced by the definition; the node's own keywords win, so a
    field's description overrides its model's docstring."""
    ref = node.get("$ref")
    if ref is None:
        return dict(node)
    name = str(ref).removeprefix("#/$defs/")
    if name not in defs:
        raise SchemaConversionError(f"{where}: unresolvable $ref {ref}")
    siblings = {k: v for k, v in node.items() if k != "$ref"}
    return {**_inline_ref(defs[name], defs, where), **siblings}


def _unwrap_nullable(node: dict[str, Any], defs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``anyOf: [X, {type: null}]`` (an ``X | None`` field) as ``X`` with ``nullable: true``."""
    options = node.get("anyOf")
    if options is None:
        return node
    others = [o for o in options if o != {"type": "null"}]
    if len(others) != 1 or len(others) == len(options):
        raise SchemaConversionError(f"{where}: only X | None unions are supported, got {options}")
    siblings = {k: v for k, v in node.items() if k != "anyOf"}
    return {**_inline_ref(others[0], defs, where), **siblings, "nullable": True}


def _convert_keyword(
    key: str, value: Any, node: Mapping[str, Any], defs: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """The structural form of one keyword of ``node``: zero, one or two keywords."""
    if key in ("title", "$defs") or (key == "default" and value is None):
        # Defaults must validate against their schema, and null is only meant as "unset".
        return {}
    if key == "nullable":
        return {"nullable": True}
    if key == "properties":
        return {"properties": {n: _convert(s, defs, f"{where}.{n}") for n, s in value.items()}}
    if key == "items":
        return {"items": _convert(value, defs, f"{where}[]")}
    if key == "additionalProperties":
        return _additional_properties(value, defs, where)
    if key == "const":
        return {"enum": [value]}  # a Literal of one value; OpenAPI v3.0 has no const
    if key in ("exclusiveMinimum", "exclusiveMaximum"):
        return _exclusive_bound(key, value, node, where)
    if key == "description":
        return {"description": _reflow(value)}
    if key in _PASSTHROUGH:
        return {key: value}
    raise SchemaConversionError(f"{where}: unsupported JSON Schema keyword {key!r}")


def _reflow(text: str) -> str:
    """Docstring paragraphs on one line each, in plain text: ``kubectl explain`` wraps them
    itself and shows reStructuredText markup as it is."""
    text = _RST_ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = text.replace("``", "")
    paragraphs = (" ".join(line.strip() for line in p.splitlines()) for p in text.split("\n\n"))
    return "\n\n".join(paragraphs)


# :class:`~perseus_api.job.Policy` and :data:`X` read as their last name (Policy, X).
_RST_ROLE: Final = re.compile(r":[a-z]+:`~?([^`]+)`")


def _additional_properties(value: Any, defs: Mapping[str, Any], where: str) -> dict[str, Any]:
    if value is False:
        return {}  # structural schemas may not forbid fields: the API server prunes them
    if value is True:
        return {"x-kubernetes-preserve-unknown-fields": True}
    return {"additionalProperties": _convert(value, defs, f"{where}{{}}")}


def _exclusive_bound(key: str, value: Any, node: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Pydantic's numeric ``exclusiveMinimum: v`` (JSON Schema 2020-12) as Kubernetes'
    OpenAPI v3.0 ``minimum: v, exclusiveMinimum: true`` (likewise for maxima)."""
    bound = "minimum" if key == "exclusiveMinimum" else "maximum"
    if bound in node:
        raise SchemaConversionError(f"{where}: both {bound} and {key} are set")
    return {bound: value, key: True}


def ordered_keywords(node: Mapping[str, Any]) -> dict[str, Any]:
    """``node`` with its keywords in :data:`_KEY_ORDER` (unknown ones last, as given)."""
    rank = {key: i for i, key in enumerate(_KEY_ORDER)}
    return dict(sorted(node.items(), key=lambda item: rank.get(item[0], len(rank))))
