"""GPU backends: one interface, an NVML implementation and a profile-driven emulation."""

from perseus_agent.gpu.base import GpuBackend, GpuInfo

__all__ = ["GpuBackend", "GpuInfo"]
