"""Searches that keep the minimum cut's source side ``S`` between steps.

Used by :mod:`perseus_planner._kept_cut`: :func:`grow` finds what ``S`` gains
through the residual the last cut's arcs gained, :func:`augment_tree_path` adds
flow along ``S``'s search tree (``parent``: the arc each vertex was reached by)
when that search reaches the sink. Arc numbering as in :mod:`perseus_planner._warm`.
"""

from __future__ import annotations

from perseus_planner._jit import njit
from perseus_planner._kernel import INF_UNITS, Array

_INF = int(INF_UNITS)
_HALF_INF = _INF // 2


@njit(cache=True)
def grow(n: int, sink: int, last: Array, adj_ptr: Array, adj_arc: Array, head: Array,
          cap: Array, seen: Array, state: Array, queue: Array, parent: Array,
          in_s: Array) -> int:  # fmt: skip
    """Vertices outside ``S`` reachable through the residual the last cut's arcs gained.

    Lists them in ``queue`` and returns how many, or -1 when the sink is among
    them (then a flow can be added). ``parent`` is the arc each was reached by.
    """
    state[0] += 1
    stamp = state[0]
    qt = 0
    for k in range(last.shape[0]):
        i = last[k]
        if in_s[2 * i] and not in_s[2 * i + 1] and cap[2 * i] > 0:
            a = 2 * i
        elif in_s[2 * i + 1] and not in_s[2 * i] and cap[2 * i + 1] > 0:
            a = 2 * i + 1
        else:
            continue
        v = head[a]
        if seen[v] != stamp:
            seen[v] = stamp
            parent[v] = a
            queue[qt] = v
            qt += 1
    qh = 0
    while qh < qt:
        u = queue[qh]
        qh += 1
        if u == sink:
            return -1
        for k in range(adj_ptr[u], adj_ptr[u + 1]):
            a = adj_arc[k]
            if cap[a] > 0:
                v = head[a]
                if not in_s[v] and seen[v] != stamp:
                    seen[v] = stamp
                    parent[v] = a
                    queue[qt] = v
                    qt += 1
    return qt


@njit(cache=True)
def augment_tree_path(source: int, sink: int, adj_ptr: Array, adj_arc: Array, head: Array,
                       cap: Array, parent: Array, in_s: Array, orphans: Array) -> int:  # fmt: skip
    """Send the bottleneck along the parent arcs from the source to the sink.

    Returns 1 when ``S`` is still the set reachable from the source, 0 when it
    may have shrunk, -1 when the bottleneck is "infinite". An arc of the path
    inside ``S`` that runs out of residual leaves the vertex it led to without a
    parent; another arc into it from a vertex whose own path to the source
    avoids it keeps it (and what hangs below it) reachable.
    """
    bottleneck = _INF
    v = sink
    while v != source:
        a = parent[v]
        if cap[a] < bottleneck:
            bottleneck = cap[a]
        v = head[a ^ 1]
    if bottleneck >= _HALF_INF:
        return -1
    n_orphans = 0
    v = sink
    while v != source:
        a = parent[v]
        cap[a] -= bottleneck
        cap[a ^ 1] += bottleneck
        if cap[a] == 0 and in_s[v] and in_s[head[a ^ 1]]:
            orphans[n_orphans] = v
            n_orphans += 1
        v = head[a ^ 1]
    for k in range(n_orphans):
        w = orphans[k]
        adopted = False
        for j in range(adj_ptr[w], adj_ptr[w + 1]):
            into = adj_arc[j] ^ 1  # the arc u -> w
            u = head[adj_arc[j]]
            if cap[into] <= 0 or not in_s[u]:
                continue
            x = u  # u's path to the source must have residual and avoid w
            while x != source and x != w and cap[parent[x]] > 0:
                x = head[parent[x] ^ 1]
            if x == source:
                parent[w] = into
                adopted = True
                break
        if not adopted:
            return 0
    return 1
