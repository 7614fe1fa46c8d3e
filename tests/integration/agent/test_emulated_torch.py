"""perseus_emulation.torch_stage: a stage's computations marked busy on the emulated GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_emulation.torch_stage import emulate_stage
from support.agent_process import PROFILE


def gpus() -> EmulatedBackend:
    return EmulatedBackend.from_csv(2, PROFILE, blocking_power_w=83.64)


def stage(gpu: EmulatedBackend, index: int = 1) -> Any:
    """A stand-in stage whose computations report what the GPU runs meanwhile."""
    return SimpleNamespace(
        stage_index=index,
        forward_one_chunk=lambda mb, *a, **k: ("forward", mb, gpu.activity(1)),
        backward_one_chunk=lambda mb, **k: ("backward", mb, gpu.activity(1)),
    )


def test_the_gpu_runs_the_stages_computation_while_it_computes_and_blocks_after() -> None:
    gpu = gpus()
    s = stage(gpu)
    emulate_stage(s, gpu, 1, time_scale=1e-6)
    name, mb, activity = s.forward_one_chunk(3, "x")
    assert (name, mb, tuple(activity)) == ("forward", 3, (1, "forward"))
    name, mb, activity = s.backward_one_chunk(2, loss=None)
    assert (name, mb, tuple(activity)) == ("backward", 2, (1, "backward"))
    assert gpu.activity(1) is None
    assert gpu.activity(0) is None  # another rank's GPU is untouched


def test_a_profile_stage_can_be_named() -> None:
    gpu = gpus()
    s = stage(gpu, index=0)
    emulate_stage(s, gpu, 1, profile_stage=5, time_scale=1e-6)
    assert tuple(s.forward_one_chunk(0)[2]) == (5, "forward")


def test_bad_arguments_are_refused() -> None:
    gpu = gpus()
    with pytest.raises(ValueError, match="no stage 8"):
        emulate_stage(stage(gpu, index=8), gpu, 1)
    with pytest.raises(ValueError, match="time_scale must be positive"):
        emulate_stage(stage(gpu), gpu, 1, time_scale=0)


def test_a_zero_bubble_stages_halves_run_as_the_profiles_halves() -> None:
    from perseus_api.profile import load_profile
    from perseus_planner.model_stages import split_backward

    truth = split_backward(load_profile(PROFILE))
    gpu = EmulatedBackend(2, truth, blocking_power_w=83.64)

    def backward_one_chunk(
        mb: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> Any:
        return ("backward", mb, gpu.activity(1))

    s = SimpleNamespace(
        stage_index=1,
        forward_one_chunk=lambda mb, *a, **k: ("forward", mb, gpu.activity(1)),
        backward_one_chunk=backward_one_chunk,
        backward_weight_one_chunk=lambda mb, **k: ("weight", mb, gpu.activity(1)),
    )
    emulate_stage(s, gpu, 1, time_scale=1e-6)
    assert tuple(s.backward_one_chunk(0, None, False)[2]) == (1, "backward_input")
    # A profile of halves only: a whole backward runs as its input half (the closest row).
    assert tuple(s.backward_one_chunk(0, full_backward=True)[2]) == (1, "backward_input")
    assert tuple(s.backward_weight_one_chunk(0, last_backward=True)[2]) == (1, "backward_weight")
    assert gpu.activity(1) is None
