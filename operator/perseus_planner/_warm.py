"""Compiled pieces of a Phillips–Dessouky step that keeps its maximum flow between steps.

The step of :func:`perseus_planner._kernel.pd_step` rebuilds the flow from zero
every time: first a flow meeting every lower bound (``sum(lb)`` units routed
around the whole pipeline through ``t -> s``), then the maximum flow. Profiling
showed that this is nearly all of the solve, and it grows with the frontier
times the DAG. Yet a step changes the network only a little: one unit of
duration on the computations of one cut, and the few computations that become,
or stop being, critical. So the kept flow is moved onto the new bounds
(:func:`set_bounds`, :func:`bounds_pass`: each arc clamped into ``[lb, ub]``,
zero on arcs that left the critical DAG), the small imbalance this leaves is
routed back into a feasible flow (:func:`repair`), and :func:`dinic` maximizes
from there; :mod:`perseus_planner._kept_cut` puts these together.

The result is exactly the reference step's: the set of vertices reachable from
the source in the residual graph of *any* maximum flow is the same (the
minimal minimum cut, the intersection of every minimum cut's source side), and
a feasible flow exists or not whatever flow the repair starts from. Arcs whose
residual is "infinite" (at least half of ``INF_UNITS``) on a whole augmenting
path mean an infinite minimum cut; the reference ends the frontier there too.

Network (see :func:`perseus_planner._steps.warm_arcs`): arc pairs ``2p`` /
``2p + 1`` (forward, residual twin). Pairs ``0..num-1`` are computations
``left(i) -> right(i)``, then the dependencies ``right(u) -> left(v)``, then an
arc ``s' -> v`` and ``v -> t'`` for every vertex, then ``t -> s``. The bounds
of each computation and dependency pair live in ``lo``/``hi``; its flow is
``lo + cap[2p + 1]``. Searches mark vertices with a stamp instead of clearing
arrays, so a search that stops early costs only what it visited.

Earliest finishes and latest starts are recomputed only where an input moved
(:func:`update_times`), with the values a full critical-path pass would give.
"""

from __future__ import annotations

import numpy as np

from perseus_planner._jit import njit
from perseus_planner._kernel import (
    INF_UNITS,
    Array,
)

_INF = int(INF_UNITS)
_HALF_INF = _INF // 2
_COST_EPSILON_J = 1e-6


@njit(cache=True)
def _bfs(s: int, t: int, adj_ptr: Array, adj_arc: Array, head: Array, cap: Array,
         level: Array, seen: Array, state: Array, queue: Array, cursor: Array,
         parent: Array) -> bool:  # fmt: skip
    """Level vertices reachable from ``s`` (``seen == state[0]``); return whether ``t`` is.

    The search stops after the level of ``t``: Dinic's phase needs no deeper
    vertex, and a short repair path then costs little. ``queue[:state[2]]``
    lists the vertices it reached, ``parent`` the arc each was reached by.
    """
    stamp = state[0]
    seen[s] = stamp
    level[s] = 0
    cursor[s] = adj_ptr[s]
    qh = 0
    qt = 1
    queue[0] = s
    t_level = -1
    while qh < qt:
        u = queue[qh]
        qh += 1
        if t_level >= 0 and level[u] >= t_level:
            break
        for k in range(adj_ptr[u], adj_ptr[u + 1]):
            a = adj_arc[k]
            if cap[a] > 0:
                v = head[a]
                if seen[v] != stamp:
                    seen[v] = stamp
                    level[v] = level[u] + 1
                    cursor[v] = adj_ptr[v]
                    parent[v] = a
                    queue[qt] = v
                    qt += 1
                    if v == t:
                        t_level = level[v]
    state[2] = qt
    return bool(seen[t] == stamp)


