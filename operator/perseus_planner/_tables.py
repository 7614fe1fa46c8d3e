"""The flat arrays a frontier problem hands to the compiled kernels.

Its own module so that the solver, which builds them (:mod:`perseus_planner.solver`), and the
steppers, which work in them (:mod:`perseus_planner._steps`), both import the type from below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class KernelTables:
    """Flat arrays for the kernel. Nodes ``n`` and ``n+1`` are the source and sink."""

    graph: tuple[IntArray, IntArray, IntArray, IntArray, IntArray]  # topo, preds, succs (CSR)
    edge_u: IntArray
    edge_v: IntArray
    dummy: npt.NDArray[np.bool_]
    dmin: IntArray
    dmax: IntArray
    tab_off: IntArray
    cost_tab: FloatArray
    lb_tab: IntArray
    ub_tab: IntArray
    knob_tab: IntArray
