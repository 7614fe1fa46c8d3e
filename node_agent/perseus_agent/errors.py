"""Errors of the node agent, independent of the GPU library that raised them.

The NVML backend maps every NVML error code to one of these, so the rest of the
agent (and its metrics, by ``reason``) never sees a ``pynvml`` exception.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of every node-agent error."""


class PlanError(AgentError):
    """A plan cannot be applied as written (unknown GPU, malformed body, ...)."""


class GpuError(AgentError):
    """A GPU operation failed.

    Attributes:
        gpu_index: The GPU concerned, if any.
        reason: Short machine-readable cause, used as the ``reason`` metric label.
    """

    reason = "gpu_error"

    def __init__(self, message: str, gpu_index: int | None = None) -> None:
        super().__init__(message)
        self.gpu_index = gpu_index


class GpuLibraryNotFoundError(GpuError):
    """The GPU driver library is not installed or cannot be loaded."""

    reason = "library_not_found"


class GpuNoPermissionError(GpuError):
    """The process may not change this setting (clock control needs privileges)."""

    reason = "no_permission"


class GpuNotSupportedError(GpuError):
    """The GPU or driver does not support the operation."""

    reason = "not_supported"


class GpuLostError(GpuError):
    """The GPU fell off the bus or stopped responding."""

    reason = "gpu_lost"


class GpuInvalidArgumentError(GpuError):
    """The driver rejected an argument (e.g. an unsupported clock)."""

    reason = "invalid_argument"


class GpuNotFoundError(GpuError):
    """No GPU with that index or UUID."""

    reason = "not_found"


class GpuForeignClocksError(GpuError):
    """Another owner (an administrator's ``nvidia-smi -lgc``/``-ac``) set this GPU's clocks, and
    the agent is configured to leave them alone."""

    reason = "foreign_clocks"


class GpuForeignPowerLimitError(GpuError):
    """Another owner (an administrator's ``nvidia-smi -pl``) set this GPU's power limit, and the
    agent is configured to leave it alone."""

    reason = "foreign_power_limit"


class GpuReleasedError(GpuError):
    """The agent let go of the GPU library (a driver upgrade is in progress on the node)."""

    reason = "driver_upgrade"
