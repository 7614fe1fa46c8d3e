"""Compiled Phillips–Dessouky step that keeps the flow, the cut and the critical DAG.

Profiled at 8 stages x 192 microbatches, the step that only kept its maximum flow
(:mod:`perseus_planner._warm`) still did work linear in the DAG every step while
changing about five computations: the bounds of every pair (3n items), earliest
finishes and latest starts (half the DAG moves by one unit each way), the search
that marks the source side of the cut (73 % of the vertices), the pass over that
side for the cut. 20x the time of 8 x 24 for 6.5x the points. Yet in 97 % of
the steps the critical DAG does not change, and in 90 % no flow can be added.
This kernel keeps what those steps leave alone:

* The source side ``S`` of the minimal minimum cut (``in_s``), the critical
  computations crossing it (``cut_list``) and the number of critical
  dependencies crossing it forward and backward (``kc``). The next step changes
  bounds only on the computations the cut changed, each with one end in ``S``:
  the residual graph inside ``S`` is the same, so ``S`` can only grow, through
  the residual these arcs gained. A search from their far ends, outside ``S``,
  either reaches the sink (a flow can be added: maximize from the source as
  before) or finds exactly the vertices ``S`` gains.
* The critical DAG, and the time at which times must be recomputed. Every
  critical path crosses the cut forward once more than backward; with no
  critical dependency crossing it backward, each crossing forward is a
  computation sped up and each backward one slowed down, so every critical
  path is exactly one unit shorter. A path with a non-critical item was at
  least ``min float`` shorter than the makespan and grows by at most the number
  of computations slowed down. So while ``budget`` (the least float, less
  ``1 + slowed`` every step) stays at least 1, the critical DAG and every
  criticality stay as they are and the makespan drops by exactly one: earliest
  finishes and latest starts wait (``pending`` lists the computations whose
  durations moved) until a step cannot show that, which recomputes them
  (:func:`perseus_planner._warm.update_times`) and every bound. A non-critical
  dependency between two critical computations is followed exactly instead
  (:func:`_near_floats`): the budget then covers only the other items.

The result is the reference step's: the same minimal minimum cut (the vertices
reachable from the source in the residual graph of any maximum flow), the same
critical DAG and makespan, the same sums in the same order.
"""

from __future__ import annotations

import numpy as np

from perseus_planner._jit import njit
from perseus_planner._kernel import (
    STATUS_AT_LIMIT,
    STATUS_INFEASIBLE_FLOW,
    STATUS_NO_GAIN,
    STATUS_OK,
    Array,
)
from perseus_planner._source_side import augment_tree_path, grow
from perseus_planner._warm import (
    bounds_pass,
    dinic,
    node_bounds,
    repair,
    set_bounds,
    update_times,
)

# Slots of ``kc``, the kept state that is not an array.
FULL = 0  # 1: the critical DAG may have changed; recompute it and every bound
N_CUT = 1  # critical computations crossing the cut, listed in cut_list
FORWARD = 2  # critical dependencies right(u) in S, left(v) not
BACKWARD = 3  # critical dependencies left(v) in S, right(u) not
BUDGET = 4  # no non-critical item can become critical while this stays >= 1
MAKESPAN = 5
N_PENDING = 6  # computations whose duration moved since ef/ls were last updated
N_LAST = 7  # computations the last step changed (their bounds move next step)
NO_TOTAL = 8  # 1: leave the total cost to the caller (out_f[1] is then NaN)
N_NEAR = 9  # non-critical dependencies between critical computations, floats below BUDGET
KC_SIZE = 10

_COST_EPSILON_J = 1e-6
_NO_FLOAT = 1 << 62
_GROW_AUGMENTS = 3  # then a Dinic run: each search here re-explores what it reached
# A grow of more than n / this vertices: one pass over the DAG then costs less than joining
# them one by one (at 8 x 192, 60 grows of ~5,600 vertices were 71 % of every vertex joined).
_JOIN_SHARE = 4


