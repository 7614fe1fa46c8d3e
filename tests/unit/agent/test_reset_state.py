"""The reset record: written before any lock, replayed (and cleared) at start-up."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.clocks.reset_state import STATE_FILENAME, ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.errors import GpuLostError, GpuNotSupportedError
from perseus_api.node_plan import NodePlan
from perseus_api.node_report import GpuStatus
from support.factories import pipeline_plan_fields
from support.fake_gpu import FakeBackend


def _stage_plan(indices: list[int]) -> NodePlan:
    return NodePlan.model_validate(
        {
            "node": "node-1",
            "job": "gpt3",
            "revision": 1,
            "granularity": "Stage",
            "plans": {"p": pipeline_plan_fields(num_stages=1) | {"granularity": "Stage"}},
            "assignments": [{"gpu_index": i, "plan": "p", "stage": 0} for i in indices],
        }
    )


def _on_disk(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


class _CheckingBackend(FakeBackend):
    """Fails the test if a GPU is locked before the record on disk lists it."""

    state_file: Path | None = None

    def lock_sm_clock(self, index: int, clock_mhz: int) -> bool:
        assert self.state_file is not None
        uuids = [g["uuid"] for g in _on_disk(self.state_file)["gpus"]]
        assert self.gpus[index].info.uuid in uuids, "locked before it was recorded"
        return super().lock_sm_clock(index, clock_mhz)


def test_every_gpu_is_recorded_on_disk_before_its_clock_is_locked(tmp_path: Path) -> None:
    backend = _CheckingBackend(num_gpus=3)
    state = ResetState(tmp_path)
    backend.state_file = state.path
    applier = PlanApplier(backend, state, "node-1")

    report = applier.apply(_stage_plan([0, 2]))

    assert [g.status for g in report.gpus] == [GpuStatus.APPLIED, GpuStatus.APPLIED]
    assert backend.locked() == {0: 1410, 2: 1410}
    record = _on_disk(state.path)
    assert record["version"] == 1
    assert [(g["uuid"], g["index"], g["locked"]) for g in record["gpus"]] == [
        ("GPU-0", 0, ["sm"]),
        ("GPU-2", 2, ["sm"]),
    ]
    assert all(g["since"] for g in record["gpus"])
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILENAME]  # no temporary file left

    applier.clear()
    assert backend.locked() == {}
    assert _on_disk(state.path)["gpus"] == []


def test_a_gpu_that_cannot_be_recorded_is_not_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = FakeBackend(num_gpus=2)
    state = ResetState(tmp_path)
    applier = PlanApplier(backend, state, "node-1")

    def broken_write() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state, "_write_locked", broken_write)
    report = applier.apply(_stage_plan([0]))

    assert report.gpus[0].status == GpuStatus.FAILED
    assert "reset_state" in report.gpus[0].message
    assert "No space left" in report.gpus[0].message
    assert not [c for c in backend.calls if c[0] == "lock_sm_clock"]
    assert applier.metrics.error_count("reset_state") == 1
    assert state.entries() == []


def test_recovery_resets_the_recorded_gpus_and_clears_the_record(tmp_path: Path) -> None:
    backend = FakeBackend(num_gpus=4)
    killed = ResetState(tmp_path)
    killed.record(backend.gpus[1].info)
    killed.record(backend.gpus[3].info)
    killed.record(backend.gpus[3].info, "memory")
    backend.gpus[1].locked_sm_mhz = 1005  # what the killed agent left behind
    backend.gpus[3].locked_sm_mhz = 900
    backend.gpus[3].locked_memory_mhz = 1593
    backend.gpus[2].locked_sm_mhz = 1200  # locked by someone else: not ours to reset
    backend.calls.clear()

    restarted = ResetState(tmp_path)
    result = restarted.recover(backend)

    assert [g.index for g in result.reset] == [1, 3]
    assert not result.corrupt and not result.failed
    assert backend.locked() == {2: 1200}
    assert backend.gpus[3].locked_memory_mhz is None
    assert backend.mutating_calls() == [("force_reset_clocks", 1), ("force_reset_clocks", 3)]
    assert _on_disk(restarted.path)["gpus"] == []
    assert restarted.entries() == []


def test_corrupt_record_resets_every_gpu_and_is_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FakeBackend(num_gpus=3)
    backend.gpus[0].locked_sm_mhz = 1005
    backend.gpus[2].locked_sm_mhz = 1200
    backend.fail[("reset_memory_clock", 1)] = GpuNotSupportedError("no memory clocks", 1)
    path = tmp_path / STATE_FILENAME
    path.write_text('{"version": 1, "gpus": [{"uuid": ')  # torn write

    with caplog.at_level(logging.ERROR, logger="perseus_agent.clocks.reset_state"):
        result = ResetState(tmp_path).recover(backend)

    assert result.corrupt
    assert [g.index for g in result.reset] == [0, 1, 2]
    assert backend.locked() == {}
    # Every GPU, locked or not, whoever locked it.
    assert backend.mutating_calls() == [("force_reset_clocks", i) for i in range(3)]
    assert "corrupt reset record" in caplog.text
    assert _on_disk(path) == {"version": 1, "gpus": []}


def test_record_of_another_format_counts_as_corrupt(tmp_path: Path) -> None:
    backend = FakeBackend(num_gpus=1)
    (tmp_path / STATE_FILENAME).write_text('{"version": 7, "gpus": []}')
    assert ResetState(tmp_path).recover(backend).corrupt
    assert ("force_reset_clocks", 0) in backend.calls


def test_clean_start_touches_no_gpu_and_writes_nothing(tmp_path: Path) -> None:
    backend = FakeBackend(num_gpus=2)
    result = ResetState(tmp_path / "new").recover(backend)
    assert not result.reset and not result.corrupt
    assert backend.mutating_calls() == []
    assert list((tmp_path / "new").iterdir()) == []


def test_gpu_that_cannot_be_reset_stays_recorded_for_the_next_start(tmp_path: Path) -> None:
    backend = FakeBackend(num_gpus=2)
    killed = ResetState(tmp_path)
    killed.record(backend.gpus[0].info)
    killed.record(backend.gpus[1].info)
    backend.fail[("force_reset_clocks", 1)] = GpuLostError("fell off the bus", 1)

    state = ResetState(tmp_path)
    result = state.recover(backend)

    assert [g.index for g in result.reset] == [0]
    assert result.failed == [("GPU-1", "gpu_lost: fell off the bus")]
    assert [g["uuid"] for g in _on_disk(state.path)["gpus"]] == ["GPU-1"]

    del backend.fail[("force_reset_clocks", 1)]
    assert [g.index for g in ResetState(tmp_path).recover(backend).reset] == [1]


def test_gpu_gone_from_the_node_is_dropped(tmp_path: Path) -> None:
    big = FakeBackend(num_gpus=4)
    ResetState(tmp_path).record(big.gpus[3].info)
    small = FakeBackend(num_gpus=2)
    result = ResetState(tmp_path).recover(small)
    assert result.reset == [] and result.failed == []
    assert small.mutating_calls() == []
    assert _on_disk(tmp_path / STATE_FILENAME)["gpus"] == []


def test_recording_again_does_not_rewrite_the_file(tmp_path: Path) -> None:
    backend = FakeBackend(num_gpus=1)
    state = ResetState(tmp_path)
    state.record(backend.gpus[0].info)
    before = state.path.stat().st_ino
    state.record(backend.gpus[0].info)
    assert state.path.stat().st_ino == before
    assert state.is_recorded(backend.gpus[0].info)
    assert not state.is_recorded(backend.gpus[0].info, "memory")


class _ForgetfulBackend(FakeBackend):
    """Like NVML: ``reset_sm_clock`` only undoes locks made through this instance."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mine: set[int] = set()

    def lock_sm_clock(self, index: int, clock_mhz: int) -> bool:
        changed = super().lock_sm_clock(index, clock_mhz)
        self.mine.add(index)
        return changed

    def reset_sm_clock(self, index: int) -> bool:
        if index not in self.mine:
            self.calls.append(("reset_sm_clock", index))
            return False
        self.mine.discard(index)
        return super().reset_sm_clock(index)


