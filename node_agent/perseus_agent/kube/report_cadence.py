"""When a node plan status is worth a write to the API server (pure).

Every write of a PerseusNodePlan status goes through the kube-apiserver into etcd and reaches
the operator as a watch event it parses. At the production cadence (a report every 10 s) a
10,000-node cluster would send ~1,000 such writes a second, nearly all of them saying that
the iteration times are what they were. So a report is written only when it says something
new (:func:`write_due`):

* anything but the iteration telemetry changed (revision, GPUs, conditions, profiling, the
  set of ranks, the revision a rank's mean covers): at once;
* a rank's mean iteration time moved by more than the dead-band (a relative 1 % by default)
  from the value last written, or a rank restarted (its iteration count went down), or its
  iteration count at least doubled since written (so that warm-up ends soon after it does,
  at a logarithmic cost: ~20 writes over a million iterations);
* otherwise a heartbeat every :attr:`ReportCadence.heartbeat_s` (3 report intervals by
  default), so that a silent agent is still told from a dead one.

The status says the cadence (``reportIntervalSeconds``, ``heartbeatSeconds``): the operator
reads a status not rewritten for a report interval as one more report of the same times
(the agent would have written a change), and takes an agent for dead only when the heartbeat
is overdue (:mod:`perseus_operator.jobs.straggler_samples`). What is stored is always within the
dead-band of what the agent measures, so an operator that restarts reads all it needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

__all__ = [
    "DEFAULT_DEAD_BAND",
    "DEFAULT_HEARTBEAT_REPORTS",
    "ReportCadence",
    "WriteReason",
    "write_due",
]

DEFAULT_DEAD_BAND: Final = 0.01
"""Relative change of a rank's mean iteration time that is written at once. The straggler
detector's hysteresis (entering at 1.05, leaving at 1.02 by default) is 3 %: a ratio of two
means each within 1 % of the measured one stays on the right side of it."""
DEFAULT_HEARTBEAT_REPORTS: Final = 3
"""Report intervals between writes of an unchanged report: 30 s at the default 10 s, half the
operator's default ``staleAfterSeconds`` (60 s), so one lost write does not look like a
dead agent."""

REPORTED_AT: Final = "reportedAt"
REPORT_INTERVAL: Final = "reportIntervalSeconds"
HEARTBEAT: Final = "heartbeatSeconds"
_TELEMETRY: Final = frozenset({"iterations", "lastIterationSeconds", "meanIterationSeconds"})
"""Keys of a rank's entry that move with every iteration (older agents: snake_case too)."""
_TELEMETRY_LEGACY: Final = frozenset({"last_iteration_s", "mean_iteration_s"})
_PER_WRITE: Final = frozenset({REPORTED_AT})


class WriteReason(StrEnum):
    FIRST = "first"
    """Nothing written to this object yet (by this agent process)."""
    CHANGED = "changed"
    """Something other than the iteration telemetry changed."""
    TELEMETRY = "telemetry"
    """A rank's mean left the dead-band, a rank restarted, or its count doubled."""
    HEARTBEAT = "heartbeat"
    """Nothing new, but the last write is a heartbeat old."""


@dataclass(frozen=True, slots=True)
class ReportCadence:
    """How often reports are made (``report_interval_s``), how often an unchanged one is
    written anyway (``heartbeat_s``), and the relative change of a mean iteration time that is
    written at once (``dead_band``; 0 writes every change)."""

    report_interval_s: float
    heartbeat_s: float
    dead_band: float = DEFAULT_DEAD_BAND

    def __post_init__(self) -> None:
        if not (math.isfinite(self.report_interval_s) and self.report_interval_s > 0):
            raise ValueError(f"report interval must be > 0 s, got {self.report_interval_s}")
        if not (math.isfinite(self.heartbeat_s) and self.heartbeat_s >= self.report_interval_s):
            raise ValueError(
                f"heartbeat must be at least the report interval ({self.report_interval_s} s), "
                f"got {self.heartbeat_s}"
            )
        if not (math.isfinite(self.dead_band) and 0 <= self.dead_band < 1):
            raise ValueError(f"dead-band must be in [0, 1), got {self.dead_band}")

    @classmethod
    def every(cls, report_interval_s: float) -> ReportCadence:
        """The default cadence for ``report_interval_s``."""
        return cls(report_interval_s, DEFAULT_HEARTBEAT_REPORTS * report_interval_s)

    def stamp(self, status: Mapping[str, Any]) -> dict[str, Any]:
        """``status`` saying this cadence, if it is a report (it has ``reportedAt``)."""
        if status.get(REPORTED_AT) is None:
            return dict(status)
        return {
            **status,
            REPORT_INTERVAL: self.report_interval_s,
            HEARTBEAT: self.heartbeat_s,
        }


def write_due(
    written: Mapping[str, Any] | None,
    status: Mapping[str, Any],
    *,
    since_written_s: float,
    cadence: ReportCadence,
) -> WriteReason | None:
    """Why ``status`` must be written now, ``since_written_s`` seconds after ``written`` (the
    status last written to the object; None: none yet); None when it need not be."""
    if written is None:
        return WriteReason.FIRST
    if _structure(written) != _structure(status):
        return WriteReason.CHANGED
    if status.get(REPORTED_AT) is None:
        return None  # not a report (invalid, stopped): unchanged, nothing to refresh
    old = _ranks(written)
    for key, now in _ranks(status).items():
        if _telemetry_moved(old.get(key), now, cadence.dead_band):
            return WriteReason.TELEMETRY
    # Half an interval early: reports come every interval, and one a hair short of the
    # heartbeat would otherwise wait a whole interval more.
    if since_written_s >= cadence.heartbeat_s - cadence.report_interval_s / 2:
        return WriteReason.HEARTBEAT
    return None


# -- helpers -----------------------------------------------------------------------------------


def _structure(status: Mapping[str, Any]) -> Any:
    """Everything of ``status`` but the per-write stamp and the ranks' telemetry."""
    rest = {k: v for k, v in status.items() if k not in _PER_WRITE and k != "ranks"}
    ranks = [
        {k: v for k, v in r.items() if k not in _TELEMETRY and k not in _TELEMETRY_LEGACY}
        for r in _entries(status.get("ranks"))
    ]
    return rest, ranks


def _entries(value: object) -> Sequence[Mapping[str, Any]]:
    if not isinstance(value, list):
        return ()
    return [r for r in value if isinstance(r, Mapping)]


def _ranks(status: Mapping[str, Any]) -> dict[object, Mapping[str, Any]]:
    return {r.get("rank"): r for r in _entries(status.get("ranks"))}


def _number(entry: Mapping[str, Any], *keys: str) -> float | None:
    for key in keys:
        value = entry.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def _telemetry_moved(old: Mapping[str, Any] | None, new: Mapping[str, Any], band: float) -> bool:
    if old is None:
        return True  # a new rank is a structural change; kept here for safety
    old_n, new_n = _number(old, "iterations"), _number(new, "iterations")
    if old_n is not None and new_n is not None:
        if new_n < old_n:
            return True  # restarted: the operator must forget what it measured before
        if new_n >= 2 * old_n and new_n > old_n:
            return True
    old_s = _number(old, "meanIterationSeconds", "mean_iteration_s")
    new_s = _number(new, "meanIterationSeconds", "mean_iteration_s")
    if old_s is None or new_s is None:
        return old_s != new_s
    if old_s <= 0:
        return new_s != old_s
    return abs(new_s - old_s) > band * old_s
