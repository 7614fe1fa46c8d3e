"""Clocks the agent did not set, through the real nvidia-ml-py bindings and the emulated
``libnvidia-ml.so.1`` (``tests/support/fake_nvml.py``): clock event reasons (and the older
function name of old drivers), application clocks, and an administrator's
``nvidia-smi -lgc``/``-ac`` made in another process that the agent's guard leaves, or overrides
and puts back."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from support.fake_nvml import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    FakeNvml,
    FakeNvmlUnavailableError,
    build_fake_nvml,
    read_state,
    update_state,
)

pytest.importorskip("pynvml", reason="nvidia-ml-py (the agent extra) is not installed")

POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
APPLICATIONS = 0x2


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> FakeNvml:
    try:
        return FakeNvml(build_fake_nvml(tmp_path_factory.mktemp("fake_nvml")))
    except FakeNvmlUnavailableError as exc:
        pytest.skip(str(exc))


def run(fake: FakeNvml, code: str, **config: Any) -> dict[str, Any]:
    script = (
        "import json\n"
        "from perseus_agent.gpu.nvml import NvmlBackend\n"
        "from perseus_agent.clocks.clock_owners import ClockOwnerGuard, ForeignClockPolicy\n"
        "from perseus_agent.errors import GpuError\n"
        "out = {}\n" + textwrap.dedent(code) + "\nprint('OUT=' + json.dumps(out))\n"
    )
    result = fake.run_python(script, **config)
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("OUT=")]
    return dict(json.loads(line.removeprefix("OUT=")))


def test_clock_event_reasons_and_application_clocks_come_from_nvml(
    fake: FakeNvml, tmp_path: Path
) -> None:
    state = tmp_path / "nvml"
    update_state(state, {"gpu1.event_reasons": POWER_CAP | HW_SLOWDOWN})
    code = """
        b = NvmlBackend()
        out["reasons"] = [b.clock_event_reasons(i) for i in range(2)]
        b.lock_sm_clock(0, 1200)
        out["locked"] = b.clock_event_reasons(0)
        out["applications"] = b.application_sm_clocks_mhz(0)
    """
    out = run(fake, code, state=state)
    assert out["reasons"] == [0, POWER_CAP | HW_SLOWDOWN]
    assert out["locked"] == APPLICATIONS  # NVML reports a lock as user-defined clocks
    assert out["applications"] == [1410, 1410]
    # Drivers before r535 have the older name only: the same bits through it.
    old = run(fake, code, state=tmp_path / "old", fail=[
        f"nvmlDeviceGetCurrentClocksEventReasons:*:{NVML_ERROR_FUNCTION_NOT_FOUND}"
    ])  # fmt: skip
    assert old["locked"] == APPLICATIONS
    assert read_state(tmp_path / "old")["calls.nvmlDeviceGetCurrentClocksThrottleReasons.0"] >= 1


def test_an_administrators_clocks_set_in_another_process_are_left_alone(
    fake: FakeNvml, tmp_path: Path
) -> None:
    state = tmp_path / "nvml"
    # The administrator: nvidia-smi -lgc 1110,1110 -i 1 and nvidia-smi -ac 1593,1200 -i 2.
    run(
        fake,
        """
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlDeviceSetGpuLockedClocks(pynvml.nvmlDeviceGetHandleByIndex(1), 1110, 1110)
        pynvml.nvmlDeviceSetApplicationsClocks(pynvml.nvmlDeviceGetHandleByIndex(2), 1593, 1200)
        pynvml.nvmlShutdown()
        """,
        gpus=3,
        state=state,
    )
    out = run(
        fake,
        """
        b = ClockOwnerGuard(NvmlBackend())
        found = b.survey(b.devices())
        out["found"] = {i: [c.kind, c.sm_clock_mhz, c.application_clock_mhz]
                        for i, c in found.items()}
        out["refused"] = []
        for i in range(3):
            try:
                b.lock_sm_clock(i, 900)
            except GpuError as exc:
                out["refused"].append([i, exc.reason])
        out["reset"] = [b.reset_sm_clock(i) for i in range(3)]
        b.close()
        """,
        gpus=3,
        state=state,
    )
    assert out["found"] == {"1": ["locked", 1110, None], "2": ["applications", 1200, 1200]}
    assert out["refused"] == [[1, "foreign_clocks"], [2, "foreign_clocks"]]
    assert out["reset"] == [True, False, False]
    nvml = read_state(state)
    assert (nvml["gpu0.sm_locked_max_mhz"], nvml["gpu1.sm_locked_max_mhz"]) == (0, 1110)
    assert nvml["gpu2.app_sm_mhz"] == 1200
    assert nvml.get("calls.nvmlDeviceResetGpuLockedClocks.1", 0) == 0  # never touched


def test_override_puts_an_administrators_lock_back(fake: FakeNvml, tmp_path: Path) -> None:
    state = tmp_path / "nvml"
    update_state(state, {"gpu1.sm_locked_min_mhz": 1110, "gpu1.sm_locked_max_mhz": 1110})
    out = run(
        fake,
        """
        b = ClockOwnerGuard(NvmlBackend(), ForeignClockPolicy.OVERRIDE)
        b.survey(b.devices())
        b.lock_sm_clock(1, 900)
        out["during"] = b.sm_clock_mhz(1)
        out["reset"] = b.reset_sm_clock(1)
        b.close()
        """,
        state=state,
    )
    assert (out["during"], out["reset"]) == (900, True)
    assert read_state(state)["gpu1.sm_locked_max_mhz"] == 1110
