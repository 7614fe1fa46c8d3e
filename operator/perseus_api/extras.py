"""Which optional dependencies (pyproject extras of ``perseus-k8s``) each console script needs.

The base install is what every component shares (pydantic, numpy); the planner stack, the
Kubernetes clients and the NVML bindings come with extras, so that a node agent image carries
no numba and an operator image no NVML bindings. A console script started without its extra
would die with a ``ModuleNotFoundError`` traceback from somewhere deep in its start-up (the
agent imports ``prometheus_client`` only once it serves metrics): :func:`check_extra` checks
the whole extra first and says, in one line, what to install.

``tests/integration/test_packaging.py`` checks :data:`EXTRA_MODULES` against pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Collection, Mapping
from types import MappingProxyType

__all__ = ["DISTRIBUTION", "EXIT_MISSING_EXTRA", "EXTRA_MODULES", "check_extra", "missing_modules"]

DISTRIBUTION = "perseus-k8s"
EXIT_MISSING_EXTRA = 2
"""Exit status of a console script whose extra is not installed (as for a usage error)."""

EXTRA_MODULES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "planner": ("scipy", "numba"),
        "cli": ("scipy", "numba", "matplotlib"),
        "operator": ("kopf", "kubernetes", "prometheus_client", "scipy", "numba"),
        "agent": ("pynvml", "prometheus_client", "kubernetes", "grpc"),
    }
)
"""Extra -> the top-level modules its distributions provide (``pynvml`` is ``nvidia-ml-py``,
``grpc`` is ``grpcio``)."""


def missing_modules(extra: str, optional: Collection[str] = ()) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (found without importing them),
    those in ``optional`` (the program runs without them) left out."""
    return [
        name
        for name in EXTRA_MODULES[extra]
        if name not in optional and importlib.util.find_spec(name) is None
    ]


def check_extra(program: str, extra: str, optional: Collection[str] = ()) -> int | None:
    """``None`` when ``extra`` is installed (but for the modules in ``optional``); else one line
    on stderr and the exit status to end ``program`` with (:data:`EXIT_MISSING_EXTRA`)."""
    missing = missing_modules(extra, optional)
    if not missing:
        return None
    print(
        f"{program}: error: Python {'module' if len(missing) == 1 else 'modules'} "
        f"{', '.join(missing)} not installed: "
        f"install {DISTRIBUTION}[{extra}] (pip install '{DISTRIBUTION}[{extra}]')",
        file=sys.stderr,
    )
    return EXIT_MISSING_EXTRA
