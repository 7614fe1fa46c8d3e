"""perseus_agent.emulated_torch: a stage's computations marked busy on the emulated GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from agent_process import PROFILE
from perseus_agent.emulated_torch import emulate_stage
from perseus_agent.gpu.emulated import EmulatedBackend


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
