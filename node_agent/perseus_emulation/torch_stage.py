"""A real torch pipeline stage computing on an emulated GPU, for tests and demos without GPUs.

The stage's real computation runs on the CPU, much faster than the profiled GPU's; so that
the SM clock the agent locks matters to the real process, each ``forward_one_chunk`` and
``backward_one_chunk`` is padded to the profile's time of that computation at the emulated
GPU's clock now in effect (times its slowdown, times ``time_scale``), and the emulated GPU is
marked busy with it for exactly that window, blocked otherwise. A zero-bubble schedule's
halves (``backward_one_chunk(full_backward=False)`` and ``backward_weight_one_chunk``) are
padded to the profile's ``backward_input`` and ``backward_weight`` when it has them (with
whole backwards only, the input half is padded as the whole and the weight half not at all).

Energy stays honest in the sense the emulation can be: the emulated GPU's counter integrates
the profile's power at the locked clock over the time the stage was really busy (the padded
window, or longer when the CPU computation or a loaded machine overran it: then it counts
the longer time, at that power), and blocking power over every other moment, waits on other
stages and on the gradient sync included. Nothing is credited for time not spent: a
computation that ends early still waits out its profiled time as busy.

Wrap the stage *before* ``perseus_client.torch.attach``, so that the hooks enclose the
padded computation, as they enclose a real GPU's kernels (after the device synchronization).
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

from perseus_agent.gpu.emulated import EmulatedBackend


def emulate_stage(
    stage: Any,
    gpu: EmulatedBackend,
    gpu_index: int,
    *,
    profile_stage: int | None = None,
    time_scale: float = 1.0,
) -> None:
    """Pad ``stage``'s computations to ``gpu``'s profile (stage ``profile_stage``, default
    the stage's index) and mark GPU ``gpu_index`` busy while they run.

    Raises:
        ValueError: ``time_scale`` is not positive, or the profile has no such stage.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    profile_stage = int(stage.stage_index) if profile_stage is None else profile_stage
    if not 0 <= profile_stage < gpu.profile.num_stages:
        raise ValueError(
            f"the emulated GPU's profile has no stage {profile_stage} "
            f"(stages 0..{gpu.profile.num_stages - 1})"
        )
    stage.forward_one_chunk = _padded(
        stage.forward_one_chunk, gpu, gpu_index, profile_stage, "forward", time_scale
    )
    backward = stage.backward_one_chunk
    measured = gpu.profile.measurements
    whole_name = "backward" if (profile_stage, "backward") in measured else "backward_input"
    whole = _padded(backward, gpu, gpu_index, profile_stage, whole_name, time_scale)
    if (profile_stage, "backward_input") not in measured:
        stage.backward_one_chunk = whole
        return
    half = _padded(backward, gpu, gpu_index, profile_stage, "backward_input", time_scale)
    signature = inspect.signature(backward)

    @functools.wraps(backward)  # the hooks read its arguments (full_backward, last_backward)
    def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        full = signature.bind(*args, **kwargs).arguments.get("full_backward", True)
        return (whole if full else half)(*args, **kwargs)

    stage.backward_one_chunk = backward_one_chunk
    weight = getattr(stage, "backward_weight_one_chunk", None)
    if weight is not None:
        stage.backward_weight_one_chunk = _padded(
            weight, gpu, gpu_index, profile_stage, "backward_weight", time_scale
        )


def _padded(
    compute: Any,
    gpu: EmulatedBackend,
    gpu_index: int,
    profile_stage: int,
    instruction: str,
    time_scale: float,
) -> Any:
    @functools.wraps(compute)  # the hooks read its arguments (full_backward, last_backward)
    def padded(*args: Any, **kwargs: Any) -> Any:
        start_s = time.monotonic()
        gpu.set_activity(gpu_index, profile_stage, instruction)
        try:
            return compute(*args, **kwargs)
        finally:
            # The clock in effect now: the agent locked it before the hook returned.
            want_s = gpu.instruction_time_s(gpu_index, profile_stage, instruction) * time_scale
            remaining_s = want_s - (time.monotonic() - start_s)
            if remaining_s > 0:
                time.sleep(remaining_s)
            gpu.set_activity(gpu_index, None, None)

    return padded
