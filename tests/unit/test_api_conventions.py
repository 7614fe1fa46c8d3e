"""RFC 3339 times and condition transition times, shared by the operator and the agents."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from perseus_api.conventions import now_rfc3339, parse_rfc3339, rfc3339, transition_time


def test_times_are_written_as_metav1_time() -> None:
    assert rfc3339(1_796_000_000.75) == "2026-11-30T00:53:20Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", now_rfc3339())
    assert parse_rfc3339(rfc3339(1_796_000_000)) == datetime.fromtimestamp(1_796_000_000, UTC)


@pytest.mark.parametrize(
    ("value", "unix_s"),
    [
        ("2026-11-30T00:53:20Z", 1_796_000_000.0),
        ("2026-11-30T00:53:20.250000Z", 1_796_000_000.25),  # metav1.MicroTime (Leases)
        ("2026-11-30T01:53:20+01:00", 1_796_000_000.0),
        ("2026-11-30T00:53:20", 1_796_000_000.0),  # no zone: UTC
    ],
)
def test_times_parse_to_aware_datetimes(value: str, unix_s: float) -> None:
    when = parse_rfc3339(value)
    assert when is not None and when.tzinfo is not None
    assert when.timestamp() == unix_s


@pytest.mark.parametrize("value", [None, "", "yesterday", 1_796_000_000])
def test_what_is_not_a_time_parses_to_none(value: object) -> None:
    assert parse_rfc3339(value) is None


def test_a_transition_time_moves_only_when_the_status_does() -> None:
    then, now = "2026-11-30T00:00:00Z", "2026-12-02T06:00:00Z"
    assert transition_time("True", "True", then, now) == then
    assert transition_time("False", "True", then, now) == now
    assert transition_time("True", None, None, now) == now  # a new condition
    assert transition_time("True", "True", None, now) == now  # one that had no time
