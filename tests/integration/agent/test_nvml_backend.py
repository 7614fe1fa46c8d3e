"""NvmlBackend through the real nvidia-ml-py bindings and an emulated libnvidia-ml.so.1.

Each scenario runs in its own Python process (the bindings load the library once per process);
see ``tests/support/fake_nvml.py``. The fake models A100-SXM GPUs: 1410..210 MHz step 15 at the
highest memory clock (1593 MHz), power 100 + 300 (f / 1410)^3 W.
"""

from __future__ import annotations

import ctypes
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from support.fake_nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNKNOWN,
    FakeNvml,
    FakeNvmlUnavailableError,
    build_fake_nvml,
    read_state,
)

pytest.importorskip("pynvml", reason="nvidia-ml-py (the agent extra) is not installed")

A100_SM_CLOCKS_MHZ = list(range(1410, 209, -15))


def fake_power_w(sm_mhz: int) -> float:
    """The fake's power model, rounded to the mW NVML reports."""
    return round((100 + 300 * (sm_mhz / 1410) ** 3) * 1000) / 1000


@pytest.fixture(scope="session")
def fake(tmp_path_factory: pytest.TempPathFactory) -> FakeNvml:
    """The fake library, compiled once per test session."""
    try:
        return FakeNvml(build_fake_nvml(tmp_path_factory.mktemp("fake_nvml")))
    except FakeNvmlUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "nvml-state"


# Runs in the subprocess before a scenario: `call(...)` turns the outcome of a backend call
# into JSON, `out` is printed as JSON at the end.
PRELUDE = """
import json
from perseus_agent.errors import GpuError
from perseus_agent.gpu.nvml import NvmlBackend

def call(fn, *args):
    try:
        return {"value": fn(*args)}
    except GpuError as exc:
        return {"error": type(exc).__name__, "gpu_index": exc.gpu_index, "reason": exc.reason,
                "message": str(exc)}

out = {}
"""


def run_scenario(fake: FakeNvml, code: str, **config: Any) -> dict[str, Any]:
    """Run ``code`` (after PRELUDE) against the fake and return its ``out`` dict."""
    script = PRELUDE + textwrap.dedent(code) + "\nprint('OUT=' + json.dumps(out))\n"
    result = fake.run_python(script, **config)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("OUT=")]
    return dict(json.loads(line.removeprefix("OUT=")))


def test_devices_lists_every_gpu_with_uuid_and_name(fake: FakeNvml) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["devices"] = [[d.index, d.uuid, d.name] for d in b.devices()]
        """,
        gpus=3,
    )
    assert out["devices"] == [
        [i, f"GPU-fa4e0000-0000-4000-8000-{i:012d}", "NVIDIA A100-SXM4-80GB"] for i in range(3)
    ]


def test_supported_clocks_are_those_at_the_highest_memory_clock_descending_and_cached(
    fake: FakeNvml, state: Path
) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["first"] = b.supported_sm_clocks_mhz(0)
        out["second"] = b.supported_sm_clocks_mhz(0)
        out["nearest"] = b.nearest_supported_sm_clock_mhz(0, 1001)
        """,
        state=state,
    )
    # The fake returns the lists ascending and supports only up to 1305 MHz at 1215 MHz memory.
    assert out["first"] == A100_SM_CLOCKS_MHZ
    assert out["second"] == A100_SM_CLOCKS_MHZ
    assert out["nearest"] == 1005
    calls = read_state(state)
    # Two calls for the first query (size, then data); none for the cached second one.
    assert calls["calls.nvmlDeviceGetSupportedGraphicsClocks.0"] == 2
    assert calls["calls.nvmlDeviceGetSupportedMemoryClocks.0"] == 2


