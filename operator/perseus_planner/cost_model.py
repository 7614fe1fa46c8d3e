"""Convex cost models of one computation's effective energy vs. its duration.

The solver needs a convex cost in the (integer) duration so that the cost of
speeding a computation up by one unit is never below the saving of slowing it
down by one. The model is ``cost(q) = a * exp(b * q) + c`` with ``a > 0``, fit
as the artifact does: least squares from a fixed grid of initial guesses,
taking the first guess that converges to a convex model.

Two cases the artifact could not handle get a fallback instead of a failure,
because a noisy or coarse profile should not stop planning: only two durations
(the line through them), and options no convex exponential fits (the least
squares line, which is still convex), with a warning.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
from scipy.optimize import OptimizeWarning, curve_fit

from perseus_planner.errors import CostModelError

_A_GUESSES = (1e1, 1e2, 1e3)
_B_GUESSES_PER_MS = (0.01, 0.02, 0.03, 0.04, 0.05, 0.1)
_C_GUESSES = (1e1, 1e2, 1e3)
_MAX_FUNCTION_EVALUATIONS = 50_000
_PARAMETERS = 3

log = logging.getLogger(__name__)


class CostModel(Protocol):
    """Effective energy (J) of a computation at integer durations (unit times)."""

    def __call__(self, quant_times: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]: ...


def _exponential(
    q: npt.NDArray[np.float64], a: float, b: float, c: float
) -> npt.NDArray[np.float64]:
    return a * np.exp(b * q) + c


@dataclass(frozen=True)
class ExponentialCostModel:
    """``cost_j(q) = a * exp(b * q) + c`` for an integer duration ``q`` (unit times)."""

    a: float
    b: float
    c: float

    def __call__(self, quant_times: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        return self.a * np.exp(self.b * quant_times) + self.c  # type: ignore[no-any-return]


@dataclass(frozen=True)
class LinearCostModel:
    """``cost_j(q) = slope * q + intercept``: convex, for too few or non-convex options."""

    slope: float
    intercept: float

    def __call__(self, quant_times: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        return self.slope * quant_times.astype(np.float64) + self.intercept


def fit_cost_model(
    quant_times: npt.NDArray[np.int64],
    costs_j: npt.NDArray[np.float64],
    unit_time_s: float,
    label: str = "computation",
) -> CostModel:
    """Fit a convex cost model to one computation's options (see the module docstring).

    Raises:
        CostModelError: Fewer than two options.
    """
    x = np.asarray(quant_times, dtype=np.float64)
    y = np.asarray(costs_j, dtype=np.float64)
    if len(x) < 2 or len(np.unique(x)) != len(x):
        raise CostModelError(f"{label}: need at least two distinct durations, got {x.tolist()}")
    if len(x) > 2:
        try:
            return fit_exponential(quant_times, costs_j, unit_time_s)
        except CostModelError as exc:
            log.warning("%s: %s; using the least-squares line instead", label, exc)
    slope, intercept = np.polyfit(x, y, 1)
    return LinearCostModel(float(slope), float(intercept))


def fit_exponential(
    quant_times: npt.NDArray[np.int64], costs_j: npt.NDArray[np.float64], unit_time_s: float
) -> ExponentialCostModel:
    """Fit the exponential model exactly as the artifact does (at least three options).

    Raises:
        CostModelError: When no initial guess converges to a convex model.
    """
    x = np.asarray(quant_times, dtype=np.float64)
    y = np.asarray(costs_j, dtype=np.float64)
    if len(x) < _PARAMETERS:
        raise CostModelError(f"an exponential needs at least 3 options, got {len(x)}")
    # With exactly three options the fit interpolates and no covariance can be
    # estimated; that is expected, not a failed fit.
    needs_covariance = len(x) > _PARAMETERS
    b_guesses = [-k * unit_time_s / 0.001 for k in _B_GUESSES_PER_MS]
    for a0, b0, c0 in itertools.product(_A_GUESSES, b_guesses, _C_GUESSES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                params, pcov = curve_fit(
                    _exponential, x, y, p0=[a0, b0, c0], maxfev=_MAX_FUNCTION_EVALUATIONS
                )
            except RuntimeError:  # did not converge from this guess
                continue
        if needs_covariance and np.inf in pcov:
            continue
        a, b, c = (float(v) for v in params)
        error = float(np.mean(np.square(y - _exponential(x, a, b, c))))
        if not np.isfinite(error) or a < 0.0:
            continue
        return ExponentialCostModel(a, b, c)
    raise CostModelError(
        f"no convex exponential model fits the {len(x)} options "
        f"(durations {x.astype(int).tolist()} x {unit_time_s} s); "
        "the measurements may be noisy or non-monotonic"
    )
