"""Compiled Phillips–Dessouky step that keeps its maximum flow from one step to the next.

The step of :func:`perseus_planner._kernel.pd_step` rebuilds the flow from zero
every time: first a flow meeting every lower bound (``sum(lb)`` units routed
around the whole pipeline through ``t -> s``), then the maximum flow. Profiling
showed that this is nearly all of the solve, and it grows with the frontier
times the DAG. Yet a step changes the network only a little: one unit of
duration on the computations of one cut, and the few computations that become,
or stop being, critical. So this kernel keeps the previous maximum flow, moves
it onto the new bounds (clamping each arc into ``[lb, ub]``, zero on arcs that
left the critical DAG), routes the small imbalance this leaves back into a
feasible flow, and maximizes from there.

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

After the cut, earliest finishes and latest starts are recomputed only where an
input moved (:func:`_update_times`), with the values a full critical-path pass
would give. What is left per step is linear in the DAG but small: one pass over
the bounds, the search that marks the source side of the cut, those updates.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from perseus_planner._kernel import (
    INF_UNITS,
    STATUS_AT_LIMIT,
    STATUS_INFEASIBLE_FLOW,
    STATUS_NO_GAIN,
    STATUS_OK,
    Array,
)

_INF = int(INF_UNITS)
_HALF_INF = _INF // 2
_COST_EPSILON_J = 1e-6


@njit(cache=True)
def _bfs(s: int, t: int, adj_ptr: Array, adj_arc: Array, head: Array, cap: Array,
         level: Array, seen: Array, state: Array, queue: Array, cursor: Array) -> bool:  # fmt: skip
    """Level vertices reachable from ``s`` (``seen == state[0]``); return whether ``t`` is.

    The search stops after the level of ``t``: Dinic's phase needs no deeper
    vertex, and a short repair path then costs little. ``queue[:state[2]]``
    lists the vertices it reached.
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
                    queue[qt] = v
                    qt += 1
                    if v == t:
                        t_level = level[v]
    state[2] = qt
    return bool(seen[t] == stamp)