def test_lock_and_reset_sm_clock_skip_no_op_changes(fake: FakeNvml, state: Path) -> None:
    out = run_scenario(
        fake,
        """
        import os
        from pathlib import Path
        from support.fake_nvml import read_state
        b = NvmlBackend()
        out["lock"] = b.lock_sm_clock(0, 1200)
        out["clock_locked"] = b.sm_clock_mhz(0)
        out["lock_again"] = b.lock_sm_clock(0, 1200)
        out["relock"] = b.lock_sm_clock(0, 1005)
        out["clock_relocked"] = b.sm_clock_mhz(0)
        out["gpu1_clock"] = b.sm_clock_mhz(1)
        out["state_while_locked"] = read_state(Path(os.environ["FAKE_NVML_STATE"]))
        out["reset"] = b.reset_sm_clock(0)
        out["reset_again"] = b.reset_sm_clock(0)
        out["reset_never_locked"] = b.reset_sm_clock(1)
        out["clock_reset"] = b.sm_clock_mhz(0)
        """,
        state=state,
    )
    assert out["lock"] is True
    assert out["clock_locked"] == 1200
    assert out["lock_again"] is False
    assert out["relock"] is True
    assert out["clock_relocked"] == 1005
    assert out["gpu1_clock"] == 1410
    locked = out["state_while_locked"]
    assert (locked["gpu0.sm_locked_min_mhz"], locked["gpu0.sm_locked_max_mhz"]) == (1005, 1005)
    assert locked.get("gpu1.sm_locked_max_mhz", 0) == 0
    assert (out["reset"], out["reset_again"], out["reset_never_locked"]) == (True, False, False)
    assert out["clock_reset"] == 1410

    after = read_state(state)
    assert after["gpu0.sm_locked_max_mhz"] == 0
    # The no-op lock and the no-op resets never reached the library.
    assert after["calls.nvmlDeviceSetGpuLockedClocks.0"] == 2
    assert after["calls.nvmlDeviceResetGpuLockedClocks.0"] == 1
    assert "calls.nvmlDeviceResetGpuLockedClocks.1" not in after


def test_lock_and_reset_memory_clock(fake: FakeNvml, state: Path) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["lock"] = b.lock_memory_clock(1, 1215)
        out["lock_again"] = b.lock_memory_clock(1, 1215)
        out["unsupported"] = call(b.lock_memory_clock, 1, 1000)
        out["reset"] = b.reset_memory_clock(1)
        out["reset_again"] = b.reset_memory_clock(1)
        """,
        state=state,
    )
    assert (out["lock"], out["lock_again"]) == (True, False)
    assert out["unsupported"]["error"] == "GpuInvalidArgumentError"
    assert (out["reset"], out["reset_again"]) == (True, False)
    after = read_state(state)
    assert after["calls.nvmlDeviceSetMemoryLockedClocks.1"] == 2  # 1215 once, then 1000
    assert after["calls.nvmlDeviceResetMemoryLockedClocks.1"] == 1
    assert after["gpu1.mem_locked_max_mhz"] == 0


def test_memory_lock_is_visible_in_state(fake: FakeNvml, state: Path) -> None:
    run_scenario(fake, "NvmlBackend().lock_memory_clock(0, 1215)", state=state)
    after = read_state(state)
    assert (after["gpu0.mem_locked_min_mhz"], after["gpu0.mem_locked_max_mhz"]) == (1215, 1215)


def test_unsupported_or_invalid_clock_is_rejected(fake: FakeNvml, state: Path) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["off_grid"] = call(b.lock_sm_clock, 0, 1201)
        out["too_high"] = call(b.lock_sm_clock, 0, 2000)
        out["negative"] = call(b.lock_sm_clock, 0, -15)
        out["clock"] = b.sm_clock_mhz(0)
        """,
        state=state,
    )
    for case in ("off_grid", "too_high", "negative"):
        assert out[case]["error"] == "GpuInvalidArgumentError", case
        assert out[case]["gpu_index"] == 0
        assert out[case]["reason"] == "invalid_argument"
    assert "Invalid Argument" in out["off_grid"]["message"]
    assert out["clock"] == 1410
    # The negative clock was refused before reaching NVML (it would wrap to a huge unsigned).
    assert read_state(state)["calls.nvmlDeviceSetGpuLockedClocks.0"] == 2


def test_lock_outlives_a_killed_process_and_force_reset_clears_it(
    fake: FakeNvml, state: Path
) -> None:
    killed = fake.run_python(
        PRELUDE
        + textwrap.dedent(
            """
            import os, signal
            b = NvmlBackend()
            b.lock_sm_clock(1, 900)
            b.lock_memory_clock(1, 1215)
            os.kill(os.getpid(), signal.SIGKILL)
            """
        ),
        state=state,
    )
    assert killed.returncode == -9
    assert read_state(state)["gpu1.sm_locked_max_mhz"] == 900

    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["clock_before"] = b.sm_clock_mhz(1)
        out["reset"] = b.reset_sm_clock(1)  # this backend locked nothing
        b.force_reset_clocks(1)
        out["clock_after"] = b.sm_clock_mhz(1)
        """,
        state=state,
    )
    assert out == {"clock_before": 900, "reset": False, "clock_after": 1410}
    after = read_state(state)
    assert after["gpu1.sm_locked_max_mhz"] == 0
    assert after["gpu1.mem_locked_max_mhz"] == 0


def test_power_follows_the_sm_clock(fake: FakeNvml) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["max"] = b.power_w(0)
        b.lock_sm_clock(0, 705)
        out["locked"] = b.power_w(0)
        """,
    )
    assert out["max"] == pytest.approx(400.0)
    assert out["locked"] == pytest.approx(fake_power_w(705))


