"""The emulated GPU backend: identity, clocks, power and energy from a real profile, the
state file shared across instances and processes, and fault injection."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from perseus_agent.errors import (
    GpuError,
    GpuInvalidArgumentError,
    GpuLostError,
    GpuNoPermissionError,
    GpuNotFoundError,
)
from perseus_agent.gpu.base import GpuBackend
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.gpu.emulated_state import SharedGpuStates
from perseus_api.profile import INSTRUCTIONS, Profile, load_profile, parse_profile

REPO_ROOT = Path(__file__).resolve().parents[3]
A100_PROFILE = (
    REPO_ROOT / "operator" / "perseus_planner" / "profiles" / "gpt3-175b+a100_sxm_bf16.csv"
)
A100_BLOCKING_W = 83.64

# Rows of the A100 GPT-3 profile, copied from the CSV so that the expectations below do not
# depend on the code under test reading it right: (time in s, energy in J).
FWD0_1410 = (0.05016166687011708, 23.80547200000007)
FWD0_1005 = (0.06648568916320799, 17.781311999999918)
BWD0_1005 = (0.12091542816162108, 33.115015999999834)
BWD3_855 = (0.14056828689575185, 33.64191999999993)


def power(row: tuple[float, float]) -> float:
    return row[1] / row[0]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def a100() -> Profile:
    return load_profile(A100_PROFILE)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(
    profile: Profile,
    clock: FakeClock,
    num_gpus: int = 2,
    state_file: Path | None = None,
    node_name: str = "node-a",
) -> EmulatedBackend:
    return EmulatedBackend(
        num_gpus,
        profile,
        blocking_power_w=A100_BLOCKING_W,
        node_name=node_name,
        state_file=state_file,
        clock=clock,
    )


def test_is_a_gpu_backend_with_stable_identities(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock, num_gpus=3)
    assert isinstance(backend, GpuBackend)
    devices = backend.devices()
    assert [d.index for d in devices] == [0, 1, 2]
    assert [d.uuid for d in devices] == ["GPU-emu-node-a-0", "GPU-emu-node-a-1", "GPU-emu-node-a-2"]
    assert all(d.name == "Emulated A100-SXM (gpt3-175b+a100_sxm_bf16)" for d in devices)
    # Stable: another backend for the same node names the GPUs the same way.
    assert make(a100, clock, num_gpus=3).devices() == devices
    assert make(a100, clock, num_gpus=1, node_name="node-b").devices()[0].uuid == (
        "GPU-emu-node-b-0"
    )


def test_supported_clocks_are_the_profiles(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock)
    clocks = backend.supported_sm_clocks_mhz(1)
    assert len(clocks) == 38
    assert clocks[0] == 1410
    assert clocks[-1] == 855
    assert clocks == sorted(clocks, reverse=True)
    assert clocks == [int(f) for f in a100.frequencies_mhz]
    # Unlocked, the GPU runs at the highest clock.
    assert backend.sm_clock_mhz(0) == 1410
    assert backend.locked_sm_clock_mhz(0) is None
    assert backend.nearest_supported_sm_clock_mhz(0, 1000) == 1005


def test_busy_power_follows_the_profile_at_the_current_clock(
    a100: Profile, clock: FakeClock
) -> None:
    backend = make(a100, clock)
    assert backend.set_activity(0, 0, "forward")
    assert backend.power_w(0) == pytest.approx(power(FWD0_1410), rel=1e-12)
    assert backend.lock_sm_clock(0, 1005)
    assert backend.sm_clock_mhz(0) == 1005
    assert backend.power_w(0) == pytest.approx(power(FWD0_1005), rel=1e-12)
    # Other stages and instructions come from their own rows.
    backend.lock_sm_clock(1, 855)
    backend.set_activity(1, 3, "BACKWARD")
    assert backend.activity(1) == (3, "backward")
    assert backend.power_w(1) == pytest.approx(power(BWD3_855), rel=1e-12)
    # The profile's forward pass draws more power at 1410 MHz than at 1005 MHz.
    assert power(FWD0_1410) > power(FWD0_1005)


def test_idle_and_blocked_power_is_the_blocking_power(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock)
    assert backend.activity(0) is None
    assert backend.power_w(0) == A100_BLOCKING_W
    backend.set_activity(0, 0, "forward")
    assert backend.power_w(0) != A100_BLOCKING_W
    assert backend.set_activity(0, None, None)
    assert backend.activity(0) is None
    assert backend.power_w(0) == A100_BLOCKING_W
    backend.lock_sm_clock(0, 855)
    assert backend.power_w(0) == A100_BLOCKING_W
    assert not backend.set_activity(0, None, None)


def test_energy_integrates_power_exactly_across_changes(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock)
    assert backend.energy_j(0) == 0.0

    clock.advance(2.0)  # idle at 1410
    backend.set_activity(0, 0, "forward")
    clock.advance(0.5)  # forward at 1410
    backend.lock_sm_clock(0, 1005)
    clock.advance(0.75)  # forward at 1005
    backend.set_activity(0, 0, "backward")
    clock.advance(0.75)  # backward at 1005
    backend.set_activity(0, None, None)
    clock.advance(6.0)  # idle at 1005
    backend.reset_sm_clock(0)
    clock.advance(1.0)  # idle at 1410

    expected = (
        2.0 * A100_BLOCKING_W
        + 0.5 * power(FWD0_1410)
        + 0.75 * power(FWD0_1005)
        + 0.75 * power(BWD0_1005)
        + 6.0 * A100_BLOCKING_W
        + 1.0 * A100_BLOCKING_W
    )
    assert backend.energy_j(0) == pytest.approx(expected, rel=1e-12)
    # Mid-interval reads integrate up to now without banking anything.
    clock.advance(0.25)
    assert backend.energy_j(0) == pytest.approx(expected + 0.25 * A100_BLOCKING_W, rel=1e-12)
    # GPU 1 stayed idle all along.
    assert backend.energy_j(1) == pytest.approx(11.25 * A100_BLOCKING_W, rel=1e-12)


def test_lower_clock_takes_longer_and_uses_less_energy_per_instruction(
    a100: Profile, clock: FakeClock
) -> None:
    backend = make(a100, clock, num_gpus=1)
    energies: dict[int, float] = {}
    for clock_mhz, row in ((1410, FWD0_1410), (1005, FWD0_1005)):
        backend.lock_sm_clock(0, clock_mhz)
        duration_s = backend.instruction_time_s(0, 0, "forward")
        assert duration_s == pytest.approx(row[0], rel=1e-12)
        # Run one forward pass for exactly that long and read the counter.
        start_j = backend.energy_j(0)
        backend.set_activity(0, 0, "forward")
        assert backend.power_w(0) * duration_s == pytest.approx(row[1], rel=1e-12)
        clock.advance(duration_s)
        backend.set_activity(0, None, None)
        energies[clock_mhz] = backend.energy_j(0) - start_j
        assert energies[clock_mhz] == pytest.approx(row[1], rel=1e-9)
    assert energies[1005] < energies[1410]
    assert backend.instruction_time_s(0, 0, "forward") > FWD0_1410[0]


def test_clock_missing_from_one_instruction_uses_the_nearest_profiled_clock(
    clock: FakeClock,
) -> None:
    # Stage 0 forward lacks 1300 MHz, which stage 0 backward has.
    text = "\n".join(
        [
            "stage,instruction,frequency,time,energy",
            "0,forward,1400,1.0,100.0",
            "0,forward,1200,2.0,120.0",
            "0,backward,1400,1.0,200.0",
            "0,backward,1300,1.5,210.0",
            "0,backward,1200,2.0,220.0",
        ]
    )
    profile = parse_profile(text, "toy+x1_fp16.csv")
    backend = EmulatedBackend(1, profile, blocking_power_w=10.0, clock=clock)
    assert backend.supported_sm_clocks_mhz(0) == [1400, 1300, 1200]
    assert backend.devices()[0].name == "Emulated X1 (toy+x1_fp16)"
    assert backend.devices()[0].uuid == "GPU-emu-emulated-0"
    backend.lock_sm_clock(0, 1300)
    backend.set_activity(0, 0, "forward")
    # 1300 is as far from 1400 as from 1200: the higher clock wins, as in the base class.
    assert backend.power_w(0) == 100.0
    assert backend.instruction_time_s(0, 0, "forward") == 1.0
    assert backend.instruction_time_s(0, 0, "backward") == 1.5
    backend.set_activity(0, 0, "backward")
    assert backend.power_w(0) == 140.0


def test_setters_skip_no_op_changes(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock)
    assert not backend.reset_sm_clock(0)
    assert not backend.reset_memory_clock(0)
    assert backend.lock_sm_clock(0, 1005)
    assert not backend.lock_sm_clock(0, 1005)
    assert backend.lock_sm_clock(0, 1410)
    assert backend.reset_sm_clock(0)
    assert not backend.reset_sm_clock(0)
    # Locking at the default clock is still a lock.
    assert backend.lock_sm_clock(0, 1410)
    assert backend.locked_sm_clock_mhz(0) == 1410

    assert backend.lock_memory_clock(0, 1593)
    assert not backend.lock_memory_clock(0, 1593)
    assert backend.locked_memory_clock_mhz(0) == 1593
    assert backend.locked_memory_clock_mhz(1) is None
    assert backend.reset_memory_clock(0)
    assert not backend.reset_memory_clock(0)
    assert backend.locked_memory_clock_mhz(0) is None

    assert backend.set_activity(1, 0, "forward")
    assert not backend.set_activity(1, 0, "Forward")


def test_memory_clock_lock_does_not_change_power(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock)
    backend.set_activity(0, 0, "forward")
    before = backend.power_w(0)
    backend.lock_memory_clock(0, 1215)
    assert backend.power_w(0) == before
    assert backend.sm_clock_mhz(0) == 1410


def test_invalid_gpu_calls_raise_gpu_errors(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock)
    with pytest.raises(GpuInvalidArgumentError) as info:
        backend.lock_sm_clock(0, 1000)
    assert info.value.gpu_index == 0
    assert backend.locked_sm_clock_mhz(0) is None
    with pytest.raises(GpuInvalidArgumentError):
        backend.lock_memory_clock(0, 0)
    for call in (
        lambda: backend.sm_clock_mhz(2),
        lambda: backend.power_w(-1),
        lambda: backend.energy_j(5),
        lambda: backend.lock_sm_clock(2, 1410),
        lambda: backend.supported_sm_clocks_mhz(2),
        lambda: backend.set_activity(2, 0, "forward"),
    ):
        with pytest.raises(GpuNotFoundError):
            call()


def test_invalid_activity_is_rejected(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock)
    with pytest.raises(ValueError, match="stage 8"):
        backend.set_activity(0, 8, "forward")
    with pytest.raises(ValueError, match="unknown instruction"):
        backend.set_activity(0, 0, "optimizer")
    with pytest.raises(ValueError, match="both"):
        backend.set_activity(0, 0, None)
    with pytest.raises(ValueError, match="stage 8"):
        backend.instruction_time_s(0, 8, "forward")
    assert backend.activity(0) is None


@pytest.mark.parametrize("num_gpus", [0, -1, True, 1.5])
def test_invalid_num_gpus(a100: Profile, num_gpus: int) -> None:
    with pytest.raises(ValueError, match="num_gpus"):
        EmulatedBackend(num_gpus, a100, blocking_power_w=A100_BLOCKING_W)


@pytest.mark.parametrize("blocking_power_w", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_blocking_power(a100: Profile, blocking_power_w: float) -> None:
    with pytest.raises(ValueError, match="blocking_power_w"):
        EmulatedBackend(1, a100, blocking_power_w=blocking_power_w)


@pytest.mark.parametrize("node_name", ["", "two words"])
def test_invalid_node_name(a100: Profile, node_name: str) -> None:
    with pytest.raises(ValueError, match="node_name"):
        EmulatedBackend(1, a100, blocking_power_w=A100_BLOCKING_W, node_name=node_name)


def test_fault_injection_affects_only_that_gpu(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock, num_gpus=3)
    backend.inject_fault(1, GpuLostError("GPU 1 fell off the bus", gpu_index=1))
    for call in (
        lambda: backend.sm_clock_mhz(1),
        lambda: backend.power_w(1),
        lambda: backend.energy_j(1),
        lambda: backend.supported_sm_clocks_mhz(1),
        lambda: backend.lock_sm_clock(1, 1005),
        lambda: backend.reset_sm_clock(1),
        lambda: backend.lock_memory_clock(1, 1593),
        lambda: backend.reset_memory_clock(1),
    ):
        with pytest.raises(GpuLostError, match="fell off"):
            call()
    assert backend.locked_sm_clock_mhz(1) is None
    # The other GPUs work, and the node still lists all of them.
    assert backend.lock_sm_clock(0, 1005)
    assert backend.lock_sm_clock(2, 1005)
    assert backend.energy_j(2) == 0.0
    assert len(backend.devices()) == 3
    # Cleared, the GPU works again; its energy kept counting meanwhile.
    clock.advance(1.0)
    backend.inject_fault(1, None)
    assert backend.lock_sm_clock(1, 1005)
    assert backend.energy_j(1) == pytest.approx(A100_BLOCKING_W)
    with pytest.raises(TypeError):
        backend.inject_fault(0, RuntimeError("x"))  # type: ignore[arg-type]


def test_state_file_is_shared_between_instances(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    agent = make(a100, clock, state_file=state_file)
    rank = make(a100, clock, state_file=state_file)
    assert state_file.exists()

    assert agent.lock_sm_clock(0, 1005)
    assert rank.sm_clock_mhz(0) == 1005
    assert rank.instruction_time_s(0, 0, "forward") == pytest.approx(FWD0_1005[0], rel=1e-12)
    assert not rank.lock_sm_clock(0, 1005)

    clock.advance(1.0)
    rank.set_activity(0, 0, "forward")
    clock.advance(2.0)
    assert agent.activity(0) == (0, "forward")
    assert agent.power_w(0) == pytest.approx(power(FWD0_1005), rel=1e-12)
    expected = A100_BLOCKING_W + 2.0 * power(FWD0_1005)
    assert agent.energy_j(0) == pytest.approx(expected, rel=1e-12)
    assert rank.energy_j(0) == agent.energy_j(0)

    agent.lock_memory_clock(1, 1593)
    assert rank.locked_memory_clock_mhz(1) == 1593
    assert rank.reset_sm_clock(0)
    assert agent.sm_clock_mhz(0) == 1410
    assert not agent.reset_sm_clock(0)

    # The file names every GPU it describes.
    data = state_file.read_bytes()
    assert data.startswith(b"PERSEMU\0")
    assert b"GPU-emu-node-a-0" in data and b"GPU-emu-node-a-1" in data


def test_state_file_is_decoded_again_only_after_it_changes(
    a100: Profile, clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_file = tmp_path / "gpus.json"
    agent = make(a100, clock, state_file=state_file)
    rank = make(a100, clock, state_file=state_file)
    shared = agent._shared
    assert shared is not None
    decodes: list[int] = []
    unpack = shared._unpack
    monkeypatch.setattr(shared, "_unpack", lambda mm, i: decodes.append(i) or unpack(mm, i))

    assert agent.sm_clock_mhz(0) == 1410
    first = len(decodes)
    for _ in range(5):
        assert agent.sm_clock_mhz(0) == 1410
        assert not agent.reset_sm_clock(0)
    assert len(decodes) == first  # unchanged generation: nothing decoded

    assert agent.lock_sm_clock(0, 1005)  # its own write refreshes the cache
    assert agent.sm_clock_mhz(0) == 1005
    assert len(decodes) == first

    assert rank.lock_sm_clock(0, 1200)  # another process's write is seen
    assert agent.sm_clock_mhz(0) == 1200
    assert len(decodes) == first + 2  # both GPUs' records


def test_a_state_file_torn_by_a_dead_writer_or_cut_short_is_refused(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    backend = make(a100, clock, state_file=state_file)
    data = bytearray(state_file.read_bytes())
    data[16] |= 1  # an odd generation: a writer died between its two generation bumps
    state_file.write_bytes(bytes(data))
    with pytest.raises(GpuError, match="died while writing it"):
        backend.sm_clock_mhz(0)
    with pytest.raises(ValueError, match="died while writing it"):
        make(a100, clock, state_file=state_file)
    with state_file.open("r+b") as f:
        f.truncate(40)  # in place: the mapping must not be read past the file's end (SIGBUS)
    with pytest.raises(GpuError, match="size changed"):
        backend.sm_clock_mhz(0)
    state_file.write_text('{"version": 1, "gpus": []}')  # a state file of an older version
    with pytest.raises(ValueError, match="not an emulated GPU state file of version 4"):
        make(a100, clock, state_file=state_file)


def test_lock_survives_a_new_instance_until_reset(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    first = make(a100, clock, state_file=state_file)
    first.lock_sm_clock(1, 855)
    first.set_activity(1, 3, "backward")
    clock.advance(4.0)
    del first

    restarted = make(a100, clock, state_file=state_file)
    assert restarted.sm_clock_mhz(1) == 855
    assert restarted.locked_sm_clock_mhz(1) == 855
    assert restarted.energy_j(1) == pytest.approx(4.0 * power(BWD3_855), rel=1e-12)
    assert restarted.reset_sm_clock(1)

    again = make(a100, clock, state_file=state_file)
    assert again.sm_clock_mhz(1) == 1410
    assert not again.reset_sm_clock(1)


def test_in_memory_state_is_not_shared(a100: Profile, clock: FakeClock) -> None:
    first = make(a100, clock)
    first.lock_sm_clock(0, 855)
    assert make(a100, clock).sm_clock_mhz(0) == 1410


def test_fault_is_shared_through_the_state_file(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    harness = make(a100, clock, state_file=state_file)
    agent = make(a100, clock, state_file=state_file)
    harness.inject_fault(0, GpuNoPermissionError("clock control needs root"))
    with pytest.raises(GpuNoPermissionError, match="needs root") as info:
        agent.lock_sm_clock(0, 1005)
    assert info.value.reason == "no_permission"
    assert info.value.gpu_index == 0
    assert agent.lock_sm_clock(1, 1005)
    harness.inject_fault(0, None)
    assert agent.lock_sm_clock(0, 1005)


def test_state_file_of_other_gpus_is_rejected(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    make(a100, clock, num_gpus=2, state_file=state_file)
    with pytest.raises(ValueError, match="describes 2 GPUs"):
        make(a100, clock, num_gpus=4, state_file=state_file)
    with pytest.raises(ValueError, match="UUID"):
        make(a100, clock, num_gpus=2, state_file=state_file, node_name="node-b")
    state_file.write_text("{not json")
    with pytest.raises(ValueError, match="not an emulated GPU state file"):
        make(a100, clock, state_file=state_file)


def test_corrupted_state_file_raises_gpu_error(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    backend = make(a100, clock, state_file=state_file)
    data = bytearray(state_file.read_bytes())
    data[24:40] = b"GPU-someone-else"  # GPU 0's UUID
    data[16] += 2  # a completed write: the generation moved on
    state_file.write_bytes(bytes(data))
    with pytest.raises(GpuError, match="invalid: GPU 0 has UUID"):
        backend.sm_clock_mhz(0)


def test_concurrent_changes_through_separate_instances_are_not_lost(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    num_gpus = 8
    make(a100, clock, num_gpus=num_gpus, state_file=state_file)
    clocks = a100.frequencies_mhz

    def churn(index: int) -> None:
        backend = make(a100, clock, num_gpus=num_gpus, state_file=state_file)
        for step in range(30):
            backend.lock_sm_clock(index, int(clocks[(index + step) % len(clocks)]))
            backend.lock_memory_clock(index, 1000 + step)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(num_gpus)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    final = make(a100, clock, num_gpus=num_gpus, state_file=state_file)
    for index in range(num_gpus):
        assert final.sm_clock_mhz(index) == int(clocks[(index + 29) % len(clocks)])
        assert final.locked_memory_clock_mhz(index) == 1029


def test_shared_instance_is_thread_safe(a100: Profile, clock: FakeClock) -> None:
    backend = make(a100, clock, num_gpus=1)
    errors: list[BaseException] = []

    def toggle() -> None:
        try:
            for _ in range(200):
                backend.lock_sm_clock(0, 1005)
                backend.set_activity(0, 0, "forward")
                backend.energy_j(0)
                backend.reset_sm_clock(0)
                backend.set_activity(0, None, None)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=toggle) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert backend.energy_j(0) == 0.0  # the fake clock never moved


_LOCK_AND_HANG = """
import sys, time
from pathlib import Path
from perseus_api.profile import load_profile
from perseus_agent.gpu.emulated import EmulatedBackend
backend = EmulatedBackend(
    2, load_profile(sys.argv[1]), blocking_power_w=83.64, node_name="node-a",
    state_file=Path(sys.argv[2]),
)
backend.lock_sm_clock(1, 1005)
print("locked", flush=True)
time.sleep(60)
"""


def test_lock_survives_sigkill_of_the_agent_process(a100: Profile, tmp_path: Path) -> None:
    state_file = tmp_path / "gpus.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT / "operator"), str(REPO_ROOT / "node_agent"), env.get("PYTHONPATH", "")]
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", _LOCK_AND_HANG, str(A100_PROFILE), str(state_file)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().strip() == "locked"
        agent.send_signal(signal.SIGKILL)
        assert agent.wait(timeout=30) == -signal.SIGKILL
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()

    restarted = EmulatedBackend(
        2, a100, blocking_power_w=A100_BLOCKING_W, node_name="node-a", state_file=state_file
    )
    assert restarted.sm_clock_mhz(1) == 1005
    assert restarted.sm_clock_mhz(0) == 1410
    assert restarted.reset_sm_clock(1)


def test_energy_counter_never_goes_back_while_another_process_changes_activity(
    tmp_path: Path,
) -> None:
    """A reader racing a writer in another process must not see the counter decrease."""
    state = tmp_path / "gpus.json"
    reader = EmulatedBackend.from_csv(1, A100_PROFILE, blocking_power_w=80.0, state_file=state)
    code = (
        "import sys, time\n"
        "from perseus_agent.gpu.emulated import EmulatedBackend\n"
        f"gpu = EmulatedBackend.from_csv(1, {str(A100_PROFILE)!r}, blocking_power_w=80.0,"
        f" state_file={str(state)!r})\n"
        "end = time.monotonic() + 2.0\n"
        "while time.monotonic() < end:\n"
        "    gpu.set_activity(0, 0, 'forward')\n"
        "    gpu.set_activity(0, None, None)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "operator"), str(REPO_ROOT / "node_agent")]),
    }
    writer = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        previous = reader.energy_j(0)
        while writer.poll() is None:
            now = reader.energy_j(0)
            assert now >= previous, f"energy went back from {previous} J to {now} J"
            previous = now
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode in (0, -9)


def test_busy_time_counts_only_computations(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    gpus = make(a100, clock, state_file=tmp_path / "gpus.json")
    clock.advance(1.0)  # idle
    gpus.set_activity(0, 0, "forward")
    clock.advance(0.25)
    assert gpus.busy_s(0) == pytest.approx(0.25)  # while it runs, too
    gpus.set_activity(0, None, None)
    clock.advance(2.0)
    gpus.set_activity(0, 1, "backward")
    clock.advance(0.5)
    gpus.set_activity(0, None, None)
    again = make(a100, clock, state_file=tmp_path / "gpus.json")  # shared through the file
    assert again.busy_s(0) == pytest.approx(0.75) and again.busy_s(1) == 0.0


# -- slowdown (a straggler GPU) ----------------------------------------------------------------


def test_slowdown_stretches_instruction_time_at_the_same_power(
    a100: Profile, clock: FakeClock
) -> None:
    gpus = make(a100, clock)
    assert gpus.slowdown(0) == 1.0
    assert gpus.set_slowdown(0, 1.25)
    assert not gpus.set_slowdown(0, 1.25)  # no change
    assert gpus.slowdown(0) == 1.25 and gpus.slowdown(1) == 1.0
    assert gpus.instruction_time_s(0, 0, "forward") == pytest.approx(1.25 * FWD0_1410[0])
    assert gpus.instruction_time_s(1, 0, "forward") == pytest.approx(FWD0_1410[0])
    # It follows the clock the agent locked.
    gpus.lock_sm_clock(0, 1005)
    assert gpus.instruction_time_s(0, 0, "forward") == pytest.approx(1.25 * FWD0_1005[0])
    assert gpus.instruction_time_s(0, 0, "backward") == pytest.approx(1.25 * BWD0_1005[0])
    gpus.set_activity(0, 0, "forward")
    assert gpus.power_w(0) == pytest.approx(power(FWD0_1005), rel=1e-12)
    assert gpus.set_slowdown(0, 1)
    assert gpus.slowdown(0) == 1.0 and isinstance(gpus.slowdown(0), float)
    assert gpus.instruction_time_s(0, 0, "forward") == pytest.approx(FWD0_1005[0], rel=1e-12)


def test_slowed_instruction_uses_proportionally_more_energy(
    a100: Profile, clock: FakeClock
) -> None:
    """Energy is power x elapsed time: running a slowed instruction for its (longer) time
    counts exactly ``factor`` times the profiled energy, and blocking power meanwhile.
    (The tolerance is the rounding of clock differences around 1000 s.)"""
    gpus = make(a100, clock)
    factor = 1.2
    gpus.set_slowdown(0, factor)
    slow_s = gpus.instruction_time_s(0, 0, "forward")
    fast_s = gpus.instruction_time_s(1, 0, "forward")
    gpus.set_activity(0, 0, "forward")
    gpus.set_activity(1, 0, "forward")
    clock.advance(fast_s)
    gpus.set_activity(1, None, None)
    clock.advance(slow_s - fast_s)
    gpus.set_activity(0, None, None)
    # GPU 0 computed for factor x t; GPU 1 waited at blocking power while GPU 0 ran on.
    assert gpus.energy_j(0) == pytest.approx(factor * FWD0_1410[1], rel=1e-9)
    expected_fast = FWD0_1410[1] + A100_BLOCKING_W * (factor - 1) * FWD0_1410[0]
    assert gpus.energy_j(1) == pytest.approx(expected_fast, rel=1e-9)
    assert gpus.busy_s(0) == pytest.approx(factor * FWD0_1410[0], rel=1e-9)
    # Changing the slowdown mid-instruction changes no power: energy keeps integrating.
    gpus.set_activity(0, 0, "forward")
    clock.advance(0.01)
    gpus.set_slowdown(0, 2.0)
    clock.advance(0.01)
    gpus.set_activity(0, None, None)
    expected = factor * FWD0_1410[1] + 0.02 * power(FWD0_1410)
    assert gpus.energy_j(0) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("factor", [0.99, 0.0, -1.0, math.nan, math.inf, True, "1.5", None])
def test_invalid_slowdown_is_rejected(a100: Profile, clock: FakeClock, factor: object) -> None:
    gpus = make(a100, clock)
    with pytest.raises(ValueError, match="slowdown must be a finite number >= 1"):
        gpus.set_slowdown(0, factor)  # type: ignore[arg-type]
    assert gpus.slowdown(0) == 1.0
    with pytest.raises(GpuNotFoundError):
        gpus.set_slowdown(5, 1.5)


def test_slowdown_is_shared_through_the_state_file_across_processes(
    a100: Profile, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    harness = EmulatedBackend(
        2, a100, blocking_power_w=A100_BLOCKING_W, node_name="node-a", state_file=state_file
    )
    harness.set_slowdown(1, 1.5)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from perseus_agent.gpu.emulated import EmulatedBackend\n"
        "gpus = EmulatedBackend.from_csv(2, sys.argv[1], blocking_power_w=83.64,"
        " node_name='node-a', state_file=Path(sys.argv[2]))\n"
        "print(gpus.slowdown(0), gpus.slowdown(1), gpus.instruction_time_s(1, 0, 'forward'))\n"
        "gpus.set_slowdown(0, 3.0)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "operator"), str(REPO_ROOT / "node_agent")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code, str(A100_PROFILE), str(state_file)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert float(out[0]) == 1.0 and float(out[1]) == 1.5
    assert float(out[2]) == pytest.approx(1.5 * FWD0_1410[0], rel=1e-12)
    assert harness.slowdown(0) == 3.0  # the other process's change is seen here
    fresh = EmulatedBackend(
        2, a100, blocking_power_w=A100_BLOCKING_W, node_name="node-a", state_file=state_file
    )
    assert (fresh.slowdown(0), fresh.slowdown(1)) == (3.0, 1.5)


def test_a_bad_value_written_to_the_state_file_makes_it_invalid(
    a100: Profile, clock: FakeClock, tmp_path: Path
) -> None:
    state_file = tmp_path / "gpus.json"
    backend = make(a100, clock, state_file=state_file)
    backend.lock_sm_clock(0, 1005)
    # Another writer that does not check what it writes (the backend's own setters refuse it).
    raw = SharedGpuStates(
        state_file, ["GPU-emu-node-a-0", "GPU-emu-node-a-1"], INSTRUCTIONS, lambda: []
    )
    with raw.transaction(write=True) as txn:
        txn.gpus[1].slowdown = 0.5
        txn.dirty = True
    with pytest.raises(GpuError, match=r"invalid.*slowdown"):
        backend.slowdown(1)
    with raw.transaction(write=True) as txn:
        txn.gpus[1].slowdown = 1.0
        txn.gpus[0].locked_sm_clock_mhz = 1234  # not a clock of the profile
        txn.dirty = True
    with pytest.raises(GpuError, match="unsupported clock 1234"):
        backend.sm_clock_mhz(0)
    raw.close()


def test_metered_energy_ignores_injected_faults(a100: Profile, clock: FakeClock) -> None:
    gpus = make(a100, clock)
    gpus.set_activity(0, 0, "forward")
    clock.advance(1.0)
    gpus.inject_fault(0, GpuLostError("GPU 0 fell off the bus", gpu_index=0))
    with pytest.raises(GpuLostError):
        gpus.energy_j(0)
    assert gpus.metered_energy_j(0) == pytest.approx(power(FWD0_1410), rel=1e-9)
    gpus.inject_fault(0, None)
    assert gpus.metered_energy_j(0) == gpus.energy_j(0)
