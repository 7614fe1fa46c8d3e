"""The solver's kernels, compiled by numba where it is installed, else run as plain Python.

Same code, same results either way: the kernels use integer and float64 arithmetic with no
``fastmath`` and nothing parallel, which numba compiles to what Python computes. Compiled,
the demo's solve (8 stages x 24 microbatches) takes under a second, but compiling costs about
20 s on a first run (cached on disk after); interpreted it takes about 8 s, with no compile.
``make demo`` installs no numba for that reason; the planner extra, the operator's and the
CLI's install it, and large problems need it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, Final, Literal, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

COMPILED: Final = importlib.util.find_spec("numba") is not None
"""Whether the kernels are numba-compiled (numba is installed)."""


def njit(*, cache: bool = False, inline: Literal["never", "always"] = "never") -> Callable[[F], F]:
    """numba's ``njit(cache=..., inline=...)``, or the function itself without numba."""
    if not COMPILED:
        return lambda function: function
    from numba import njit as numba_njit

    return cast(Callable[[F], F], numba_njit(cache=cache, inline=inline))