@njit(cache=True)
def dinic(s: int, t: int, adj_ptr: Array, adj_arc: Array, head: Array, cap: Array,
           level: Array, seen: Array, state: Array, queue: Array, cursor: Array,
           stack: Array, parent: Array) -> int:  # fmt: skip
    """Augment from ``s`` to ``t`` until no path is left; return the flow added.

    Returns -1 as soon as a path's bottleneck is "infinite". When it returns
    normally, ``seen == state[0]`` marks exactly the vertices reachable from
    ``s`` in the final residual graph, and ``queue[:state[2]]`` lists them.
    """
    total = 0
    while True:
        state[0] += 1
        stamp = state[0]
        if not _bfs(s, t, adj_ptr, adj_arc, head, cap, level, seen, state, queue, cursor, parent):
            # A search stops early only once it has found t: this one is complete.
            return total
        while True:
            depth = 0
            u = s
            while u != t:
                advanced = False
                while cursor[u] < adj_ptr[u + 1]:
                    a = adj_arc[cursor[u]]
                    v = head[a]
                    if cap[a] > 0 and seen[v] == stamp and level[v] == level[u] + 1:
                        stack[depth] = a
                        depth += 1
                        u = v
                        advanced = True
                        break
                    cursor[u] += 1
                if not advanced:
                    if depth == 0:
                        break
                    level[u] = -2  # dead end for the rest of this phase
                    depth -= 1
                    u = head[stack[depth] ^ 1]
                    cursor[u] += 1
            if u != t:
                break
            bottleneck = cap[stack[0]]
            for k in range(1, depth):
                if cap[stack[k]] < bottleneck:
                    bottleneck = cap[stack[k]]
            if bottleneck >= _HALF_INF:
                return -1
            for k in range(depth):
                cap[stack[k]] -= bottleneck
                cap[stack[k] ^ 1] += bottleneck
            total += bottleneck


@njit(cache=True)
def _add_excess(v: int, amount: int, excess: Array, touched: Array, listed: Array,
                state: Array) -> None:  # fmt: skip
    if not listed[v]:
        listed[v] = True
        touched[state[1]] = v
        state[1] += 1
    excess[v] += amount


@njit(cache=True)
def set_bounds(p: int, tail: int, hd: int, new_lo: int, new_hi: int, lo: Array, hi: Array,
               cap: Array, excess: Array, touched: Array, listed: Array,
               state: Array) -> None:  # fmt: skip
    """Move pair ``p`` onto new bounds, keeping as much of its flow as they allow.

    Vertices whose balance changes are listed, once, in ``touched[:state[1]]``.
    """
    f = lo[p] + cap[2 * p + 1]
    nf = f
    if nf > new_hi:
        nf = new_hi
    if nf < new_lo:
        nf = new_lo
    if nf != f:
        _add_excess(tail, f - nf, excess, touched, listed, state)
        _add_excess(hd, nf - f, excess, touched, listed, state)
    lo[p] = new_lo
    hi[p] = new_hi
    cap[2 * p] = new_hi - nf
    cap[2 * p + 1] = nf - new_lo


@njit(cache=True)
def update_times(topo: Array, topo_pos: Array, pred_ptr: Array, pred_idx: Array,
                  succ_ptr: Array, succ_idx: Array, dur: Array, ef: Array, ls: Array,
                  up: Array, n_up: int, down: Array, n_down: int,
                  dirty: Array) -> int:  # fmt: skip
    """Bring ``ef``/``ls`` up to date after ``up[:n_up]`` and ``down[:n_down]`` changed duration.

    The same values as :func:`perseus_planner._kernel.critical_path`, recomputed
    only where an input changed: earliest finishes in topological order from the
    changed computations on, latest starts backwards from them and from the sink
    when the makespan moved. Returns the makespan.
    """
    n = topo.shape[0]
    sink = n - 1
    first = n
    last = -1
    for k in range(n_up + n_down):
        v = up[k] if k < n_up else down[k - n_up]
        dirty[v] = True
        first = min(first, topo_pos[v])
        last = max(last, topo_pos[v])
    for k in range(first, n):
        v = topo[k]
        if not dirty[v]:
            continue
        dirty[v] = False
        es = 0
        for j in range(pred_ptr[v], pred_ptr[v + 1]):
            if ef[pred_idx[j]] > es:
                es = ef[pred_idx[j]]
        if es + dur[v] != ef[v]:
            ef[v] = es + dur[v]
            for j in range(succ_ptr[v], succ_ptr[v + 1]):
                dirty[succ_idx[j]] = True
    # Every computation reaches the sink and durations are not negative, so the
    # sink finishes last: its finish is the makespan, and its latest start was.
    makespan: int = ef[sink]
    for k in range(n_up):
        dirty[up[k]] = True
    for k in range(n_down):
        dirty[down[k]] = True
    if ls[sink] != makespan - dur[sink]:
        dirty[sink] = True
        last = max(last, topo_pos[sink])
    for k in range(last, -1, -1):
        v = topo[k]
        if not dirty[v]:
            continue
        dirty[v] = False
        lf = makespan
        for j in range(succ_ptr[v], succ_ptr[v + 1]):
            if ls[succ_idx[j]] < lf:
                lf = ls[succ_idx[j]]
        if lf - dur[v] != ls[v]:
            ls[v] = lf - dur[v]
            for j in range(pred_ptr[v], pred_ptr[v + 1]):
                dirty[pred_idx[j]] = True
    return makespan


