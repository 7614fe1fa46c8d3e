"""The base of the ``perseus.energy`` spec models, shared by every custom resource's spec.

camelCase on the wire and snake_case in Python, unknown fields refused, CEL rules carried into
the generated CRD (:mod:`perseus_api.crd`), and a section default that lets the API server
fill in a section's nested defaults.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict


class _Spec(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
        # A field's docstring is its description in the CRD (kubectl explain).
        use_attribute_docstrings=True,
    )


def _rules(*rules: tuple[str, str]) -> dict[str, Any]:
    """``json_schema_extra`` carrying CEL rules (rule, message) into the generated CRD."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


# ``default: {}`` in the CRD: the API server then fills in the nested defaults of a section
# the user left out (it does so only inside objects that exist), so `kubectl get` shows them.
_SECTION: Final[JsonDict] = {"default": {}}
