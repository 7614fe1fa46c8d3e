"""The two ways the solver runs a Phillips–Dessouky step, with the flow networks they use.

:class:`WarmStepper` keeps each step's maximum flow, minimum cut and critical DAG for
the next one (:mod:`perseus_planner._kept_cut`); :class:`ReferenceStepper` rebuilds it from zero
every step (:func:`perseus_planner._kernel.pd_step`), the original algorithm,
kept so that tests and benchmarks can compare the two in one process.

Both hold the arrays their kernel works in and share the solver's durations
``dur`` and critical-path arrays ``ef``/``ls``, which steps update in place (the
warm one only when it must: :meth:`WarmStepper.sync_times` brings them up to date).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from perseus_planner import _kept_cut, _kernel, _warm
from perseus_planner._tables import KernelTables

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


class ReferenceStepper:
    """Each step from scratch: a flow meeting every lower bound, then the maximum flow."""

    def __init__(self, tables: KernelTables, dur: IntArray, ef: IntArray, ls: IntArray) -> None:
        self._t = tables
        self._dur, self._ef, self._ls = dur, ef, ls
        self._adj_ptr, self._adj_arc, self._head = reference_network(
            len(dur), tables.edge_u, tables.edge_v
        )
        self._cap = np.zeros(len(self._head), dtype=np.int64)
        num_vertices = len(self._adj_ptr) - 1
        self._level = np.empty(num_vertices, dtype=np.int64)
        self._queue = np.empty(num_vertices, dtype=np.int64)
        self._cursor = np.empty(num_vertices, dtype=np.int64)
        self._stack = np.empty(num_vertices, dtype=np.int64)

    def step(self, up: IntArray, down: IntArray, out_i: IntArray, out_f: FloatArray) -> None:
        """One step; outputs as :func:`perseus_planner._kernel.pd_step`."""
        t = self._t
        _kernel.pd_step(
            *t.graph, t.edge_u, t.edge_v, t.dummy, self._dur, t.dmin, t.dmax, t.tab_off,
            t.cost_tab, t.lb_tab, t.ub_tab, self._ef, self._ls, self._adj_ptr, self._adj_arc,
            self._head, self._cap, self._level, self._queue, self._cursor, self._stack,
            up, down, out_i, out_f,
        )  # fmt: skip


class WarmStepper:
    """Each step from the previous step's maximum flow, cut and critical DAG (:mod:`._kept_cut`)."""

    def __init__(self, tables: KernelTables, dur: IntArray, ef: IntArray, ls: IntArray) -> None:
        self._t = tables
        self._dur, self._ef, self._ls = dur, ef, ls
        num = len(dur)
        tail, hd = warm_arcs(num, tables.edge_u, tables.edge_v)
        # The source-to-sink searches need only computations and dependencies: leaving the
        # repair arcs out of their adjacency keeps them from scanning two dead arcs a vertex.
        num_pairs = num + len(tables.edge_u)
        self._adj_ptr, self._adj_arc, self._head = adjacency(
            2 * num + 2, tail, hd, np.arange(2 * num_pairs, dtype=np.int64)
        )
        self._full_ptr, self._full_arc, _ = adjacency(2 * num + 2, tail, hd)
        self.cap = np.zeros(len(self._head), dtype=np.int64)
        self.lo = np.zeros(num_pairs, dtype=np.int64)
        self.hi = np.zeros(num_pairs, dtype=np.int64)
        num_vertices = 2 * num + 2
        self.excess = np.zeros(num_vertices, dtype=np.int64)
        self._touched = np.zeros(num_vertices, dtype=np.int64)
        self._listed = np.zeros(num_vertices, dtype=np.bool_)
        self._state = np.zeros(3, dtype=np.int64)  # search stamp, touched count, last search size
        topo = tables.graph[0]
        self._topo_pos = np.empty(num, dtype=np.int64)
        self._topo_pos[topo] = np.arange(num, dtype=np.int64)
        self._dirty = np.zeros(num, dtype=np.bool_)
        self._level = np.empty(num_vertices, dtype=np.int64)
        self._seen = np.zeros(num_vertices, dtype=np.int64)
        self._queue = np.empty(num_vertices, dtype=np.int64)
        self._cursor = np.empty(num_vertices, dtype=np.int64)
        self._stack = np.empty(num_vertices, dtype=np.int64)
        self._parent = np.zeros(num_vertices, dtype=np.int64)  # the arc each vertex of S came by
        edge_ids = np.arange(len(tables.edge_u), dtype=np.int64)
        self._out_ptr, self._out_eid = _csr(num, tables.edge_u, edge_ids)
        self._in_ptr, self._in_eid = _csr(num, tables.edge_v, edge_ids)
        self.crit = np.zeros(num, dtype=np.bool_)
        self.ecrit = np.zeros(len(tables.edge_u), dtype=np.bool_)
        self._in_s = np.zeros(num_vertices, dtype=np.bool_)
        self._cut_list = np.zeros(num, dtype=np.int64)
        self._cut_pos = np.full(num, -1, dtype=np.int64)
        self._pending = np.zeros(4 * num, dtype=np.int64)
        self._last = np.zeros(num, dtype=np.int64)
        self._near = np.zeros(2 * len(tables.edge_u), dtype=np.int64)  # (dependency, float)
        self.kc = np.zeros(_kept_cut.KC_SIZE, dtype=np.int64)
        self.kc[_kept_cut.FULL] = 1
        self.kc[_kept_cut.MAKESPAN] = ef[num - 1]  # the sink finishes last

    def step(self, up: IntArray, down: IntArray, out_i: IntArray, out_f: FloatArray) -> None:
        """One step; outputs as :func:`perseus_planner._kernel.pd_step`."""
        t = self._t
        _kept_cut.kept_cut_step(
            *t.graph, t.edge_u, t.edge_v, t.dummy, self._dur, t.dmin, t.dmax, t.tab_off,
            t.cost_tab, t.lb_tab, t.ub_tab, self._ef, self._ls, self._topo_pos, self._dirty,
            self._adj_ptr, self._adj_arc,
            self._full_ptr, self._full_arc, self._head, self.cap, self.lo, self.hi, self.excess,
            self._touched, self._listed, self._level, self._seen, self._state, self._queue,
            self._cursor, self._stack, self._parent, self._out_ptr, self._out_eid, self._in_ptr,
            self._in_eid, self.crit, self.ecrit, self._in_s, self._cut_list, self._cut_pos,
            self._pending, self._last, self._near, self.kc, up, down, out_i, out_f,
        )  # fmt: skip

    def sync_times(self) -> int:
        """Bring ``ef``/``ls`` up to date (steps leave them behind); return the makespan."""
        t = self._t
        topo, pred_ptr, pred_idx, succ_ptr, succ_idx = t.graph
        makespan = _kept_cut.sync_times(
            topo, self._topo_pos, pred_ptr, pred_idx, succ_ptr, succ_idx, self._dur, self._ef,
            self._ls, self._dirty, self._pending, self.kc,
        )  # fmt: skip
        return int(makespan)

    def move_flow(self, pair: int, flow: int) -> None:
        """Set the flow of one computation or dependency pair, within its bounds.

        This unbalances the flow as a step's new bounds do; the next step routes
        the imbalance back. Tests use it to exercise that repair on inputs where
        the bounds never push a flow out of range.
        """
        lo, hi = int(self.lo[pair]), int(self.hi[pair])
        if not lo <= flow <= hi:
            raise ValueError(f"flow {flow} outside the bounds [{lo}, {hi}] of pair {pair}")
        num = len(self._dur)
        if pair < num:
            tail, head = 2 * pair, 2 * pair + 1
        else:
            e = pair - num
            tail, head = 2 * int(self._t.edge_u[e]) + 1, 2 * int(self._t.edge_v[e])
        args = (self.lo, self.hi, self.cap, self.excess, self._touched, self._listed, self._state)
        _warm.set_bounds(pair, tail, head, flow, flow, *args)
        _warm.set_bounds(pair, tail, head, lo, hi, *args)


