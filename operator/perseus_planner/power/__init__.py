"""Cluster power budget: which frontier point each job runs so that a domain stays within watts.

Pure, like the rest of the planner: :func:`allocate` takes every managed job's frontier as
(iteration time, average power) points, a budget and the unmanaged GPUs' measured draw, and
returns the exact least-weighted-slowdown choice, or by how many watts the budget cannot be met.
The operator's budget controller and ``perseus simulate --power-budget`` both call it.
"""

from perseus_planner.power.allocation import (
    Allocation,
    JobPoints,
    JobShare,
    PowerBudgetError,
    allocate,
)

__all__ = ["Allocation", "JobPoints", "JobShare", "PowerBudgetError", "allocate"]