@njit(cache=True)
def _dinic(s: int, t: int, adj_ptr: Array, adj_arc: Array, head: Array, cap: Array,
           level: Array, seen: Array, state: Array, queue: Array, cursor: Array,
           stack: Array) -> int:  # fmt: skip
    """Augment from ``s`` to ``t`` until no path is left; return the flow added.

    Returns -1 as soon as a path's bottleneck is "infinite". When it returns
    normally, ``seen == state[0]`` marks exactly the vertices reachable from
    ``s`` in the final residual graph, and ``queue[:state[2]]`` lists them.
    """
    total = 0
    while True:
        state[0] += 1
        stamp = state[0]
        if not _bfs(s, t, adj_ptr, adj_arc, head, cap, level, seen, state, queue, cursor):
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
def _update_times(topo: Array, topo_pos: Array, pred_ptr: Array, pred_idx: Array,
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


@njit(cache=True)
def warm_step(
    topo: Array, pred_ptr: Array, pred_idx: Array, succ_ptr: Array, succ_idx: Array,
    edge_u: Array, edge_v: Array, dummy: Array,
    dur: Array, dmin: Array, dmax: Array, tab_off: Array,
    cost_tab: Array, lb_tab: Array, ub_tab: Array,
    ef: Array, ls: Array,
    topo_pos: Array, dirty: Array,
    adj_ptr: Array, adj_arc: Array, full_ptr: Array, full_arc: Array, head: Array,
    cap: Array, lo: Array, hi: Array, excess: Array, touched: Array, listed: Array,
    level: Array, seen: Array, state: Array, queue: Array, cursor: Array, stack: Array,
    changed_up: Array, changed_down: Array, out_i: Array, out_f: Array,
) -> None:  # fmt: skip
    """One step of :func:`perseus_planner._kernel.pd_step`, from the flow ``cap`` holds.

    ``cap``/``lo``/``hi`` start all zero (no flow) and are kept between calls,
    as are ``excess``/``touched``/``listed`` (the imbalance left to route) and
    ``state``. ``adj_*`` lists the arcs of computations and dependencies only,
    ``full_*`` every arc. ``topo_pos`` is each node's place in ``topo``, ``dirty``
    all false between calls. Same outputs and status as ``pd_step``.
    """
    n = dur.shape[0]
    n_edges = edge_u.shape[0]
    num_v = 2 * n
    sp_pair = n + n_edges
    tp_pair = sp_pair + num_v
    ts_pair = tp_pair + num_v
    s_prime = 2 * n
    t_prime = 2 * n + 1
    source = 2 * (n - 2)  # left(SRC)
    sink = 2 * (n - 1) + 1  # right(SNK)

    # 1. The previous flow on this step's bounds (zero off the critical DAG). A pass
    # in node order costs less than visiting only the computations whose times moved:
    # after a step those are most of the sink side of the cut, twice over.
    for i in range(n):
        new_lo = 0
        new_hi = 0
        if ef[i] == ls[i] + dur[i]:
            if dummy[i]:
                new_hi = _INF
            else:
                k = tab_off[i] + dur[i] - dmin[i]
                new_lo = lb_tab[k]
                new_hi = ub_tab[k]
                if new_hi < new_lo:  # as the reference: the arc then only carries its bound
                    new_hi = new_lo
        if new_lo != lo[i] or new_hi != hi[i]:
            set_bounds(i, 2 * i, 2 * i + 1, new_lo, new_hi, lo, hi, cap, excess, touched, listed,
                       state)  # fmt: skip
    for e in range(n_edges):
        new_hi = _INF if ef[edge_u[e]] == ls[edge_v[e]] else 0
        if new_hi != hi[n + e]:
            set_bounds(n + e, 2 * edge_u[e] + 1, 2 * edge_v[e], 0, new_hi, lo, hi, cap, excess,
                       touched, listed, state)  # fmt: skip

    # 2. Route the imbalance that left back into a feasible flow (through t -> s).
    # The source and sink may change their net flow freely: that is the flow value.
    excess[source] = 0
    excess[sink] = 0
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
        routed = _dinic(s_prime, t_prime, full_ptr, full_arc, head, cap, level, seen, state,
                        queue, cursor, stack)  # fmt: skip
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
    if routed != need:
        out_i[0] = STATUS_INFEASIBLE_FLOW
        return

    # 3. Maximize; the last search marks the source side of the minimal minimum cut
    # and lists it in queue[:state[2]].
    if _dinic(source, sink, adj_ptr, adj_arc, head, cap, level, seen, state, queue, cursor,
              stack) < 0:  # fmt: skip
        out_i[0] = STATUS_AT_LIMIT
        return
    stamp = state[0]

    # 4. The cut: computations leaving the source side are sped up, those entering
    # it slowed down; a dependency leaving it cannot be shortened.
    n_up = 0
    n_down = 0
    for k in range(state[2]):
        u = queue[k]
        i = u >> 1
        if i >= n or ef[i] != ls[i] + dur[i]:
            continue
        if u & 1 == 0:
            if seen[u + 1] != stamp:
                if dummy[i] or dur[i] - 1 < dmin[i]:
                    out_i[0] = STATUS_AT_LIMIT
                    return
                changed_up[n_up] = i
                n_up += 1
            continue
        if seen[u - 1] != stamp and not dummy[i]:
            if dur[i] + 1 > dmax[i]:
                out_i[0] = STATUS_AT_LIMIT
                return
            changed_down[n_down] = i
            n_down += 1
        for j in range(succ_ptr[i], succ_ptr[i + 1]):
            v = succ_idx[j]
            if ef[i] == ls[v] and seen[2 * v] != stamp:
                out_i[0] = STATUS_AT_LIMIT
                return
    changed_up[:n_up].sort()
    changed_down[:n_down].sort()
    # Summed in node order, as the reference does, so that the no-gain test sees the same float.
    cost_change = 0.0
    a = 0
    b = 0
    while a < n_up or b < n_down:
        if b == n_down or (a < n_up and changed_up[a] < changed_down[b]):
            k = tab_off[changed_up[a]] + dur[changed_up[a]] - dmin[changed_up[a]]
            cost_change += abs(cost_tab[k - 1] - cost_tab[k])
            a += 1
        else:
            k = tab_off[changed_down[b]] + dur[changed_down[b]] - dmin[changed_down[b]]
            cost_change -= abs(cost_tab[k] - cost_tab[k + 1])
            b += 1
    if n_up == 0 or abs(cost_change) < _COST_EPSILON_J:
        out_i[0] = STATUS_NO_GAIN
        return

    for k in range(n_up):
        dur[changed_up[k]] -= 1
    for k in range(n_down):
        dur[changed_down[k]] += 1
    makespan = _update_times(topo, topo_pos, pred_ptr, pred_idx, succ_ptr, succ_idx, dur, ef,
                             ls, changed_up, n_up, changed_down, n_down, dirty)  # fmt: skip
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


_ = np  # numpy arrays are what every function here takes