def test_energy_counter_increases_with_power_times_time(fake: FakeNvml) -> None:
    out = run_scenario(
        fake,
        """
        import time
        b = NvmlBackend()
        t0, e0 = time.monotonic(), b.energy_j(0)
        time.sleep(0.2)
        t1, e1 = time.monotonic(), b.energy_j(0)
        out.update(e0=e0, e1=e1, seconds=t1 - t0)
        """,
    )
    assert out["e0"] > 0  # the counter's origin is arbitrary, not this process's start
    assert out["e1"] > out["e0"]
    # 400 W at 1410 MHz; generous bounds for a loaded machine.
    assert (out["e1"] - out["e0"]) / out["seconds"] == pytest.approx(400.0, rel=0.15)


# Replaces the clock the backend integrates with, so the trapezoids are exact.
FAKE_MONOTONIC = """
import perseus_agent.gpu.nvml as nvml_module
class FakeTime:
    now = 100.0
    @classmethod
    def monotonic(cls):
        return cls.now
nvml_module.time = FakeTime
"""


def test_energy_is_integrated_from_power_without_a_counter(fake: FakeNvml, state: Path) -> None:
    out = run_scenario(
        fake,
        FAKE_MONOTONIC
        + """
b = NvmlBackend()
out["e0"] = b.energy_j(0)                 # t=100: 400 W
FakeTime.now = 110.0
b.lock_sm_clock(0, 210)
out["e1"] = b.energy_j(0)                 # t=110: trapezoid 400 -> P(210)
FakeTime.now = 120.0
out["p"] = b.power_w(0)                   # t=120: a power sample counts too
b.lock_sm_clock(0, 1410)
FakeTime.now = 130.0
out["e2"] = b.energy_j(0)                 # t=130: trapezoid P(210) -> 400
""",
        state=state,
        no_energy=True,
    )
    low = fake_power_w(210)
    assert out["e0"] == 0.0
    assert out["e1"] == pytest.approx((400.0 + low) / 2 * 10)
    assert out["p"] == pytest.approx(low)
    # Without the sample at t=120 this would be one trapezoid from t=110 to t=130.
    assert out["e2"] == pytest.approx((400.0 + low) / 2 * 10 + low * 10 + (low + 400.0) / 2 * 10)
    # NOT_SUPPORTED is remembered: the counter was asked once.
    assert read_state(state)["calls.nvmlDeviceGetTotalEnergyConsumption.0"] == 1


def test_energy_fallback_is_per_gpu(fake: FakeNvml) -> None:
    out = run_scenario(
        fake,
        FAKE_MONOTONIC
        + """
b = NvmlBackend()
out["gpu0"] = [b.energy_j(0)]
out["gpu1"] = [b.energy_j(1)]
FakeTime.now = 101.0
out["gpu1"].append(b.energy_j(1))
""",
        fail=[f"nvmlDeviceGetTotalEnergyConsumption:1:{NVML_ERROR_NOT_SUPPORTED}"],
    )
    assert out["gpu0"][0] > 1000.0  # the hardware counter (the fake starts at 1 MJ)
    assert out["gpu1"] == [0.0, pytest.approx(400.0)]


