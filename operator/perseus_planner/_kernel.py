"""Compiled inner loop of the frontier solver (one Phillips–Dessouky step).

Everything here works on flat integer arrays prepared once by
:mod:`perseus_planner.solver`, so a step is a few linear passes plus two
max-flow runs, with no Python objects involved. Capacities are integers in
micro-joules: the artifact rounds every capacity down to a multiple of 1e-6 J,
so integer arithmetic gives the same cuts without floating-point drift.

Flow network layout (activity-on-arc form of the computation DAG):
computation ``i`` is the arc ``left(i) = 2i -> right(i) = 2i + 1``; a
dependency ``u -> v`` is a zero-duration arc ``right(u) -> left(v)``. Arcs are
stored in pairs, arc ``a`` and its residual twin ``a ^ 1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perseus_planner._jit import njit

INF_UNITS = np.int64(1) << np.int64(50)
"""Capacity of arcs that must never be cut (far above any finite cut, no overflow)."""

STATUS_OK = 0
STATUS_INFEASIBLE_FLOW = 1  # lower bounds cannot be met: no consistent cut exists
STATUS_AT_LIMIT = 2  # every cut crosses a computation that cannot change further
STATUS_NO_GAIN = 3  # the cut changes nothing in cost: the frontier ends here

_COST_EPSILON_J = 1e-6

Array = Any  # numba-compiled functions take plain numpy arrays


@njit(cache=True)
def critical_path(
    topo: Array, pred_ptr: Array, pred_idx: Array, succ_ptr: Array, succ_idx: Array,
    dur: Array, ef: Array, ls: Array,
) -> int:  # fmt: skip
    """Fill earliest finish and latest start of every node; return the makespan."""
    n = topo.shape[0]
    for k in range(n):
        v = topo[k]
        es = 0
        for j in range(pred_ptr[v], pred_ptr[v + 1]):
            if ef[pred_idx[j]] > es:
                es = ef[pred_idx[j]]
        ef[v] = es + dur[v]
    makespan = 0
    for v in range(n):
        if ef[v] > makespan:
            makespan = ef[v]
    for k in range(n - 1, -1, -1):
        v = topo[k]
        lf = makespan
        for j in range(succ_ptr[v], succ_ptr[v + 1]):
            if ls[succ_idx[j]] < lf:
                lf = ls[succ_idx[j]]
        ls[v] = lf - dur[v]
    return makespan


@njit(cache=True)
def _levels(s: int, adj_ptr: Array, adj_arc: Array, head: Array, cap: Array,
            level: Array, queue: Array) -> None:  # fmt: skip
    level[:] = -1
    level[s] = 0
    qh = 0
    qt = 1
    queue[0] = s
    while qh < qt:
        u = queue[qh]
        qh += 1
        for k in range(adj_ptr[u], adj_ptr[u + 1]):
            a = adj_arc[k]
            if cap[a] > 0:
                v = head[a]
                if level[v] < 0:
                    level[v] = level[u] + 1
                    queue[qt] = v
                    qt += 1


@njit(cache=True)
def max_flow(s: int, t: int, adj_ptr: Array, adj_arc: Array, head: Array, cap: Array,
             level: Array, queue: Array, cursor: Array, stack: Array) -> int:  # fmt: skip
    """Dinic's algorithm on the residual capacities ``cap`` (updated in place)."""
    total = 0
    while True:
        _levels(s, adj_ptr, adj_arc, head, cap, level, queue)
        if level[t] < 0:
            return total
        for u in range(cursor.shape[0]):
            cursor[u] = adj_ptr[u]
        while True:
            depth = 0
            u = s
            while u != t:
                advanced = False
                while cursor[u] < adj_ptr[u + 1]:
                    a = adj_arc[cursor[u]]
                    v = head[a]
                    if cap[a] > 0 and level[v] == level[u] + 1:
                        stack[depth] = a
                        depth += 1
                        u = v
                        advanced = True
                        break
                    cursor[u] += 1
                if not advanced:
                    if depth == 0:
                        break
                    level[u] = -1  # dead end for the rest of this phase
                    depth -= 1
                    u = head[stack[depth] ^ 1]
                    cursor[u] += 1
            if u != t:
                break
            bottleneck = cap[stack[0]]
            for k in range(1, depth):
                if cap[stack[k]] < bottleneck:
                    bottleneck = cap[stack[k]]
            for k in range(depth):
                cap[stack[k]] -= bottleneck
                cap[stack[k] ^ 1] += bottleneck
            total += bottleneck


