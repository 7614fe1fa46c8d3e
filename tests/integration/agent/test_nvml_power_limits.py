"""NvmlBackend's power limits through the real nvidia-ml-py bindings and the emulated
libnvidia-ml.so.1 (NVML's milliwatts on the wire, watts in the agent), and the agent's record
and recovery of them: a limit set by an agent that is then SIGKILLed is put back by the next
start, and an administrator's limit found at start is respected.

The fake's GPUs accept 100..400 W, default 400 W; under a lower limit the SM clock falls to the
highest 15 MHz step whose power (100 + 300 (f / 1410)^3 W) fits it, as the firmware's power
capping does.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from test_nvml_backend import PRELUDE, run_scenario

from support.fake_nvml import (
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    FakeNvml,
    FakeNvmlUnavailableError,
    build_fake_nvml,
    read_state,
    update_state,
)

pytest.importorskip("pynvml", reason="nvidia-ml-py (the agent extra) is not installed")


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> FakeNvml:
    try:
        return FakeNvml(build_fake_nvml(tmp_path_factory.mktemp("fake_nvml")))
    except FakeNvmlUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "nvml-state"


def capped_clock_mhz(limit_w: float) -> int:
    clock = 1410
    while clock > 210 and 100 + 300 * (clock / 1410) ** 3 > limit_w:
        clock -= 15
    return clock


def test_read_set_and_reset_in_watts_skipping_no_op_changes(fake: FakeNvml, state: Path) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        r = b.power_limit_range_w(1)
        out["range"] = [r.min_w, r.max_w, r.default_w]
        out["before"] = b.power_limit_w(1)
        out["set"] = b.set_power_limit(1, 287.5)
        out["again"] = b.set_power_limit(1, 287.5)
        out["after"] = b.power_limit_w(1)
        out["other"] = b.power_limit_w(0)
        out["clock"] = b.sm_clock_mhz(1)
        out["power"] = b.power_w(1)
        out["capped"] = b.clock_event_reasons(1) & 0x4
        out["reset"] = b.reset_power_limit(1)
        out["reset_again"] = b.reset_power_limit(1)
        out["restored"] = b.power_limit_w(1)
        out["clock_restored"] = b.sm_clock_mhz(1)
        """,
        state=state,
    )
    assert out["range"] == [100.0, 400.0, 400.0]
    assert out["before"] == 400.0 and out["other"] == 400.0
    assert (out["set"], out["again"], out["after"]) == (True, False, 287.5)
    assert out["clock"] == capped_clock_mhz(287.5) < 1410
    assert out["power"] <= 287.5 and out["capped"] == 0x4
    assert (out["reset"], out["reset_again"]) == (True, False)
    assert (out["restored"], out["clock_restored"]) == (400.0, 1410)
    calls = read_state(state)
    # The no-op set and reset never reached NVML's setter.
    assert calls["calls.nvmlDeviceSetPowerManagementLimit.1"] == 2
    assert calls["calls.nvmlDeviceGetPowerManagementLimitConstraints.1"] == 1  # cached


def test_a_limit_outside_the_constraints_is_refused_with_the_range(fake: FakeNvml) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["low"] = call(b.set_power_limit, 0, 99.0)
        out["high"] = call(b.set_power_limit, 0, 400.5)
        out["nan"] = call(b.set_power_limit, 0, float("nan"))
        out["limit"] = b.power_limit_w(0)
        """,
    )
    for key in ("low", "high", "nan"):
        assert out[key]["error"] == "GpuInvalidArgumentError", out[key]
        assert "outside what the GPU accepts (100..400 W)" in out[key]["message"]
    assert out["limit"] == 400.0


def test_nvml_errors_of_the_power_limit_calls_are_the_agents(fake: FakeNvml) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["denied"] = call(b.set_power_limit, 1, 250.0)
        out["unsupported"] = call(b.power_limit_w, 0)
        out["fine"] = call(b.set_power_limit, 0, 250.0)
        """,
        fail=[
            f"nvmlDeviceSetPowerManagementLimit:1:{NVML_ERROR_NO_PERMISSION}",
            f"nvmlDeviceGetPowerManagementLimit:0:{NVML_ERROR_NOT_SUPPORTED}",
        ],
    )
    assert out["denied"]["error"] == "GpuNoPermissionError"
    assert "power limits needs root" in out["denied"]["message"]
    assert out["unsupported"]["error"] == "GpuNotSupportedError"
    # GPU 0 cannot say its limit, so its setter cannot tell a no-op: it fails, never guesses.
    assert out["fine"]["error"] == "GpuNotSupportedError"


AGENT_PRELUDE = """
import os, signal
from pathlib import Path
from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.clocks.clock_owners import ClockOwnerGuard, ForeignClockPolicy
from perseus_agent.control.gpu_power_limits import GpuPowerLimits
from perseus_agent.control.plan_state import GpuState
from perseus_agent.exporter import AgentMetrics
from perseus_api.node_plan import GpuAssignment
from perseus_api.plan import Granularity, PipelinePlan
from support.factories import pipeline_plan_fields
STAGE = PipelinePlan.model_validate(pipeline_plan_fields(1, 1)).stages[0]
"""


