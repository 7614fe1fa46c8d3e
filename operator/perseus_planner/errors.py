"""Exceptions raised by the planning library.

Every error derives from ``ValueError`` because each one means that the caller handed the
planner input it cannot use; callers that do not care which stage failed catch
``PlannerError``. Malformed profiles raise ``ProfileError`` from :mod:`perseus_api`
(the format is shared with the node agent) and schedule errors ``ScheduleError``,
both re-exported here.
"""

from __future__ import annotations

from perseus_api.errors import ProfileError, ScheduleError

__all__ = [
    "CostModelError",
    "LimitError",
    "PlannerError",
    "ProfileError",
    "ScheduleError",
    "SolverError",
]


class PlannerError(ValueError):
    """Base for every planner input/solve error."""


class CostModelError(PlannerError):
    """The cost model could not be fit to the options of one computation."""


class SolverError(PlannerError):
    """The frontier solver got inputs it cannot work with."""


class LimitError(PlannerError):
    """The input is finite but beyond what the solver's arithmetic or memory can hold."""