def reference_network(
    num: int, edge_u: IntArray, edge_v: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """Static arcs of the activity-on-arc network, in the order the kernel expects.

    Returns ``(adj_ptr, adj_arc, head)``: arcs leaving each vertex (CSR) and the
    head vertex of each arc. Vertices: ``left(i) = 2i``, ``right(i) = 2i+1``,
    then ``s'`` and ``t'``.
    """
    s_prime, t_prime = 2 * num, 2 * num + 1
    idx = np.arange(num, dtype=np.int64)
    tails = [2 * idx]  # computation arcs left(i) -> right(i)
    heads = [2 * idx + 1]
    tails.append(2 * edge_u + 1)  # dependency arcs right(u) -> left(v)
    heads.append(2 * edge_v)
    tails.append(np.full(num, s_prime, dtype=np.int64))  # s' -> right(i): lower bounds in
    heads.append(2 * idx + 1)
    tails.append(2 * idx)  # left(i) -> t': lower bounds out
    heads.append(np.full(num, t_prime, dtype=np.int64))
    tails.append(np.array([2 * (num - 1) + 1], dtype=np.int64))  # t -> s
    heads.append(np.array([2 * (num - 2)], dtype=np.int64))
    return adjacency(2 * num + 2, np.concatenate(tails), np.concatenate(heads))


def adjacency(
    num_vertices: int, tail: IntArray, hd: IntArray, arcs: IntArray | None = None
) -> tuple[IntArray, IntArray, IntArray]:
    """``(adj_ptr, adj_arc, head)`` of arcs ``tail -> hd``, each with its residual twin.

    Arc ``2k`` is ``tail[k] -> hd[k]`` and ``2k + 1`` its twin. ``arcs``, when
    given, limits the adjacency lists to those arc numbers (``head`` covers all).
    """
    # Interleave each arc with its residual twin (a, a ^ 1).
    arc_tail = np.empty(2 * len(tail), dtype=np.int64)
    arc_head = np.empty(2 * len(tail), dtype=np.int64)
    arc_tail[0::2], arc_tail[1::2] = tail, hd
    arc_head[0::2], arc_head[1::2] = hd, tail
    listed = np.arange(len(arc_tail), dtype=np.int64) if arcs is None else arcs
    order = listed[np.argsort(arc_tail[listed], kind="stable")].astype(np.int64)
    adj_ptr = np.zeros(num_vertices + 1, dtype=np.int64)
    np.cumsum(np.bincount(arc_tail[listed], minlength=num_vertices), out=adj_ptr[1:])
    return adj_ptr, order, arc_head


def warm_arcs(num: int, edge_u: IntArray, edge_v: IntArray) -> tuple[IntArray, IntArray]:
    """Tails and heads of the arcs :func:`perseus_planner._kept_cut.kept_cut_step` expects.

    As :func:`reference_network`, but with an arc ``s' -> v`` and ``v -> t'`` for
    every vertex ``v``: a warm-started flow can be out of balance anywhere.
    """
    num_v = 2 * num
    s_prime, t_prime = num_v, num_v + 1
    idx = np.arange(num, dtype=np.int64)
    every = np.arange(num_v, dtype=np.int64)
    tail = np.concatenate(
        [
            2 * idx,  # computation arcs left(i) -> right(i)
            2 * edge_u + 1,  # dependency arcs right(u) -> left(v)
            np.full(num_v, s_prime, dtype=np.int64),  # s' -> v: surplus in
            every,  # v -> t': deficit out
            np.array([2 * (num - 1) + 1], dtype=np.int64),  # t -> s
        ]
    )
    hd = np.concatenate(
        [
            2 * idx + 1,
            2 * edge_v,
            every,
            np.full(num_v, t_prime, dtype=np.int64),
            np.array([2 * (num - 2)], dtype=np.int64),
        ]
    )
    return tail, hd


def _csr(num: int, keys: IntArray, values: IntArray) -> tuple[IntArray, IntArray]:
    """``values`` grouped by ``keys`` (``0..num-1``): pointers and the grouped values."""
    order = np.argsort(keys, kind="stable")
    ptr = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=num), out=ptr[1:])
    return ptr, values[order].astype(np.int64)
