"""Argument types of the ``perseus`` commands: each says what it needs and what it got."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = [
    "at_least_one",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
]


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
    return value


def _finite_float(text: str, ok: Callable[[float], bool], requirement: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be a number {requirement}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    return _integer(text, 0)


def positive_float(text: str) -> float:
    return _finite_float(text, lambda v: v > 0, "> 0")


def non_negative_float(text: str) -> float:
    return _finite_float(text, lambda v: v >= 0, ">= 0")


def at_least_one(text: str) -> float:
    return _finite_float(text, lambda v: v >= 1, ">= 1")
