"""The reset record's power limits: the limit in force before the agent first set one is
recorded, and a restarted agent puts it back (the GPU's default when the record is unreadable),
touching the clocks of a GPU only when they were recorded too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perseus_agent.clocks.reset_state import STATE_FILENAME, ResetState
from perseus_agent.errors import GpuLostError
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_api.profile import Profile, load_profile
from support.agent_process import PROFILE


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE)


def gpus_on(path: Path, profile: Profile) -> EmulatedBackend:
    """Emulated GPUs whose state outlives the backend, as the hardware outlives an agent."""
    return EmulatedBackend(3, profile, blocking_power_w=83.64, state_file=path / "gpus")


def test_a_killed_agents_limits_are_put_back_and_only_recorded_clocks_reset(
    tmp_path: Path, profile: Profile
) -> None:
    before = gpus_on(tmp_path, profile)
    default_w = before.power_limit_range_w(0).default_w
    before.set_power_limit(1, 320.0)  # an administrator's, before the agent ran
    before.lock_sm_clock(2, 1005)  # an administrator's lock: not the agent's
    record = ResetState(tmp_path / "state")
    record.record(before.devices()[0], "sm")
    record.record(before.devices()[0], "power_limit", original_power_limit_w=default_w)
    record.record(before.devices()[1], "power_limit", original_power_limit_w=320.0)
    record.record(before.devices()[1], "power_limit", original_power_limit_w=250.0)  # kept
    before.lock_sm_clock(0, 1200)
    before.set_power_limit(0, 250.0)
    before.set_power_limit(1, 250.0)
    on_disk = json.loads((tmp_path / "state" / STATE_FILENAME).read_text())
    assert [(g["index"], g["locked"], g["power_limit_w"]) for g in on_disk["gpus"]] == [
        (0, ["sm", "power_limit"], default_w),
        (1, ["power_limit"], 320.0),
    ]
    before.close()  # the agent is gone; the GPUs keep what it set

    after = gpus_on(tmp_path, profile)
    result = ResetState(tmp_path / "state").recover(after)

    assert [g.index for g in result.reset] == [0, 1] and not result.failed
    assert [after.power_limit_w(i) for i in range(3)] == [default_w, 320.0, default_w]
    assert [after.locked_sm_clock_mhz(i) for i in range(3)] == [None, None, 1005]


def test_an_unreadable_record_resets_every_limit_to_its_default(
    tmp_path: Path, profile: Profile
) -> None:
    gpus = gpus_on(tmp_path, profile)
    gpus.set_power_limit(2, 200.0)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / STATE_FILENAME).write_text("{not json")

    result = ResetState(tmp_path / "state").recover(gpus)

    assert result.corrupt
    default_w = gpus.power_limit_range_w(0).default_w
    assert [gpus.power_limit_w(i) for i in range(3)] == [default_w] * 3


def test_a_limit_that_cannot_be_restored_stays_recorded_for_the_next_start(
    tmp_path: Path, profile: Profile
) -> None:
    gpus = gpus_on(tmp_path, profile)
    record = ResetState(tmp_path / "state")
    record.record(gpus.devices()[0], "power_limit", original_power_limit_w=400.0)
    gpus.set_power_limit(0, 250.0)
    gpus.inject_fault(0, GpuLostError("GPU 0 fell off the bus", gpu_index=0))

    result = ResetState(tmp_path / "state").recover(gpus)

    assert [uuid for uuid, _ in result.failed] == [gpus.devices()[0].uuid]
    kept = ResetState(tmp_path / "state")
    gpus.inject_fault(0, None)
    assert [g.index for g in kept.recover(gpus).reset] == [0]
    assert gpus.power_limit_w(0) == 400.0


def test_forgetting_the_limit_keeps_the_clock_entry(tmp_path: Path, profile: Profile) -> None:
    gpus = gpus_on(tmp_path, profile)
    record = ResetState(tmp_path / "state")
    gpu = gpus.devices()[0]
    record.record(gpu, "sm")
    record.record(gpu, "power_limit", original_power_limit_w=400.0)
    assert record.original_power_limit_w(gpu) == 400.0
    record.forget(gpu, "power_limit")
    assert [(e.locked, e.power_limit_w) for e in record.entries()] == [(("sm",), None)]
    assert record.original_power_limit_w(gpu) is None
