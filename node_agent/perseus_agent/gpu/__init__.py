"""GPU backends: one interface, an NVML implementation and a profile-driven emulation.

The emulation: ``emulated`` (the backend, owning the GPUs' state), ``emulated_profile`` (their
time and power per SM clock, from a profile), ``emulated_meter`` (the clock, power and energy
read from a GPU's state, under a power limit too) and ``emulated_state`` (that state shared
across processes through a file).
"""

from perseus_agent.gpu.base import GpuBackend, GpuInfo

__all__ = ["GpuBackend", "GpuInfo"]