@njit(cache=True, inline="always")
def node_bounds(i: int, dummy: Array, dur: Array, dmin: Array, tab_off: Array, lb_tab: Array,
                ub_tab: Array) -> tuple[int, int]:  # fmt: skip
    """Flow bounds of critical computation ``i`` at its duration (as the reference sets them)."""
    if dummy[i]:
        return 0, _INF
    k = tab_off[i] + dur[i] - dmin[i]
    new_lo = lb_tab[k]
    new_hi = ub_tab[k]
    if new_hi < new_lo:  # as the reference: the arc then only carries its bound
        new_hi = new_lo
    return new_lo, new_hi


@njit(cache=True)
def bounds_pass(edge_u: Array, edge_v: Array, dummy: Array, dur: Array, dmin: Array,
                tab_off: Array, lb_tab: Array, ub_tab: Array, crit: Array, ecrit: Array,
                lo: Array, hi: Array, cap: Array, excess: Array, touched: Array, listed: Array,
                state: Array) -> None:  # fmt: skip
    """Move the kept flow onto the bounds of every pair (zero off the critical DAG).

    A pass in node order costs less than visiting only the computations whose times
    moved: after a step those are most of the sink side of the cut, twice over.
    """
    n = dur.shape[0]
    for i in range(n):
        new_lo = 0
        new_hi = 0
        if crit[i]:
            new_lo, new_hi = node_bounds(i, dummy, dur, dmin, tab_off, lb_tab, ub_tab)
        if new_lo != lo[i] or new_hi != hi[i]:
            set_bounds(i, 2 * i, 2 * i + 1, new_lo, new_hi, lo, hi, cap, excess, touched, listed,
                       state)  # fmt: skip
    for e in range(edge_u.shape[0]):
        new_hi = _INF if ecrit[e] else 0
        if new_hi != hi[n + e]:
            set_bounds(n + e, 2 * edge_u[e] + 1, 2 * edge_v[e], 0, new_hi, lo, hi, cap, excess,
                       touched, listed, state)  # fmt: skip


@njit(cache=True)
def repair(n: int, n_edges: int, full_ptr: Array, full_arc: Array, head: Array, cap: Array,
           excess: Array, touched: Array, listed: Array, level: Array, seen: Array,
           state: Array, queue: Array, cursor: Array, stack: Array,
           parent: Array) -> bool:  # fmt: skip
    """Route the imbalance ``touched`` lists back into a feasible flow (through ``t -> s``).

    The source and sink may change their net flow freely: that is the flow value.
    Returns whether every lower bound could be met.
    """
    num_v = 2 * n
    sp_pair = n + n_edges
    tp_pair = sp_pair + num_v
    ts_pair = tp_pair + num_v
    excess[2 * (n - 2)] = 0  # left(SRC)
    excess[2 * (n - 1) + 1] = 0  # right(SNK)
    n_touched = state[1]
    need = 0
    for k in range(n_touched):
        v = touched[k]
        x = excess[v]
        if x > 0:
            cap[2 * (sp_pair + v)] = x
            need += x
        elif x < 0:
            cap[2 * (tp_pair + v)] = -x
    routed = need
    if need > 0:
        cap[2 * ts_pair] = _INF
        routed = dinic(num_v, num_v + 1, full_ptr, full_arc, head, cap, level, seen, state, queue,
                       cursor, stack, parent)  # fmt: skip
        cap[2 * ts_pair] = 0
        cap[2 * ts_pair + 1] = 0
    for k in range(n_touched):
        v = touched[k]
        cap[2 * (sp_pair + v)] = 0
        cap[2 * (sp_pair + v) + 1] = 0
        cap[2 * (tp_pair + v)] = 0
        cap[2 * (tp_pair + v) + 1] = 0
        excess[v] = 0
        listed[v] = False
    state[1] = 0
    return routed == need


_ = np  # numpy arrays are what every function here takes
