"""Whether the solver's compiled code is cached, so that a first run can say why it is slow.

The planner's kernels are numba functions compiled on first use (about half a minute on two
busy cores) and cached on disk (``cache=True``: next to the modules, or numba's user cache
when that is read-only). A cold run's solve is that compile; later runs take a second.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__all__ = ["SOLVER_MODULES", "solver_compiled", "solver_is_compiled_code"]

SOLVER_MODULES = (
    "perseus_planner._costs",
    "perseus_planner._kept_cut",
    "perseus_planner._kernel",
    "perseus_planner._source_side",
    "perseus_planner._warm",
)


def solver_compiled() -> bool | None:
    """True if the solver's kernels have cache indexes on disk, False if none has, None if
    that cannot be told (numba's cache layout is not public API: never an error).

    Any one will do: a solve compiles the kernels it runs together, and some kernels (other
    schedules' paths) are never compiled at all."""
    try:
        from numba.core.dispatcher import Dispatcher

        indexes: list[Path] = []
        for name in SOLVER_MODULES:
            module = importlib.import_module(name)
            for value in vars(module).values():
                if isinstance(value, Dispatcher) and value.py_func.__module__ == name:
                    cache: Any = getattr(value, "_cache")  # noqa: B009 - not in numba's stubs
                    indexes.append(Path(cache._cache_file._index_path))
    except Exception:  # any change in numba's internals means "unknown", never an error
        return None
    if not indexes:
        return None
    return any(path.is_file() for path in indexes)


def solver_is_compiled_code() -> bool:
    """Whether the solver's kernels are numba-compiled, rather than plain Python (no numba)."""
    from perseus_planner._jit import COMPILED

    return COMPILED
