"""DeepSpeed and Megatron computations padded to an emulated GPU's profile (tests and demos).

As :mod:`perseus_emulation.torch_stage` does for a torch pipeline stage: each forward and
backward runs its real (CPU) computation, then waits out the profile's time of that
computation at the emulated GPU's clock now in effect (times ``time_scale``), the GPU marked
busy for that window and blocked otherwise, so the clock the agent locks changes how long the
real processes take and the energy the GPU counts.

Install the padding *before* ``perseus_client``'s ``attach``, so that the hooks enclose the
padded computation as they enclose a real GPU's kernels:

* :func:`pad_deepspeed_engine`: an instance ``_INSTRUCTION_MAP`` with ``ForwardPass`` and
  ``BackwardPass`` padded (``perseus_client.deepspeed.attach`` copies the engine's map).
* :class:`PaddedTimers`: a Megatron ``config.timers`` whose ``forward-compute`` and
  ``backward-compute`` timers pad (``perseus_client.megatron.attach`` wraps the timers it
  finds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

from perseus_agent.gpu.emulated import EmulatedBackend


class _Window:
    """One computation's busy window on the emulated GPU."""

    def __init__(
        self, gpu: EmulatedBackend, gpu_index: int, stage: int, instruction: str, scale: float
    ) -> None:
        self.gpu, self.gpu_index, self.stage, self.instruction = gpu, gpu_index, stage, instruction
        self.scale = scale
        self.start_s = 0.0

    def open(self) -> None:
        self.start_s = time.monotonic()
        self.gpu.set_activity(self.gpu_index, self.stage, self.instruction)

    def close(self) -> None:
        # The clock in effect now: the agent locked it before the hook returned.
        want_s = self.gpu.instruction_time_s(self.gpu_index, self.stage, self.instruction)
        remaining_s = want_s * self.scale - (time.monotonic() - self.start_s)
        if remaining_s > 0:
            time.sleep(remaining_s)
        self.gpu.set_activity(self.gpu_index, None, None)


def _check(gpu: EmulatedBackend, stage: int, time_scale: float) -> None:
    if not time_scale > 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    if not 0 <= stage < gpu.profile.num_stages:
        raise ValueError(
            f"the emulated GPU's profile has no stage {stage} "
            f"(stages 0..{gpu.profile.num_stages - 1})"
        )


def pad_deepspeed_engine(
    engine: Any,
    gpu: EmulatedBackend,
    gpu_index: int,
    *,
    profile_stage: int,
    time_scale: float = 1.0,
) -> None:
    """Pad ``engine``'s forwards and backwards to stage ``profile_stage`` of ``gpu``'s profile
    and mark GPU ``gpu_index`` busy while they run.

    Raises:
        ValueError: ``time_scale`` is not positive, or the profile has no such stage.
    """
    _check(gpu, profile_stage, time_scale)
    instructions: dict[type, Callable[..., Any]] = dict(engine._INSTRUCTION_MAP)

    def padded(run: Callable[..., Any], name: str) -> Callable[..., Any]:
        def pad(self: Any, *args: Any, **kwargs: Any) -> Any:
            window = _Window(gpu, gpu_index, profile_stage, name, time_scale)
            window.open()
            try:
                return run(self, *args, **kwargs)
            finally:
                window.close()

        return pad

    # By name: DeepSpeed's instruction classes (deepspeed.runtime.pipe.schedule) are the keys.
    for cls, run in list(instructions.items()):
        name = {"ForwardPass": "forward", "BackwardPass": "backward"}.get(cls.__name__)
        if name is not None:
            instructions[cls] = padded(run, name)
    vars(engine)["_INSTRUCTION_MAP"] = instructions


class _NullTimer:
    def start(self, *args: Any, **kwargs: Any) -> None:
        pass

    def stop(self, *args: Any, **kwargs: Any) -> None:
        pass


class PaddedTimers:
    """Megatron timers padding ``forward-compute`` and ``backward-compute`` to the profile.

    Args:
        inner: The timers to pass every call on to (``None``: none).
        gpu, gpu_index: The emulated GPU and its index.
        profile_stage: The profile's stage of this rank (one chunk per rank: 1F1B).
        time_scale: Times the profiled times.
    """

    _NAMES: ClassVar[dict[str, str]] = {
        "forward-compute": "forward",
        "backward-compute": "backward",
    }

    def __init__(
        self,
        inner: Any,
        gpu: EmulatedBackend,
        gpu_index: int,
        *,
        profile_stage: int,
        time_scale: float = 1.0,
    ) -> None:
        _check(gpu, profile_stage, time_scale)
        self.inner = inner
        self._windows = {
            name: _Window(gpu, gpu_index, profile_stage, kind, time_scale)
            for name, kind in self._NAMES.items()
        }

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        timer = self.inner(name, *args, **kwargs) if self.inner is not None else _NullTimer()
        window = self._windows.get(name)
        return timer if window is None else _PaddedTimer(timer, window)


class _PaddedTimer:
    def __init__(self, timer: Any, window: _Window) -> None:
        self.timer, self.window = timer, window

    def start(self, *args: Any, **kwargs: Any) -> None:
        self.window.open()
        self.timer.start(*args, **kwargs)

    def stop(self, *args: Any, **kwargs: Any) -> None:
        try:
            self.window.close()
        finally:
            self.timer.stop(*args, **kwargs)