def run_agent_code(fake: FakeNvml, state: Path, code: str) -> dict[str, object]:
    script = PRELUDE + AGENT_PRELUDE + textwrap.dedent(code) + "\nprint('OUT=' + json.dumps(out))\n"
    result = fake.run_python(script, state=state)
    if result.returncode == -9:
        return {"killed": True}
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("OUT=")]
    return dict(json.loads(line.removeprefix("OUT=")))


def test_a_killed_agents_limit_is_restored_by_the_next_start_and_admin_limits_are_kept(
    fake: FakeNvml, state: Path, tmp_path: Path
) -> None:
    state_dir = tmp_path / "agent-state"
    # An administrator's limit on GPU 1 (nvidia-smi -pl 300), before any agent ran.
    update_state(state, {"gpu1.power_limit_mw": 300000})
    killed = run_agent_code(
        fake,
        state,
        f"""
        b = NvmlBackend()
        reset = ResetState({str(state_dir)!r})
        guard = ClockOwnerGuard(b)
        reset.recover(b)
        guard.survey(b.devices())
        devices = b.devices()
        limits = GpuPowerLimits(guard, reset, AgentMetrics("n"), devices)
        a = GpuAssignment(gpu_index=0, plan="p", stage=0)
        gpus = [GpuState(d, a.model_copy(update={{"gpu_index": d.index}}),
                         STAGE, Granularity.STAGE) for d in devices]
        for g in gpus:
            limits.apply(g, 250.0)
        out["limits"] = [b.power_limit_w(i) for i in range(2)]
        out["messages"] = [g.power_limit_message for g in gpus]
        print("OUT=" + json.dumps(out), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    assert killed == {"killed": True}
    after_kill = read_state(state)
    assert after_kill["gpu0.power_limit_mw"] == 250000  # left set by the dead agent
    assert after_kill["gpu1.power_limit_mw"] == 300000  # the administrator's, untouched
    record = json.loads((state_dir / "reset-state.json").read_text())
    assert [(g["index"], g["locked"], g["power_limit_w"]) for g in record["gpus"]] == [
        (0, ["power_limit"], 400.0)
    ]

    restarted = run_agent_code(
        fake,
        state,
        f"""
        b = NvmlBackend()
        reset = ResetState({str(state_dir)!r})
        result = reset.recover(b)
        guard = ClockOwnerGuard(b)
        guard.survey(b.devices())
        out["reset"] = [g.index for g in result.reset]
        out["limits"] = [b.power_limit_w(i) for i in range(2)]
        out["foreign"] = {{i: f.limit_w for i, f in guard.foreign_power_limits().items()}}
        out["record"] = [e.index for e in reset.entries()]
        out["locked_clock"] = b.sm_clock_mhz(0)
        """,
    )
    assert restarted == {
        "reset": [0],
        "limits": [400.0, 300.0],
        "foreign": {"1": 300.0},
        "record": [],
        "locked_clock": 1410,
    }
    # Only the power limit was recorded: recovery did not reset GPU 0's clocks.
    assert read_state(state).get("calls.nvmlDeviceResetGpuLockedClocks.0", 0) == 0


def test_the_foreign_limit_is_reported_on_the_gpu_and_never_overwritten(
    fake: FakeNvml, state: Path, tmp_path: Path
) -> None:
    update_state(state, {"gpu1.power_limit_mw": 300000})
    out = run_agent_code(
        fake,
        state,
        f"""
        b = NvmlBackend()
        reset = ResetState({str(tmp_path / "s")!r})
        guard = ClockOwnerGuard(b)
        guard.survey(b.devices())
        metrics = AgentMetrics("n")
        limits = GpuPowerLimits(guard, reset, metrics, b.devices())
        d = b.devices()[1]
        g = GpuState(d, GpuAssignment(gpu_index=1, plan="p", stage=0),
                     STAGE, Granularity.STAGE)
        limits.apply(g, 250.0)
        out["limit"] = b.power_limit_w(1)
        out["applied"] = g.power_limit_w
        out["message"] = g.power_limit_message
        out["recorded"] = [e.index for e in reset.entries()]
        out["restored"] = limits.restore(1)
        out["after_restore"] = b.power_limit_w(1)
        """,
    )
    assert out["limit"] == 300.0 and out["after_restore"] == 300.0
    assert out["applied"] is None
    assert str(out["message"]).startswith("foreign_power_limit: GPU 1: its power limit is 300 W")
    assert "--foreign-clocks=override" in str(out["message"])
    # Recorded before the set was refused (record first, then set), and forgotten again without
    # a write: the limit in force is the one recorded.
    assert out["recorded"] == []
    assert read_state(state).get("calls.nvmlDeviceSetPowerManagementLimit.1", 0) == 0