# (injected failure on GPU 1, call on GPU {i}, expected exception, reason, NVML message)
ERROR_CASES = [
    (
        f"nvmlDeviceSetGpuLockedClocks:1:{NVML_ERROR_NO_PERMISSION}",
        "b.lock_sm_clock({i}, 1200)",
        "GpuNoPermissionError",
        "no_permission",
        "Insufficient Permissions",
    ),
    (
        f"nvmlDeviceGetPowerUsage:1:{NVML_ERROR_GPU_IS_LOST}",
        "b.power_w({i})",
        "GpuLostError",
        "gpu_lost",
        "GPU is lost",
    ),
    (
        f"nvmlDeviceGetClockInfo:1:{NVML_ERROR_NOT_SUPPORTED}",
        "b.sm_clock_mhz({i})",
        "GpuNotSupportedError",
        "not_supported",
        "Not Supported",
    ),
    (
        f"nvmlDeviceSetMemoryLockedClocks:1:{NVML_ERROR_INVALID_ARGUMENT}",
        "b.lock_memory_clock({i}, 1593)",
        "GpuInvalidArgumentError",
        "invalid_argument",
        "Invalid Argument",
    ),
    (
        f"nvmlDeviceGetUUID:1:{NVML_ERROR_NOT_FOUND}",
        "b.devices() if {i} else b.supported_sm_clocks_mhz(0)",
        "GpuNotFoundError",
        "not_found",
        "Not Found",
    ),
    (
        f"nvmlDeviceGetSupportedGraphicsClocks:1:{NVML_ERROR_RESET_REQUIRED}",
        "b.supported_sm_clocks_mhz({i})",
        "GpuLostError",
        "gpu_lost",
        "GPU requires restart",
    ),
    (
        f"nvmlDeviceResetGpuLockedClocks:1:{NVML_ERROR_UNKNOWN}",
        "b.lock_sm_clock({i}, 1200) and b.reset_sm_clock({i})",
        "GpuLostError",
        "gpu_lost",
        "Unknown Error",
    ),
    (
        f"nvmlDeviceGetTotalEnergyConsumption:1:{NVML_ERROR_FUNCTION_NOT_FOUND}",
        # Missing from an old driver: not supported, so energy falls back to power samples.
        "b.energy_j({i}) if {i} else b.energy_j({i})",
        None,
        None,
        None,
    ),
    (
        f"nvmlDeviceGetPowerUsage:1:{NVML_ERROR_FUNCTION_NOT_FOUND}",
        "b.power_w({i})",
        "GpuNotSupportedError",
        "not_supported",
        "too old",
    ),
    (
        f"nvmlDeviceGetTotalEnergyConsumption:1:{NVML_ERROR_TIMEOUT}",
        "b.energy_j({i})",
        "GpuError",
        "gpu_error",
        "Timeout",
    ),
    (
        f"nvmlDeviceGetName:1:{NVML_ERROR_IN_USE}",
        "b.devices() if {i} else b.power_w(0)",
        "GpuError",
        "gpu_error",
        "In use by another client",  # NVML's own string (nvmlErrorString)
    ),
]


@pytest.mark.parametrize(
    ("fail", "expression", "error", "reason", "message"),
    ERROR_CASES,
    ids=[case[0] for case in ERROR_CASES],
)
def test_nvml_errors_map_to_agent_errors_for_that_gpu_only(
    fake: FakeNvml,
    fail: str,
    expression: str,
    error: str | None,
    reason: str | None,
    message: str | None,
) -> None:
    out = run_scenario(
        fake,
        f"""
        b = NvmlBackend()
        out["gpu1"] = call(lambda: {expression.format(i=1)})
        out["gpu0"] = call(lambda: {expression.format(i=0)})
        """,
        fail=[fail],
    )
    assert "error" not in out["gpu0"], out["gpu0"]
    if error is None:
        assert "error" not in out["gpu1"], out["gpu1"]
        return
    assert out["gpu1"]["error"] == error
    assert out["gpu1"]["reason"] == reason
    assert out["gpu1"]["gpu_index"] == 1
    assert message is not None
    assert message in out["gpu1"]["message"]
    assert "GPU 1" in out["gpu1"]["message"]


def test_failed_lock_on_gpu1_leaves_gpu0_locked(fake: FakeNvml, state: Path) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["gpu0"] = call(b.lock_sm_clock, 0, 1200)
        out["gpu1"] = call(b.lock_sm_clock, 1, 1200)
        out["gpu1_retry"] = call(b.lock_sm_clock, 1, 1200)
        """,
        state=state,
        fail=[f"nvmlDeviceSetGpuLockedClocks:1:{NVML_ERROR_NO_PERMISSION}"],
    )
    assert out["gpu0"] == {"value": True}
    assert out["gpu1"]["error"] == out["gpu1_retry"]["error"] == "GpuNoPermissionError"
    after = read_state(state)
    assert after["gpu0.sm_locked_max_mhz"] == 1200
    assert after.get("gpu1.sm_locked_max_mhz", 0) == 0
    # A failed lock is not recorded as held: the retry went to NVML again.
    assert after["calls.nvmlDeviceSetGpuLockedClocks.1"] == 2


def test_gpu_lost_while_running(fake: FakeNvml, state: Path) -> None:
    """A failure added to a live process's state file (as later tests do) takes effect."""
    out = run_scenario(
        fake,
        f"""
        import os
        from pathlib import Path
        from support.fake_nvml import update_state
        b = NvmlBackend()
        out["before"] = call(b.power_w, 1)
        update_state(
            Path(os.environ["FAKE_NVML_STATE"]),
            {{"fail.nvmlDeviceGetPowerUsage.1": {NVML_ERROR_GPU_IS_LOST}}},
        )
        out["after"] = call(b.power_w, 1)
        out["gpu0"] = call(b.power_w, 0)
        """,
        state=state,
    )
    assert out["before"] == {"value": pytest.approx(400.0)}
    assert out["after"]["error"] == "GpuLostError"
    assert out["gpu0"] == {"value": pytest.approx(400.0)}


