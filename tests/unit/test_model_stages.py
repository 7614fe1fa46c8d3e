"""Profiles for virtual stages and split backwards: parsing, the demo derivations, checks."""

from __future__ import annotations

import re

import numpy as np
import pytest

from perseus_api.errors import ProfileError
from perseus_api.profile import INSTRUCTIONS, Profile, parse_profile
from perseus_planner.model_stages import (
    derive_profile,
    schedule_profile,
    split_backward,
    split_virtual_stages,
)

HEADER = "stage,instruction,frequency,time,energy"


def _csv(stages: int, instructions: tuple[str, ...]) -> str:
    rows = [HEADER]
    for s in range(stages):
        for k, name in enumerate(instructions):
            for f, scale in ((1410, 1.0), (1200, 1.2)):
                rows.append(f"{s},{name},{f},{0.01 * (s + 1) * (k + 1) * scale},{5.0 * (k + 1)}")
    return "\n".join(rows) + "\n"


def test_instruction_names_keep_their_indices() -> None:
    # The emulated GPU state file stores instructions by index: names are only appended.
    assert INSTRUCTIONS[:2] == ("forward", "backward")
    assert INSTRUCTIONS[2:] == ("backward_input", "backward_weight")


def test_split_backward_profile_parses() -> None:
    profile = parse_profile(_csv(2, ("forward", "backward_input", "backward_weight")), "zb")
    assert set(profile.measurements) == {
        (s, i) for s in range(2) for i in ("forward", "backward_input", "backward_weight")
    }


@pytest.mark.parametrize(
    ("instructions", "message"),
    [
        (("forward", "backward_input"), "stage 0 has backward_input rows but no backward_weight"),
        (("forward", "backward_weight"), "stage 0 has backward_weight rows but no backward_input"),
        (("forward",), "stage 0 has no backward rows (give backward, or backward_input and"),
        (("backward",), "stage 0 has no forward rows"),
    ],
)
def test_incomplete_stages_are_refused(instructions: tuple[str, ...], message: str) -> None:
    with pytest.raises(ProfileError, match=re.escape(message)):
        parse_profile(_csv(1, instructions), "bad")


def test_split_virtual_stages_layout() -> None:
    per_gpu = parse_profile(_csv(3, ("forward", "backward")), "gpu")
    split = split_virtual_stages(per_gpu, 2)
    assert split.num_stages == 6
    for v in range(2):
        for p in range(3):
            for name in ("forward", "backward"):
                whole, chunk = per_gpu.get(p, name), split.get(v * 3 + p, name)
                assert chunk.frequencies_mhz.tolist() == whole.frequencies_mhz.tolist()
                assert np.allclose(chunk.times_s * 2, whole.times_s)
                assert np.allclose(chunk.energies_j * 2, whole.energies_j)


def test_split_backward_shares_time_and_energy() -> None:
    per_gpu = parse_profile(_csv(2, ("forward", "backward")), "gpu")
    split = split_backward(per_gpu, 0.25)
    for s in range(2):
        whole = per_gpu.get(s, "backward")
        b, w = split.get(s, "backward_input"), split.get(s, "backward_weight")
        assert np.allclose(b.times_s + w.times_s, whole.times_s)
        assert np.allclose(b.energies_j, 0.25 * whole.energies_j)
        assert split.get(s, "forward") is per_gpu.get(s, "forward")
        assert (s, "backward") not in split.measurements
    assert derive_profile(per_gpu, "1f1b") is per_gpu
    assert derive_profile(per_gpu, "zb-h1").get(0, "backward_input").times_s[0] == pytest.approx(
        0.5 * per_gpu.get(0, "backward").times_s[0]
    )


@pytest.mark.parametrize("fraction", [0.0, 1.0, float("nan")])
def test_split_backward_needs_a_fraction_inside(fraction: float) -> None:
    per_gpu = parse_profile(_csv(1, ("forward", "backward")), "gpu")
    with pytest.raises(ProfileError, match="fraction must be in"):
        split_backward(per_gpu, fraction)


def test_schedule_profile_keeps_what_the_schedule_runs() -> None:
    both = parse_profile(
        _csv(2, ("forward", "backward", "backward_input", "backward_weight")), "both"
    )
    assert set(schedule_profile(both, "zb-h1", 2, 4).measurements) == {
        (s, i) for s in range(2) for i in ("forward", "backward_input", "backward_weight")
    }
    assert set(schedule_profile(both, "gpipe", 2, 4).measurements) == {
        (s, i) for s in range(2) for i in ("forward", "backward")
    }
    with pytest.raises(
        ProfileError, match=re.escape("needs 4 (virtual stage v*2+p runs on GPU p)")
    ):
        schedule_profile(both, "interleaved-1f1b", 2, 4, 2)
    assert isinstance(schedule_profile(both, "interleaved-1f1b", 1, 4, 2), Profile)
