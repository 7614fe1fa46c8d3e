"""Compiled inner loops of the power allocation: an exact multiple-choice knapsack.

Every job offers points ``(power_w, cost)``; one point per job is chosen so that the total
cost is least and the total power fits the watts available. The solve has three parts, all
on flat arrays (job ``j``'s points are ``ptr[j]:ptr[j + 1]``):

1. :func:`pareto_hulls`: per job, the Pareto points (power up, cost strictly down; any other
   point costs more for more watts and is never chosen) and their lower convex hull.
2. :func:`lp_break`: the linear relaxation. Hull segments taken in order of cost saved per
   watt, from every job at its least power, until one does not fit: that segment's rate is
   the Lagrange multiplier ``lam`` and the points reached are the greedy solution ``x_G``,
   feasible, with ``slack`` watts unused. ``lam`` is found by bisection on the segments'
   rates (each job's are sorted, so a trial rate is one binary search per job), not by
   sorting a million of them.
3. :func:`refine`: exactness. With ``m_j = min_p cost_jp + lam * power_jp`` (reached at
   ``x_G``'s point) and the reduced cost ``r_jp = cost_jp + lam * power_jp - m_j >= 0``,
   every feasible choice ``x`` costs ``LB + sum_j r_jx + lam * unused(x)`` with ``LB`` the
   relaxation's bound. So a choice better than the best known (gap ``G`` above ``LB``, first
   ``lam * slack``) uses only points with ``r < G``: on real frontiers a handful of jobs near
   the break, with a few points each. A dynamic program over those jobs keeps the
   non-dominated (extra watts, extra cost) states, drops any whose reduced cost already
   reaches ``G`` or that cannot fit even if every job still to come took its least power,
   and lowers ``G`` whenever a state fits. The optimum is never dropped, so it is exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

Array = Any  # numba-compiled functions take plain numpy arrays

_GATHER_AT_MOST = 256
"""Bisection on the multiplier stops once this few segments remain between its bounds."""
_BISECTION_STEPS = 200


@njit(cache=True)
def pareto_hulls(ptr: Array, power: Array, cost: Array) -> tuple[Array, Array, Array, Array]:
    """Per job: its Pareto points and the positions of their lower convex hull.

    Returns:
        ``(par_ptr, par_idx, hull_ptr, hull_pos)``: job ``j``'s Pareto points are
        ``par_idx[par_ptr[j]:par_ptr[j + 1]]`` (indices of the input, power ascending, cost
        strictly descending); its hull is ``hull_pos[hull_ptr[j]:hull_ptr[j + 1]]``
        (positions in ``par_idx``), the first the least power, the last the least cost.
    """
    num_jobs = len(ptr) - 1
    par_ptr = np.zeros(num_jobs + 1, dtype=np.int64)
    par_idx = np.empty(len(power), dtype=np.int64)
    hull_ptr = np.zeros(num_jobs + 1, dtype=np.int64)
    hull_pos = np.empty(len(power), dtype=np.int64)
    out = 0
    hull_out = 0
    for j in range(num_jobs):
        start, end = ptr[j], ptr[j + 1]
        order = _power_order(power[start:end])
        first = out
        best = np.inf
        for t in order:
            i = start + t
            if out > first and power[i] == power[par_idx[out - 1]]:
                if cost[i] < cost[par_idx[out - 1]]:  # same watts for less: it replaces
                    par_idx[out - 1] = i
                    best = cost[i]
                continue
            if cost[i] < best:
                par_idx[out] = i
                out += 1
                best = cost[i]
        par_ptr[j + 1] = out
        # Monotone chain, lower hull; collinear points dropped so rates strictly fall.
        hull_first = hull_out
        for q in range(first, out):
            x2, y2 = power[par_idx[q]], cost[par_idx[q]]
            while hull_out - hull_first >= 2:
                a = par_idx[hull_pos[hull_out - 2]]
                b = par_idx[hull_pos[hull_out - 1]]
                x0, y0, x1, y1 = power[a], cost[a], power[b], cost[b]
                if (x1 - x0) * (y2 - y0) - (y1 - y0) * (x2 - x0) > 0.0:
                    break
                hull_out -= 1
            hull_pos[hull_out] = q
            hull_out += 1
        hull_ptr[j + 1] = hull_out
    return par_ptr, par_idx[:out], hull_ptr, hull_pos[:hull_out]


@njit(cache=True)
def _power_order(power: Array) -> Array:
    """Positions by power, ascending; frontiers mostly come sorted one way or the other."""
    n = len(power)
    ascending = True
    descending = True
    for i in range(1, n):
        if power[i] < power[i - 1]:
            ascending = False
        elif power[i] > power[i - 1]:
            descending = False
    if ascending:
        return np.arange(n)
    if descending:
        return np.arange(n - 1, -1, -1)
    return np.argsort(power)  # ties in any order: equal watts are settled by cost


@njit(cache=True)
def _taken(rates: Array, start: int, end: int, lam: float) -> int:
    """How many of the descending ``rates[start:end]`` are above ``lam``."""
    low, high = start, end
    while low < high:
        mid = (low + high) // 2
        if rates[mid] > lam:
            low = mid + 1
        else:
            high = mid
    return low - start


@njit(cache=True)
def _watts_above(hull_ptr: Array, hull_power: Array, rates: Array, lam: float) -> tuple[float, int]:
    """Watts added (and segments taken) by every hull segment with a rate above ``lam``."""
    total = 0.0
    count = 0
    for j in range(len(hull_ptr) - 1):
        seg_start = hull_ptr[j] - j
        n = _taken(rates, seg_start, hull_ptr[j + 1] - j - 1, lam)
        total += hull_power[hull_ptr[j] + n] - hull_power[hull_ptr[j]]
        count += n
    return total, count


@njit(cache=True)
def lp_break(
    hull_ptr: Array, hull_power: Array, hull_cost: Array, available_w: float
) -> tuple[Array, float, float]:
    """The relaxation's multiplier and greedy solution.

    Args:
        hull_ptr, hull_power, hull_cost: Every job's hull points, flattened.
        available_w: Watts above every job's least power; more than zero and less than
            what every job's least-cost point adds (the caller settles the other cases).

    Returns:
        ``(pos, lam, slack_w)``: each job's hull point in the greedy solution (offset within
        its hull), the multiplier (cost per watt of the break segment) and the watts left.
    """
    num_jobs = len(hull_ptr) - 1
    num_segs = len(hull_power) - num_jobs
    rates = np.empty(num_segs, dtype=np.float64)
    for j in range(num_jobs):
        for k in range(hull_ptr[j], hull_ptr[j + 1] - 1):
            dp = hull_power[k + 1] - hull_power[k]
            rates[k - j] = (hull_cost[k] - hull_cost[k + 1]) / dp
    lo, hi = 0.0, rates.max()
    count_lo, count_hi = num_segs, 0
    for _ in range(_BISECTION_STEPS):
        if count_lo - count_hi <= _GATHER_AT_MOST:
            break
        mid = 0.5 * (lo + hi)
        if not (lo < mid < hi):
            break
        watts, count = _watts_above(hull_ptr, hull_power, rates, mid)
        if watts <= available_w:
            hi, count_hi = mid, count
        else:
            lo, count_lo = mid, count
    pos = np.empty(num_jobs, dtype=np.int64)
    used = 0.0
    gathered = count_lo - count_hi
    seg_rate = np.empty(gathered, dtype=np.float64)
    seg_job = np.empty(gathered, dtype=np.int64)
    g = 0
    for j in range(num_jobs):
        seg_start, seg_end = hull_ptr[j] - j, hull_ptr[j + 1] - j - 1
        n_hi = _taken(rates, seg_start, seg_end, hi)
        n_lo = _taken(rates, seg_start, seg_end, lo)
        pos[j] = n_hi
        used += hull_power[hull_ptr[j] + n_hi] - hull_power[hull_ptr[j]]
        for k in range(seg_start + n_hi, seg_start + n_lo):
            seg_rate[g] = rates[k]
            seg_job[g] = j
            g += 1
    # Highest rate first; a job's own segments keep their order (their rates strictly fall).
    order = np.argsort(-seg_rate[:g], kind="mergesort")
    slack = available_w - used
    for t in order:
        j = seg_job[t]
        k = hull_ptr[j] + pos[j]
        dp = hull_power[k + 1] - hull_power[k]
        if dp > slack:
            return pos, seg_rate[t], slack
        slack -= dp
        pos[j] += 1
    # Unreachable when available_w is below what every least-cost point adds.
    return pos, 0.0, slack


@njit(cache=True)
def refine(
    par_ptr: Array,
    par_power: Array,
    par_cost: Array,
    start: Array,
    lam: float,
    slack_w: float,
    gap: float,
    beam: int,
    tol_cost: float,
    tol_w: float,
    margin: float,
) -> tuple[Array, float, int]:
    """The exact optimum from the greedy solution (see the module docstring).

    Args:
        par_ptr, par_power, par_cost: Every job's Pareto points, flattened.
        start: The greedy solution: each job's point (absolute position in the Pareto arrays).
        lam: The multiplier for which every ``start`` point minimizes ``cost + lam * power``.
        slack_w: Watts the greedy solution leaves unused.
        gap: Cost above the relaxation's bound of the best choice known (``lam * slack_w``
            for the greedy one): only better choices are looked for.
        beam: 0 for the exact search; else at most this many states are kept per job, those
            of least bound (a heuristic pass that finds a good incumbent fast).
        tol_cost: Float noise allowed on costs (states within it are kept, never dropped).
        tol_w: Float noise allowed on watts.
        margin: States that cannot end at least this much below ``gap`` are dropped: the
            result is within ``margin`` of the optimum (``tol_cost``: float noise only).

    Returns:
        ``(choice, gap, states)``: each job's point (absolute position; the first entry is
        -1 when nothing beat ``gap``), the cost above the bound of that choice, and how many
        states were kept in all (the work done, for benchmarks).
    """
    num_jobs = len(par_ptr) - 1
    # Candidates: per job, the points with reduced cost within the gap (start itself first).
    cand_ptr = np.zeros(num_jobs + 1, dtype=np.int64)
    cand = np.empty(len(par_power), dtype=np.int64)
    free = np.empty(num_jobs, dtype=np.int64)
    num_free = 0
    c = 0
    for j in range(num_jobs):
        a = start[j]
        m = par_cost[a] + lam * par_power[a]
        first = c
        cand[c] = a
        c += 1
        for q in range(par_ptr[j], par_ptr[j + 1]):
            if q != a and par_cost[q] + lam * par_power[q] - m <= gap + tol_cost:
                cand[c] = q
                c += 1
        cand_ptr[j + 1] = c
        if c - first > 1:
            free[num_free] = j
            num_free += 1
    choice = start.copy()
    choice[0] = -1
    if num_free == 0:
        return choice, gap, 0
    # Per free job: the best cost saved per watt it can add, the least cost per watt it can
    # give back, and the most watts it can add or give back. Every point of a job obeys
    # up_rate <= lam <= down_rate, since its start point minimizes cost + lam * power.
    up_rate = np.zeros(num_free, dtype=np.float64)
    down_rate = np.full(num_free, np.inf)
    most_added = np.zeros(num_free, dtype=np.float64)
    most_given = np.zeros(num_free, dtype=np.float64)
    for f in range(num_free):
        j = free[f]
        a = start[j]
        for q in range(cand_ptr[j] + 1, cand_ptr[j + 1]):
            dw = par_power[cand[q]] - par_power[a]
            dcost = par_cost[cand[q]] - par_cost[a]
            if dw > 0:
                up_rate[f] = max(up_rate[f], -dcost / dw)
                most_added[f] = max(most_added[f], dw)
            elif dw < 0:
                down_rate[f] = min(down_rate[f], dcost / -dw)
                most_given[f] = max(most_given[f], -dw)
    # The jobs whose rates are closest to lam first (the expanding core): the bounds on the
    # jobs still to come tighten fastest, and the fills that meet the budget come early.
    closeness = np.minimum(lam - up_rate, down_rate - lam)
    order = np.argsort(closeness, kind="mergesort")
    free = free[order]
    up_rate, down_rate = up_rate[order], down_rate[order]
    most_added, most_given = most_added[order], most_given[order]
    rem_up = np.zeros(num_free + 1, dtype=np.float64)
    rem_down = np.full(num_free + 1, np.inf)
    rem_added = np.zeros(num_free + 1, dtype=np.float64)
    suffix_min = np.zeros(num_free + 1, dtype=np.float64)
    for f in range(num_free - 1, -1, -1):
        rem_up[f] = max(rem_up[f + 1], up_rate[f])
        rem_down[f] = min(rem_down[f + 1], down_rate[f])
        rem_added[f] = rem_added[f + 1] + most_added[f]
        suffix_min[f] = suffix_min[f + 1] - most_given[f]
    # States: extra watts, extra cost over start; per layer their parent and chosen point.
    dp = np.zeros(1, dtype=np.float64)
    dc = np.zeros(1, dtype=np.float64)
    capacity = 1024
    hist_parent = np.empty(capacity, dtype=np.int64)
    hist_point = np.empty(capacity, dtype=np.int64)
    layer_ptr = np.zeros(num_free + 1, dtype=np.int64)
    stored = 0
    best_layer, best_state = -1, -1
    for f in range(num_free):
        j = free[f]
        a = start[j]
        k0, k1 = cand_ptr[j], cand_ptr[j + 1]
        size = len(dp) * (k1 - k0)
        new_dp = np.empty(size, dtype=np.float64)
        new_dc = np.empty(size, dtype=np.float64)
        new_parent = np.empty(size, dtype=np.int64)
        new_point = np.empty(size, dtype=np.int64)
        n = 0
        for s in range(len(dp)):
            for q in range(k0, k1):
                p = cand[q]
                w = dp[s] + (par_power[p] - par_power[a])
                x = dc[s] + (par_cost[p] - par_cost[a])
                if w + suffix_min[f + 1] > slack_w + tol_w:  # never fits
                    continue
                # The least cost it can end with: the jobs to come save at most rem_up per
                # watt they add, and give watts back at rem_down per watt at best.
                unused = slack_w - w
                if unused >= 0:
                    bound = x - rem_up[f + 1] * min(unused, rem_added[f + 1])
                else:
                    bound = x - rem_down[f + 1] * unused
                if bound + lam * slack_w >= gap - margin:
                    continue
                new_dp[n], new_dc[n], new_parent[n], new_point[n] = w, x, s, p
                n += 1
        # Non-dominated states only: fewer extra watts or less extra cost.
        by_cost = np.argsort(new_dc[:n], kind="mergesort")
        order = by_cost[np.argsort(new_dp[:n][by_cost], kind="mergesort")]
        keep = np.empty(n, dtype=np.int64)
        kept = 0
        least = np.inf
        for t in order:
            if new_dc[t] < least:
                keep[kept] = t
                kept += 1
                least = new_dc[t]
        keep = keep[:kept]
        if beam > 0 and kept > beam:
            keep = keep[_least_bounds(new_dp[keep], new_dc[keep], slack_w, rem_up[f + 1],
                                      rem_down[f + 1], rem_added[f + 1], beam)]  # fmt: skip
            kept = beam
        dp, dc = new_dp[keep], new_dc[keep]
        if stored + kept > capacity:
            capacity = max(2 * capacity, stored + kept)
            hist_parent = _grown(hist_parent, capacity)
            hist_point = _grown(hist_point, capacity)
        hist_parent[stored : stored + kept] = new_parent[keep]
        hist_point[stored : stored + kept] = new_point[keep]
        layer_ptr[f + 1] = stored + kept
        stored += kept
        for s in range(kept):
            # Fits as it is (the jobs still to come at their start points): a new incumbent.
            if dp[s] <= slack_w + tol_w and dc[s] + lam * slack_w < gap - tol_cost:
                gap = dc[s] + lam * slack_w
                best_layer, best_state = f, s
        if kept == 0:
            break
    if best_layer < 0:
        return choice, gap, stored
    choice[0] = start[0]
    s = best_state
    for f in range(best_layer, -1, -1):
        at = layer_ptr[f] + s
        choice[free[f]] = hist_point[at]
        s = hist_parent[at]
    return choice, gap, stored


@njit(cache=True)
def _least_bounds(
    dp: Array, dc: Array, slack_w: float, up: float, down: float, added: float, count: int
) -> Array:
    """Positions of the ``count`` states whose least final cost is lowest (see refine)."""
    bound = np.empty(len(dp), dtype=np.float64)
    for s in range(len(dp)):
        unused = slack_w - dp[s]
        if unused >= 0:
            bound[s] = dc[s] - up * min(unused, added)
        else:
            bound[s] = dc[s] - down * unused
    return np.argsort(bound)[:count]


@njit(cache=True)
def _grown(array: Array, capacity: int) -> Array:
    out = np.empty(capacity, dtype=array.dtype)
    out[: len(array)] = array
    return out