@njit(cache=True)
def criticality(edge_u: Array, edge_v: Array, dur: Array, ef: Array, ls: Array, crit: Array,
                ecrit: Array, near: Array, kc: Array) -> int:  # fmt: skip
    """Update ``crit``/``ecrit``, ``kc[BUDGET]`` and the near dependencies.

    ``kc[BUDGET]`` is the least float of a non-critical item, except the
    non-critical dependencies between two critical computations: those whose float is
    below it are listed in ``near`` (dependency, float) instead, ``kc[N_NEAR]`` of them,
    because a step can follow their floats exactly (:func:`_near_floats`).
    Returns how many items changed criticality.
    """
    least = _NO_FLOAT
    flips = 0
    n_near = 0
    for i in range(dur.shape[0]):
        slack = ls[i] + dur[i] - ef[i]
        now = slack == 0
        if now != crit[i]:
            crit[i] = now
            flips += 1
        if 0 < slack < least:
            least = slack
    for e in range(edge_u.shape[0]):
        slack = ls[edge_v[e]] - ef[edge_u[e]]
        now = slack == 0
        if now != ecrit[e]:
            ecrit[e] = now
            flips += 1
        if 0 < slack < least:
            if crit[edge_u[e]] and crit[edge_v[e]]:
                near[2 * n_near] = e
                near[2 * n_near + 1] = slack
                n_near += 1
            else:
                least = slack
    kept = 0
    for k in range(n_near):  # listed against a least float that fell since
        if near[2 * k + 1] < least:
            near[2 * kept] = near[2 * k]
            near[2 * kept + 1] = near[2 * k + 1]
            kept += 1
    kc[N_NEAR] = kept
    kc[BUDGET] = least
    return flips


@njit(cache=True)
def _near_floats(edge_u: Array, edge_v: Array, in_s: Array, n_down: int, near: Array,
                 kc: Array) -> bool:  # fmt: skip
    """Move the near dependencies' floats over this step; return whether all stay >= 1.

    With nothing slowed down and no critical dependency entering ``S``, a critical
    computation's earliest finish drops by one exactly when its right end is outside
    ``S`` (its critical paths from the source cross the cut once, through a computation
    sped up) and its latest start stays exactly when its left end is in ``S`` (the
    makespan drops by one): a dependency between two critical computations loses one
    unit of float when it leaves ``S`` and gains one when it enters it. Otherwise its
    float drops by at most ``1 + n_down``, as any item's.
    """
    ok = True
    for k in range(kc[N_NEAR]):
        if n_down == 0:
            e = near[2 * k]
            tail_in = in_s[2 * edge_u[e] + 1]
            head_in = in_s[2 * edge_v[e]]
            if tail_in and not head_in:
                near[2 * k + 1] -= 1
            elif head_in and not tail_in:
                near[2 * k + 1] += 1
        else:
            near[2 * k + 1] -= 1 + n_down
        if near[2 * k + 1] < 1:
            ok = False
    return ok


@njit(cache=True, inline="always")  # called per vertex: a call costs more than the work
def _join(v: int, n: int, edge_u: Array, edge_v: Array, out_ptr: Array, out_eid: Array,
          in_ptr: Array, in_eid: Array, crit: Array, ecrit: Array, in_s: Array,
          cut_list: Array, cut_pos: Array, kc: Array) -> None:  # fmt: skip
    """Put vertex ``v`` on the source side, keeping the crossing computations and counts."""
    in_s[v] = True
    i = v >> 1
    if i >= n:
        return
    if crit[i]:
        if in_s[v ^ 1]:  # both ends in S now: it no longer crosses
            k = cut_pos[i]
            last = cut_list[kc[N_CUT] - 1]
            cut_list[k] = last
            cut_pos[last] = k
            cut_pos[i] = -1
            kc[N_CUT] -= 1
        else:
            cut_pos[i] = kc[N_CUT]
            cut_list[kc[N_CUT]] = i
            kc[N_CUT] += 1
    if v & 1:  # right(i): the dependencies leaving i start in S
        for j in range(out_ptr[i], out_ptr[i + 1]):
            e = out_eid[j]
            if ecrit[e]:
                if in_s[2 * edge_v[e]]:
                    kc[BACKWARD] -= 1
                else:
                    kc[FORWARD] += 1
    else:  # left(i): the dependencies entering i end in S
        for j in range(in_ptr[i], in_ptr[i + 1]):
            e = in_eid[j]
            if ecrit[e]:
                if in_s[2 * edge_u[e] + 1]:
                    kc[FORWARD] -= 1
                else:
                    kc[BACKWARD] += 1