def test_unknown_gpu_index_is_not_found(fake: FakeNvml) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        out["past_end"] = call(b.sm_clock_mhz, 2)
        out["negative"] = call(b.lock_sm_clock, -1, 1200)
        """,
    )
    for case in ("past_end", "negative"):
        assert out[case]["error"] == "GpuNotFoundError", out[case]
    assert out["past_end"]["gpu_index"] == 2
    assert "this node has 2" in out["past_end"]["message"]


def real_nvml_installed() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_missing_library_is_reported_with_what_to_do(fake: FakeNvml, tmp_path: Path) -> None:
    if real_nvml_installed():
        pytest.skip("a real NVML is installed: an empty LD_LIBRARY_PATH entry cannot hide it")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_scenario(fake, 'out["init"] = call(NvmlBackend)', lib_dir=empty)
    error = out["init"]
    assert error["error"] == "GpuLibraryNotFoundError"
    assert error["reason"] == "library_not_found"
    assert error["gpu_index"] is None
    for hint in ("libnvidia-ml.so.1", "driver", "container", "LD_LIBRARY_PATH"):
        assert hint in error["message"]


def test_unloadable_library_is_reported_with_the_loader_error(
    fake: FakeNvml, tmp_path: Path
) -> None:
    # A broken mount: first on the path, so it hides a real driver's library too.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "libnvidia-ml.so.1").write_bytes(b"not a shared object")
    out = run_scenario(fake, 'out["init"] = call(NvmlBackend)', lib_dir=broken)
    assert out["init"]["error"] == "GpuLibraryNotFoundError"
    assert f"{broken}/libnvidia-ml.so.1: file too short" in out["init"]["message"]
    assert "LD_LIBRARY_PATH" in out["init"]["message"]


def test_missing_bindings_are_reported(fake: FakeNvml) -> None:
    out = run_scenario(
        fake,
        """
        import sys
        sys.modules["pynvml"] = None  # import fails as if nvidia-ml-py were not installed
        out["init"] = call(NvmlBackend)
        """,
    )
    assert out["init"]["error"] == "GpuLibraryNotFoundError"
    assert "nvidia-ml-py" in out["init"]["message"]


@pytest.mark.parametrize(
    ("code", "error", "text"),
    [
        (NVML_ERROR_DRIVER_NOT_LOADED, "GpuLibraryNotFoundError", "Driver Not Loaded"),
        (NVML_ERROR_NO_PERMISSION, "GpuNoPermissionError", "Insufficient Permissions"),
    ],
)
def test_init_errors(fake: FakeNvml, code: int, error: str, text: str) -> None:
    out = run_scenario(
        fake, 'out["init"] = call(NvmlBackend)', fail=[f"nvmlInitWithFlags:*:{code}"]
    )
    assert out["init"]["error"] == error
    assert text in out["init"]["message"]


def test_close_shuts_nvml_down_once(fake: FakeNvml, state: Path) -> None:
    out = run_scenario(
        fake,
        """
        b = NvmlBackend()
        b.lock_sm_clock(0, 1200)
        b.close()
        b.close()
        out["after_close"] = call(b.sm_clock_mhz, 0)
        with NvmlBackend() as other:
            out["other"] = other.sm_clock_mhz(0)
        other.close()
        """,
        state=state,
    )
    assert out["after_close"]["error"] == "GpuError"
    assert "closed" in out["after_close"]["message"]
    assert out["other"] == 1200  # closing does not undo locks
    after = read_state(state)
    assert after["calls.nvmlInitWithFlags"] == 2
    assert after["calls.nvmlShutdown"] == 2  # one per backend, however often closed