@njit(cache=True)
def pd_step(
    topo: Array, pred_ptr: Array, pred_idx: Array, succ_ptr: Array, succ_idx: Array,
    edge_u: Array, edge_v: Array, dummy: Array,
    dur: Array, dmin: Array, dmax: Array, tab_off: Array,
    cost_tab: Array, lb_tab: Array, ub_tab: Array,
    ef: Array, ls: Array,
    adj_ptr: Array, adj_arc: Array, head: Array, cap: Array,
    level: Array, queue: Array, cursor: Array, stack: Array,
    changed_up: Array, changed_down: Array, out_i: Array, out_f: Array,
) -> None:  # fmt: skip
    """Shorten the makespan by one unit at least cost (Phillips–Dessouky step).

    ``ef``/``ls`` must describe the current durations. On success the durations,
    ``ef``/``ls`` and the makespan are updated; otherwise nothing changes.
    Outputs: ``out_i = [status, makespan, n_up, n_down]``,
    ``out_f = [cost_change_j, total_cost_j]``.
    """
    n = dur.shape[0]
    n_edges = edge_u.shape[0]
    # Arc numbering (see _steps.reference_network): computation arcs, dependency
    # arcs, lower-bound arcs from s' and to t', then the return arc t -> s.
    dep_base = 2 * n
    sp_base = dep_base + 2 * n_edges
    tp_base = sp_base + 2 * n
    ts_arc = tp_base + 2 * n
    s_prime = 2 * n
    t_prime = 2 * n + 1
    source = 2 * (n - 2)  # left(SRC)
    sink = 2 * (n - 1) + 1  # right(SNK)

    cap[sp_base:] = 0  # lower-bound arcs and t -> s, set below where needed
    sum_lb = 0
    for i in range(n):
        a = 2 * i
        cap[a + 1] = 0
        if ef[i] != ls[i] + dur[i]:
            cap[a] = 0
            continue
        if dummy[i]:
            cap[a] = INF_UNITS
            continue
        k = tab_off[i] + dur[i] - dmin[i]
        lb = lb_tab[k]
        cap[a] = ub_tab[k] - lb
        cap[sp_base + a] = lb
        cap[tp_base + a] = lb
        sum_lb += lb
    for e in range(n_edges):
        a = dep_base + 2 * e
        cap[a + 1] = 0
        cap[a] = INF_UNITS if ef[edge_u[e]] == ls[edge_v[e]] else 0
    cap[ts_arc] = INF_UNITS

    # 1. A flow meeting every lower bound (circulation through t -> s).
    feasible = max_flow(s_prime, t_prime, adj_ptr, adj_arc, head, cap, level, queue,
                        cursor, stack)  # fmt: skip
    if feasible != sum_lb:
        out_i[0] = STATUS_INFEASIBLE_FLOW
        return
    cap[sp_base:] = 0  # back to the plain network: its residual is the feasible flow's
    # 2. Maximize it from s to t; the residual then shows the minimal min cut.
    flow = max_flow(source, sink, adj_ptr, adj_arc, head, cap, level, queue, cursor, stack)
    if flow >= INF_UNITS:
        out_i[0] = STATUS_AT_LIMIT
        return
    _levels(source, adj_ptr, adj_arc, head, cap, level, queue)  # level >= 0: source side

    n_up = 0
    n_down = 0
    cost_change = 0.0
    for i in range(n):
        if ef[i] != ls[i] + dur[i]:
            continue
        left_in = level[2 * i] >= 0
        right_in = level[2 * i + 1] >= 0
        if left_in and not right_in:
            if dummy[i] or dur[i] - 1 < dmin[i]:
                out_i[0] = STATUS_AT_LIMIT
                return
            k = tab_off[i] + dur[i] - dmin[i]
            cost_change += abs(cost_tab[k - 1] - cost_tab[k])
            changed_up[n_up] = i
            n_up += 1
        elif right_in and not left_in and not dummy[i]:
            if dur[i] + 1 > dmax[i]:
                out_i[0] = STATUS_AT_LIMIT
                return
            k = tab_off[i] + dur[i] - dmin[i]
            cost_change -= abs(cost_tab[k] - cost_tab[k + 1])
            changed_down[n_down] = i
            n_down += 1
    for e in range(n_edges):
        if (
            ef[edge_u[e]] == ls[edge_v[e]]
            and level[2 * edge_u[e] + 1] >= 0
            and level[2 * edge_v[e]] < 0
        ):
            out_i[0] = STATUS_AT_LIMIT  # a dependency cannot be shortened
            return
    if n_up == 0 or abs(cost_change) < _COST_EPSILON_J:
        out_i[0] = STATUS_NO_GAIN
        return

    for k in range(n_up):
        dur[changed_up[k]] -= 1
    for k in range(n_down):
        dur[changed_down[k]] += 1
    makespan = critical_path(topo, pred_ptr, pred_idx, succ_ptr, succ_idx, dur, ef, ls)
    total = 0.0
    for i in range(n):
        if not dummy[i]:
            total += cost_tab[tab_off[i] + dur[i] - dmin[i]]
    out_i[0] = STATUS_OK
    out_i[1] = makespan
    out_i[2] = n_up
    out_i[3] = n_down
    out_f[0] = cost_change
    out_f[1] = total