@njit(cache=True)
def _recount(n: int, edge_u: Array, edge_v: Array, crit: Array, ecrit: Array, in_s: Array,
             cut_list: Array, cut_pos: Array, kc: Array) -> None:  # fmt: skip
    """The crossing computations and dependency counts of a new source side ``in_s``."""
    n_cut = 0
    for i in range(n):
        if crit[i] and in_s[2 * i] != in_s[2 * i + 1]:
            cut_pos[i] = n_cut
            cut_list[n_cut] = i
            n_cut += 1
        else:
            cut_pos[i] = -1
    kc[N_CUT] = n_cut
    forward = 0
    backward = 0
    for e in range(edge_u.shape[0]):
        if ecrit[e]:
            tail_in = in_s[2 * edge_u[e] + 1]
            head_in = in_s[2 * edge_v[e]]
            if tail_in and not head_in:
                forward += 1
            elif head_in and not tail_in:
                backward += 1
    kc[FORWARD] = forward
    kc[BACKWARD] = backward


@njit(cache=True)
def kept_cut_step(
    topo: Array, pred_ptr: Array, pred_idx: Array, succ_ptr: Array, succ_idx: Array,
    edge_u: Array, edge_v: Array, dummy: Array,
    dur: Array, dmin: Array, dmax: Array, tab_off: Array,
    cost_tab: Array, lb_tab: Array, ub_tab: Array,
    ef: Array, ls: Array, topo_pos: Array, dirty: Array,
    adj_ptr: Array, adj_arc: Array, full_ptr: Array, full_arc: Array, head: Array,
    cap: Array, lo: Array, hi: Array, excess: Array, touched: Array, listed: Array,
    level: Array, seen: Array, state: Array, queue: Array, cursor: Array, stack: Array,
    parent: Array, out_ptr: Array, out_eid: Array, in_ptr: Array, in_eid: Array,
    crit: Array, ecrit: Array, in_s: Array, cut_list: Array, cut_pos: Array,
    pending: Array, last: Array, near: Array, kc: Array,
    changed_up: Array, changed_down: Array, out_i: Array, out_f: Array,
) -> None:  # fmt: skip
    """One step of :func:`perseus_planner._kernel.pd_step`, from what the last one kept.

    Start with ``kc[FULL] = 1``, ``kc[MAKESPAN]`` and ``ef``/``ls`` from a critical-path
    pass, ``cut_pos`` all -1 and the flow arrays as :mod:`perseus_planner._warm`
    wants them. ``ef``/``ls`` are current only after a step that set ``kc[FULL]``,
    or after :func:`sync_times`. Same outputs and status as ``pd_step``.
    """
    n = dur.shape[0]
    n_edges = edge_u.shape[0]
    source = 2 * (n - 2)  # left(SRC)
    sink = 2 * (n - 1) + 1  # right(SNK)
    rebuild = False
    if kc[FULL]:
        kc[FULL] = 0
        # Most of the time the critical DAG is still the same: then this is a step like any.
        if criticality(edge_u, edge_v, dur, ef, ls, crit, ecrit, near, kc) > 0:
            bounds_pass(edge_u, edge_v, dummy, dur, dmin, tab_off, lb_tab, ub_tab, crit, ecrit,
                        lo, hi, cap, excess, touched, listed, state)  # fmt: skip
            rebuild = True
    if not rebuild:
        # Only the last cut's computations moved: only their bounds change.
        for k in range(kc[N_LAST]):
            i = last[k]
            new_lo, new_hi = node_bounds(i, dummy, dur, dmin, tab_off, lb_tab, ub_tab)
            set_bounds(i, 2 * i, 2 * i + 1, new_lo, new_hi, lo, hi, cap, excess, touched, listed,
                       state)  # fmt: skip
        if state[1] > 0:  # the flow left its bounds somewhere: repair, then maximize
            rebuild = True
        else:
            # Augment along the paths the search finds while the source side stays whole:
            # every one leaves S through an arc the last cut changed.
            for attempt in range(_GROW_AUGMENTS + 1):
                grown = grow(n, sink, last[: kc[N_LAST]], adj_ptr, adj_arc, head, cap, seen,
                              state, queue, parent, in_s)  # fmt: skip
                if grown >= 0:
                    break
                if attempt == _GROW_AUGMENTS:
                    rebuild = True
                    break
                intact = augment_tree_path(source, sink, adj_ptr, adj_arc, head, cap, parent,
                                            in_s, stack)  # fmt: skip
                if intact < 0:
                    out_i[0] = STATUS_AT_LIMIT
                    return
                if intact == 0:
                    rebuild = True
                    break
            if grown > n // _JOIN_SHARE:
                for k in range(grown):
                    in_s[queue[k]] = True
                _recount(n, edge_u, edge_v, crit, ecrit, in_s, cut_list, cut_pos, kc)
            else:
                for k in range(grown):
                    _join(queue[k], n, edge_u, edge_v, out_ptr, out_eid, in_ptr, in_eid, crit,
                          ecrit, in_s, cut_list, cut_pos, kc)  # fmt: skip
    if rebuild:
        if not repair(n, n_edges, full_ptr, full_arc, head, cap, excess, touched, listed, level,
                      seen, state, queue, cursor, stack, parent):  # fmt: skip
            out_i[0] = STATUS_INFEASIBLE_FLOW
            return
        if dinic(source, sink, adj_ptr, adj_arc, head, cap, level, seen, state, queue, cursor,
                 stack, parent) < 0:  # fmt: skip
            out_i[0] = STATUS_AT_LIMIT
            return
        # The last search lists the source side of the minimal minimum cut.
        in_s[:] = False
        for k in range(state[2]):
            in_s[queue[k]] = True
        _recount(n, edge_u, edge_v, crit, ecrit, in_s, cut_list, cut_pos, kc)

    # The cut: computations leaving the source side are sped up, those entering it
    # slowed down; a dependency leaving it cannot be shortened.
    if kc[FORWARD] > 0:
        out_i[0] = STATUS_AT_LIMIT
        return
    n_up = 0
    n_down = 0
    for k in range(kc[N_CUT]):
        i = cut_list[k]
        if in_s[2 * i]:
            if dummy[i] or dur[i] - 1 < dmin[i]:
                out_i[0] = STATUS_AT_LIMIT
                return
            changed_up[n_up] = i
            n_up += 1
        elif not dummy[i]:
            if dur[i] + 1 > dmax[i]:
                out_i[0] = STATUS_AT_LIMIT
                return
            changed_down[n_down] = i
            n_down += 1
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
        last[k] = changed_up[k]
    for k in range(n_down):
        dur[changed_down[k]] += 1
        last[n_up + k] = changed_down[k]
    kc[N_LAST] = n_up + n_down
    if kc[N_PENDING] + n_up + n_down > pending.shape[0]:
        sync_times(topo, topo_pos, pred_ptr, pred_idx, succ_ptr, succ_idx, dur, ef, ls, dirty,
                   pending, kc)  # fmt: skip
    for k in range(n_up + n_down):
        pending[kc[N_PENDING] + k] = last[k]
    kc[N_PENDING] += n_up + n_down
    budget = kc[BUDGET] - 1 - n_down
    # (A near dependency's float, if any falls below 1, may have reached 0: recompute.)
    if (kc[BACKWARD] == 0 and budget >= 1
            and _near_floats(edge_u, edge_v, in_s, n_down, near, kc)):  # fmt: skip
        kc[BUDGET] = budget
        kc[MAKESPAN] -= 1
    else:
        kc[MAKESPAN] = sync_times(topo, topo_pos, pred_ptr, pred_idx, succ_ptr, succ_idx, dur, ef,
                                  ls, dirty, pending, kc)  # fmt: skip
        kc[FULL] = 1
    total = np.nan
    if not kc[NO_TOTAL]:
        total = 0.0
        for i in range(n):
            if not dummy[i]:
                total += cost_tab[tab_off[i] + dur[i] - dmin[i]]
    out_i[0] = STATUS_OK
    out_i[1] = kc[MAKESPAN]
    out_i[2] = n_up
    out_i[3] = n_down
    out_f[0] = cost_change
    out_f[1] = total


@njit(cache=True)
def sync_times(topo: Array, topo_pos: Array, pred_ptr: Array, pred_idx: Array, succ_ptr: Array,
               succ_idx: Array, dur: Array, ef: Array, ls: Array, dirty: Array, pending: Array,
               kc: Array) -> int:  # fmt: skip
    """Bring ``ef``/``ls`` up to date with the pending duration changes; return the makespan."""
    makespan: int = update_times(topo, topo_pos, pred_ptr, pred_idx, succ_ptr, succ_idx, dur, ef,
                                 ls, pending, kc[N_PENDING], pending, 0, dirty)  # fmt: skip
    kc[N_PENDING] = 0
    return makespan
