"""Errors about malformed shared data (profiles, plans)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class ApiError(ValueError):
    """Base for every error about malformed shared data."""


class ProfileError(ApiError):
    """A profile file is malformed.

    The message names the file, the row (1-based line number in the file, the header is
    line 1) and the problem, so that a user can go straight to the offending line.
    """

    def __init__(self, source: str, problem: str, row: int | None = None) -> None:
        self.source = source
        self.row = row
        self.problem = problem
        super().__init__(
            f"{source}: {problem}" if row is None else f"{source}: line {row}: {problem}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # The default exception pickling replays ``self.args`` (the formatted message) into
        # ``__init__``, which takes different arguments, so an error raised in a worker process
        # could not be sent back to the parent.
        return (type(self), (self.source, self.problem, self.row))


class ScheduleError(ApiError):
    """Invalid pipeline schedule or sizes."""


def validation_summary(exc: ValidationError) -> str:
    """A pydantic error on one line: ``field.path: problem`` per error, ``; ``-separated."""
    problems = []
    for error in exc.errors(include_url=False):
        location = ".".join(str(part) for part in error["loc"])
        problems.append(f"{location}: {error['msg']}" if location else str(error["msg"]))
    return "; ".join(problems)
