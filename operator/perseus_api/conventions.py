"""Kubernetes API conventions that the operator and the node agents both follow: times as
RFC 3339 strings, when a condition's ``lastTransitionTime`` moves, ratios as the percents
``kubectl get`` shows, and camelCase keys with their unit spelled out (``unitTimeSeconds``).

One module, so that a job's conditions, a policy's and a node plan's report move alike, and
every reader takes the same times (``metav1.Time`` writes whole seconds, UTC, with a ``Z``;
``metav1.MicroTime`` adds microseconds; both parse here).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

from pydantic.alias_generators import to_camel, to_snake

__all__ = [
    "now_rfc3339",
    "parse_rfc3339",
    "percent",
    "rfc3339",
    "snake_name",
    "transition_time",
    "wire_name",
]

_UNITS: Final = (("_mhz", "MHz"), ("_s", "Seconds"), ("_w", "Watts"), ("_j", "Joules"))


def wire_name(field: str) -> str:
    """The camelCase key of a snake_case field, its unit spelled out as in the rest of the API
    (``unit_time_s`` -> ``unitTimeSeconds``, ``frequency_mhz`` -> ``frequencyMHz``)."""
    for suffix, unit in _UNITS:
        if field.endswith(suffix) and len(field) > len(suffix):
            return to_camel(field.removesuffix(suffix)) + unit
    return to_camel(field)


def snake_name(key: str) -> str:
    """The snake_case field of a :func:`wire_name` key (``tMinSeconds`` -> ``t_min_s``): the
    key an older writer used where it spelled a wire format in snake_case."""
    for suffix, unit in _UNITS:
        if key.endswith(unit) and len(key) > len(unit):
            return to_snake(key.removesuffix(unit)) + suffix
    return to_snake(key)


_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def now_rfc3339() -> str:
    """The current time as ``metav1.Time`` writes it (``2026-12-02T05:40:00Z``)."""
    return datetime.now(tz=UTC).strftime(_FORMAT)


def rfc3339(unix_s: float) -> str:
    """``unix_s`` (seconds since the epoch) as ``metav1.Time`` writes it; fractions dropped."""
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime(_FORMAT)


def parse_rfc3339(value: object) -> datetime | None:
    """The time ``value`` states (a time without a zone is taken as UTC); ``None`` when
    ``value`` is not a string or not a time."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def transition_time(
    status: str, previous_status: str | None, previous_time: str | None, now: str
) -> str:
    """A condition's ``lastTransitionTime``: the previous one's while the condition's status
    stays ``previous_status``, ``now`` when it changes (or there was none)."""
    if status == previous_status and previous_time:
        return previous_time
    return now


def percent(ratio: float) -> str:
    """``ratio`` as ``kubectl get`` should show it (``0.145`` -> ``14.5%``): printer columns
    can only copy a field, so a status keeps the ratio for programs and this for people."""
    return f"{ratio * 100:.1f}%"