def test_recovery_undoes_locks_the_new_backend_does_not_know_of(tmp_path: Path) -> None:
    killed = _ForgetfulBackend(num_gpus=3)
    ResetState(tmp_path).record(killed.gpus[1].info)
    killed.gpus[1].locked_sm_mhz = 1005  # locked by the killed agent's process

    restarted = _ForgetfulBackend(num_gpus=3)
    restarted.gpus = killed.gpus  # same hardware, new process
    result = ResetState(tmp_path).recover(restarted)

    assert [g.index for g in result.reset] == [1]
    assert restarted.locked() == {}
    # A plain reset would be refused (not this process's lock): recovery forces it.
    assert restarted.mutating_calls() == [("force_reset_clocks", 1)]


# -- one agent per state directory -----------------------------------------------------------------


def test_state_dir_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    from perseus_agent.clocks.reset_state import LOCK_FILENAME, StateDirBusyError, StateDirLock

    first = StateDirLock.acquire(tmp_path / "state")  # creates the directory
    assert first.held
    assert (tmp_path / "state" / LOCK_FILENAME).read_text().strip() == str(os.getpid())
    with pytest.raises(StateDirBusyError, match=rf"\(pid {os.getpid()}\) already holds") as info:
        StateDirLock.acquire(tmp_path / "state")
    assert info.value.holder_pid == os.getpid()
    first.release()
    first.release()  # idempotent
    assert not first.held
    second = StateDirLock.acquire(tmp_path / "state")
    second.release()


def test_needs_recovery_only_with_recorded_or_unreadable_locks(tmp_path: Path) -> None:
    from perseus_agent.clocks.reset_state import needs_recovery

    assert not needs_recovery(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()  # creates nothing
    state = ResetState(tmp_path)
    assert not needs_recovery(tmp_path)  # no record yet
    backend = FakeBackend(num_gpus=2)
    state.record(backend.devices()[1])
    assert needs_recovery(tmp_path)
    state.forget(backend.devices()[1])
    assert not needs_recovery(tmp_path)  # an empty record
    (tmp_path / STATE_FILENAME).write_text("{garbage")
    assert needs_recovery(tmp_path)
