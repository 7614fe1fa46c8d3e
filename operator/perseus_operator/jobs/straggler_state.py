"""What the straggler detector remembers between report rounds, and its JSON form.

The operator saves the state in an annotation of the PerseusJob (only when what decides
verdicts changes: :func:`state_to_save`) so that a restarted operator resumes where the last
one left off (:func:`memory_from_saved`). Pure: no clock, no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "STATE_VERSION",
    "DetectorMemory",
    "Published",
    "ReplicaMemory",
    "decisive_key",
    "memory_from_saved",
    "memory_from_state",
    "state_to_save",
    "to_state",
]

STATE_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class ReplicaMemory:
    """What the detector remembers about one replica between rounds."""

    slow_streak: int = 0
    fast_streak: int = 0
    recent_s: tuple[float, ...] = ()
    flagged: bool = False
    since_s: float | None = None
    node: str | None = None
    last_report_s: float | None = None
    """Newest report time folded into the streaks: a round without a newer one is no evidence."""


@dataclass(slots=True)
class Published:
    """The straggler set and target of the last verdict that changed plans."""

    dp_ranks: frozenset[int] = field(default_factory=frozenset)
    target_s: float | None = None


@dataclass(slots=True)
class DetectorMemory:
    """Everything the detector carries from one round to the next."""

    iterations: dict[int, int] = field(default_factory=dict)
    """Per rank: the iteration count of the last round (a lower one is a restart)."""
    replicas: dict[int, ReplicaMemory] = field(default_factory=dict)
    baseline_s: float | None = None
    """The last reference time measured, for rounds that measure no reference."""
    published: Published = field(default_factory=Published)


def to_state(memory: DetectorMemory) -> dict[str, Any]:
    """``memory`` as a JSON-serializable dict (settings are not included)."""
    return {
        "version": STATE_VERSION,
        "iterations": {str(rank): n for rank, n in sorted(memory.iterations.items())},
        "replicas": {
            str(dp_rank): {
                "slowStreak": r.slow_streak,
                "fastStreak": r.fast_streak,
                "recentSeconds": list(r.recent_s),
                "flagged": r.flagged,
                "sinceSeconds": r.since_s,
                "node": r.node,
                "lastReportSeconds": r.last_report_s,
            }
            for dp_rank, r in sorted(memory.replicas.items())
        },
        "published": {
            "dpRanks": sorted(memory.published.dp_ranks),
            "targetSeconds": memory.published.target_s,
        },
        "baselineSeconds": memory.baseline_s,
    }


def memory_from_state(state: Mapping[str, Any], persistence: int) -> DetectorMemory:
    """The memory :func:`to_state` wrote ``state`` for; ValueError when it is malformed.
    ``persistence``: the job's ``persistenceReports`` now (it may have shrunk since)."""
    try:
        if state["version"] != STATE_VERSION:
            raise ValueError(f"unsupported state version {state['version']!r}")
        published = _mapping(state["published"])
        return DetectorMemory(
            iterations={_index(k): _count(v) for k, v in _mapping(state["iterations"]).items()},
            replicas={
                _index(k): _replica_from_state(v, persistence)
                for k, v in _mapping(state["replicas"]).items()
            },
            published=Published(
                dp_ranks=frozenset(_index(v) for v in _sequence(published["dpRanks"])),
                target_s=_optional_seconds(published["targetSeconds"]),
            ),
            # Absent from states written before it was kept.
            baseline_s=_optional_seconds(state.get("baselineSeconds")),
        )
    except (KeyError, TypeError) as error:
        raise ValueError(f"malformed straggler detector state: {error!r}") from error


def state_to_save(memory: DetectorMemory, saved: str | None) -> str | None:
    """:func:`to_state` as JSON when it differs from ``saved`` (the JSON saved last; None:
    none) in what decides verdicts: the streaks, the flags, the published target. None: keep
    ``saved``; per-report details (iteration counts, recent times) wait for the next such
    change, so that the state is not written at every report."""
    state = to_state(memory)
    if saved is not None and _decisive(state) == _decisive_json(saved):
        return None
    return json.dumps(state, separators=(",", ":"))


def decisive_key(memory: DetectorMemory) -> Hashable:
    """What :func:`state_to_save` compares of ``memory`` (the published target, each replica's
    streaks and flag), without writing the JSON: equal keys, the same answer for the same
    ``saved``."""
    return (
        memory.published.dp_ranks,
        memory.published.target_s,
        tuple(
            (dp, r.slow_streak, r.fast_streak, r.flagged)
            for dp, r in sorted(memory.replicas.items())
        ),
    )


def memory_from_saved(saved: str, persistence: int) -> DetectorMemory | None:
    """The memory :func:`state_to_save` wrote ``saved`` for (None: unreadable)."""
    try:
        state = json.loads(saved)
        if not isinstance(state, Mapping):
            return None
        return memory_from_state(state, persistence)
    except (ValueError, TypeError, KeyError):
        return None


def _decisive(state: Mapping[str, Any]) -> Any:
    replicas = state.get("replicas") or {}
    return (
        state.get("published"),
        {
            dp: {k: v for k, v in r.items() if k in ("slowStreak", "fastStreak", "flagged")}
            for dp, r in replicas.items()
            if isinstance(r, Mapping)
        },
    )


def _decisive_json(text: str) -> Any:
    try:
        state = json.loads(text)
    except ValueError:
        return None
    return _decisive(state) if isinstance(state, Mapping) else None


# -- state parsing -----------------------------------------------------------------------------


def _mapping(value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping in straggler state, got {value!r}")
    return value


def _sequence(value: object) -> Sequence[object]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a list in straggler state, got {value!r}")
    return value


def _index(value: object) -> int:
    number = int(value) if isinstance(value, str) and value.isdigit() else value
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise ValueError(f"expected a non-negative index in straggler state, got {value!r}")
    return number


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative count in straggler state, got {value!r}")
    return value


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected finite seconds in straggler state, got {value!r}")
    return float(value)


def _optional_seconds(value: object) -> float | None:
    return None if value is None else _seconds(value)


def _replica_from_state(value: object, persistence: int) -> ReplicaMemory:
    raw = _mapping(value)
    node = raw["node"]
    if node is not None and not isinstance(node, str):
        raise ValueError(f"expected a node name in straggler state, got {node!r}")
    flagged = raw["flagged"]
    if not isinstance(flagged, bool):
        raise ValueError(f"expected a boolean flag in straggler state, got {flagged!r}")
    replica = ReplicaMemory(
        slow_streak=_count(raw["slowStreak"]),
        fast_streak=_count(raw["fastStreak"]),
        # Settings may have shrunk persistenceReports since the state was written.
        recent_s=tuple(_seconds(v) for v in _sequence(raw["recentSeconds"]))[-persistence:],
        flagged=flagged,
        since_s=_optional_seconds(raw["sinceSeconds"]),
        node=node,
        last_report_s=_optional_seconds(raw.get("lastReportSeconds")),
    )
    if replica.flagged and (
        replica.node is None or replica.since_s is None or not replica.recent_s
    ):
        raise ValueError("straggler state: a flagged replica needs node, since and recent times")
    return replica
