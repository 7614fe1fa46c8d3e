"""Total cost of every frontier point at once, summed exactly as each step sums it.

A step sums the cost of every computation in node order (one chain of ``n``
dependent additions: the reference does so, and a float sum in another order can
round differently in the last bit, enough to move a micro-joule now and then).
At 8 x 192 that chain was a tenth of a step. Summed afterwards, sixteen points
at a time, each point is still one left-to-right chain over the nodes, but the
sixteen chains run side by side; and the per-node costs of a point follow from
the previous ones by the few computations each step changed.
"""

from __future__ import annotations

import numpy as np

from perseus_planner._jit import njit
from perseus_planner._kernel import Array

LANES = 16


@njit(cache=True)
def point_costs(start: Array, up_ptr: Array, up: Array, down_ptr: Array, down: Array,
                dummy: Array, dmin: Array, tab_off: Array, cost_tab: Array,
                out: Array) -> None:  # fmt: skip
    """Fill ``out[k]`` (k >= 1) with the total cost at point ``k``, as the steps sum it.

    ``start`` holds every node's duration at point 0 (source and sink last);
    point ``k`` made ``up[up_ptr[k]:up_ptr[k + 1]]`` one unit faster and
    ``down[...]`` one unit slower. ``out[0]`` is left alone.
    """
    n = start.shape[0]
    points = out.shape[0]
    # Lane l holds the durations and costs of point base + l; a dummy's cost is 0.0,
    # which leaves a sum as it is, as skipping it does.
    dur = np.empty((LANES, n), dtype=np.int64)
    cost = np.zeros((n, LANES), dtype=np.float64)
    for lane in range(LANES):
        dur[lane, :] = start
    for lane in range(LANES):
        for k in range(1, min(lane + 1, points)):
            _apply(k, lane, up_ptr, up, down_ptr, down, dur)
    for lane in range(LANES):
        for i in range(n):
            if not dummy[i]:
                cost[i, lane] = cost_tab[tab_off[i] + dur[lane, i] - dmin[i]]
    acc = np.zeros(LANES, dtype=np.float64)
    base = 0
    while base < points:
        acc[:] = 0.0
        for i in range(n):
            for lane in range(LANES):
                acc[lane] += cost[i, lane]
        for lane in range(LANES):
            if 1 <= base + lane < points:
                out[base + lane] = acc[lane]
        # Move every lane LANES points on, through the changes of the steps between.
        for lane in range(LANES):
            for k in range(base + lane + 1, min(base + lane + LANES + 1, points)):
                for j in range(up_ptr[k], up_ptr[k + 1]):
                    i = up[j]
                    dur[lane, i] -= 1
                    cost[i, lane] = cost_tab[tab_off[i] + dur[lane, i] - dmin[i]]
                for j in range(down_ptr[k], down_ptr[k + 1]):
                    i = down[j]
                    dur[lane, i] += 1
                    cost[i, lane] = cost_tab[tab_off[i] + dur[lane, i] - dmin[i]]
        base += LANES


@njit(cache=True)
def _apply(k: int, lane: int, up_ptr: Array, up: Array, down_ptr: Array, down: Array,
           dur: Array) -> None:  # fmt: skip
    for j in range(up_ptr[k], up_ptr[k + 1]):
        dur[lane, up[j]] -= 1
    for j in range(down_ptr[k], down_ptr[k + 1]):
        dur[lane, down[j]] += 1
