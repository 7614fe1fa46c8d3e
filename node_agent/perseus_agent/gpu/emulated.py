"""Emulated GPUs whose time and power per SM clock follow a real Perseus profile.

The default backend for ``--gpu-backend emulated``, for tests and for demos without GPUs.
Each emulated GPU is, at any moment, either busy running one (stage, instruction) of the
profile or idle/blocked:

* busy: power is the profile's ``energy / time`` of that (stage, instruction) at the GPU's
  current SM clock (the nearest profiled clock of that (stage, instruction) if the exact one
  was not measured there);
* idle or blocked: power is ``blocking_power_w``.

The energy counter integrates that piecewise-constant power exactly over ``clock()`` time: the
energy so far is banked at every state change (activity, SM clock lock or reset).

The workload side (an emulated training rank) drives the activity with :meth:`set_activity`
and asks :meth:`instruction_time_s` how long an instruction takes at the current clock; the
agent side uses the :class:`GpuBackend` methods.

A GPU can be made a straggler with :meth:`set_slowdown`: a factor ``>= 1`` by which its
instructions take longer than the profile says, at the same power (as a thermally throttled
or degraded GPU would), so the energy of each instruction grows by that factor too.

Hardware state is in memory by default. With ``state_file`` it lives in a JSON file shared by
every process that opens it: every change rewrites it atomically (temporary file + rename)
under an ``fcntl.flock`` on a sidecar ``<file>.lock``, and every read checks, under that lock,
whether the file was replaced since this process last read or wrote it (inode, mtime, size)
and decodes it again only then.
So a clock lock survives the agent process being killed, and a restarted agent or an emulated
training rank in another process sees the same hardware. Faults injected with
:meth:`inject_fault` and slowdowns set with :meth:`set_slowdown` are part of that shared state
too.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perseus_agent import errors
from perseus_agent.errors import (
    GpuError,
    GpuInvalidArgumentError,
    GpuNotFoundError,
)
from perseus_agent.gpu.base import GpuBackend, GpuInfo
from perseus_api.profile import INSTRUCTIONS, Profile, load_profile

__all__ = ["EmulatedBackend"]

_STATE_VERSION = 1

# Numeric-format suffix of bundled profile names (``gpt3-175b+a100_sxm_bf16``).
_DTYPE_SUFFIX_RE = re.compile(r"_(?:bf16|fp16|fp32|tf32|fp8|int8)$", re.IGNORECASE)

# Error classes a fault read back from a state file can be rebuilt as, by class name.
_ERROR_TYPES: dict[str, type[GpuError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, GpuError)
}

Activity = tuple[int, str]


@dataclass
class _GpuState:
    """Mutable hardware state of one emulated GPU."""

    last_change_s: float
    locked_sm_clock_mhz: int | None = None
    locked_memory_clock_mhz: int | None = None
    energy_j: float = 0.0
    busy_s: float = 0.0
    activity: Activity | None = None
    fault: GpuError | None = None
    slowdown: float = 1.0


@dataclass
class _Transaction:
    gpus: list[_GpuState]
    dirty: bool = False


@dataclass(frozen=True)
class _Measurement:
    time_s: float
    energy_j: float

    @property
    def power_w(self) -> float:
        return self.energy_j / self.time_s


@dataclass(frozen=True)
class _Table:
    """Measurements of one (stage, instruction) by clock."""

    by_clock_mhz: dict[int, _Measurement] = field(default_factory=dict)

    def at(self, clock_mhz: int) -> _Measurement:
        row = self.by_clock_mhz.get(clock_mhz)
        if row is None:
            nearest = min(self.by_clock_mhz, key=lambda c: (abs(c - clock_mhz), -c))
            row = self.by_clock_mhz[nearest]
        return row


class EmulatedBackend(GpuBackend):
    """``num_gpus`` emulated GPUs driven by ``profile``.

    Args:
        num_gpus: How many GPUs (indices ``0..num_gpus-1``).
        profile: Time and energy per (stage, instruction) and SM clock.
        blocking_power_w: Power of an idle or blocked GPU.
        node_name: Part of the GPU UUIDs, ``GPU-emu-<node_name>-<index>``.
        state_file: JSON file holding the hardware state, shared across processes; ``None``
            keeps it in memory.
        clock: Time source in seconds for the energy counter.

    Raises:
        ValueError: an argument is invalid, or ``state_file`` holds state of other GPUs or is
            unreadable.
    """

    def __init__(
        self,
        num_gpus: int,
        profile: Profile,
        *,
        blocking_power_w: float,
        node_name: str = "emulated",
        state_file: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
            raise ValueError(f"num_gpus must be an integer >= 1, got {num_gpus!r}")
        if not isinstance(profile, Profile):
            raise ValueError(f"profile must be a Profile, got {type(profile).__name__}")
        if not profile.measurements:
            raise ValueError(f"profile {profile.source!r} has no measurements")
        if (
            isinstance(blocking_power_w, bool)
            or not isinstance(blocking_power_w, int | float)
            or not math.isfinite(blocking_power_w)
            or blocking_power_w <= 0
        ):
            raise ValueError(
                f"blocking_power_w must be a positive finite number of watts, "
                f"got {blocking_power_w!r}"
            )
        if not isinstance(node_name, str) or not node_name or any(c.isspace() for c in node_name):
            raise ValueError(
                f"node_name must be a non-empty string without spaces, got {node_name!r}"
            )

        self._num_gpus = num_gpus
        self._profile = profile
        self._blocking_power_w = float(blocking_power_w)
        self._node_name = node_name
        self._clock = clock
        self._lock = threading.Lock()

        self._clocks_mhz = [int(f) for f in profile.frequencies_mhz]
        self._clock_set = frozenset(self._clocks_mhz)
        self._max_clock_mhz = self._clocks_mhz[0]
        self._tables: dict[Activity, _Table] = {}
        for (stage, instruction), m in profile.measurements.items():
            self._tables[(stage, instruction)] = _Table(
                {
                    int(f): _Measurement(float(t), float(e))
                    for f, t, e in zip(m.frequencies_mhz, m.times_s, m.energies_j, strict=True)
                }
            )

        gpu_name = f"Emulated {_gpu_model(profile.source)} ({Path(profile.source).stem})"
        self._infos = [
            GpuInfo(index=i, uuid=f"GPU-emu-{node_name}-{i}", name=gpu_name)
            for i in range(num_gpus)
        ]

        self._state_file = None if state_file is None else Path(state_file)
        self._gpus: list[_GpuState] = []
        # The decoded state file and the (inode, mtime, size) it was decoded from: a lock call
        # that finds the file unchanged skips reading and decoding JSON (most of its cost).
        self._cached: tuple[tuple[int, int, int], list[_GpuState]] | None = None
        if self._state_file is None:
            now = clock()
            self._gpus = [_GpuState(last_change_s=now) for _ in range(num_gpus)]
        else:
            try:
                self._open_state_file()
            except GpuError as exc:
                raise ValueError(str(exc)) from exc

    @classmethod
    def from_csv(
        cls,
        num_gpus: int,
        profile_path: str | os.PathLike[str],
        *,
        blocking_power_w: float,
        node_name: str = "emulated",
        state_file: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> EmulatedBackend:
        """Like the constructor, with the profile loaded from a CSV (raises ``ProfileError``)."""
        return cls(
            num_gpus,
            load_profile(profile_path),
            blocking_power_w=blocking_power_w,
            node_name=node_name,
            state_file=state_file,
            clock=clock,
        )

    # -- properties -------------------------------------------------------------------------

    @property
    def num_gpus(self) -> int:
        return self._num_gpus

    @property
    def profile(self) -> Profile:
        return self._profile

    @property
    def blocking_power_w(self) -> float:
        return self._blocking_power_w

    @property
    def state_file(self) -> Path | None:
        return self._state_file

    # -- GpuBackend -------------------------------------------------------------------------

    def devices(self) -> list[GpuInfo]:
        return list(self._infos)

    def supported_sm_clocks_mhz(self, index: int) -> list[int]:
        with self._transaction(write=False) as txn:
            self._gpu(txn, index)
        return list(self._clocks_mhz)

    def sm_clock_mhz(self, index: int) -> int:
        with self._transaction(write=False) as txn:
            return self._current_clock_mhz(self._gpu(txn, index))

    def power_w(self, index: int) -> float:
        with self._transaction(write=False) as txn:
            return self._power_w(self._gpu(txn, index))

    def energy_j(self, index: int) -> float:
        with self._transaction(write=False) as txn:
            return self._energy_j(self._gpu(txn, index))

    def lock_sm_clock(self, index: int, clock_mhz: int) -> bool:
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index)
            if (
                isinstance(clock_mhz, bool)
                or not isinstance(clock_mhz, int)
                or clock_mhz not in self._clock_set
            ):
                raise GpuInvalidArgumentError(
                    f"GPU {index}: unsupported SM clock {clock_mhz!r} MHz; supported are "
                    f"{self._clocks_mhz[-1]}..{self._clocks_mhz[0]} MHz in profiled steps",
                    gpu_index=index,
                )
            if gpu.locked_sm_clock_mhz == clock_mhz:
                return False
            self._bank_energy(gpu)
            gpu.locked_sm_clock_mhz = clock_mhz
            txn.dirty = True
            return True

    def reset_sm_clock(self, index: int) -> bool:
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index)
            if gpu.locked_sm_clock_mhz is None:
                return False
            self._bank_energy(gpu)
            gpu.locked_sm_clock_mhz = None
            txn.dirty = True
            return True

    def lock_memory_clock(self, index: int, clock_mhz: int) -> bool:
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index)
            if isinstance(clock_mhz, bool) or not isinstance(clock_mhz, int) or clock_mhz <= 0:
                raise GpuInvalidArgumentError(
                    f"GPU {index}: invalid memory clock {clock_mhz!r} MHz", gpu_index=index
                )
            if gpu.locked_memory_clock_mhz == clock_mhz:
                return False
            gpu.locked_memory_clock_mhz = clock_mhz
            txn.dirty = True
            return True

    def reset_memory_clock(self, index: int) -> bool:
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index)
            if gpu.locked_memory_clock_mhz is None:
                return False
            gpu.locked_memory_clock_mhz = None
            txn.dirty = True
            return True

    # -- emulation only ---------------------------------------------------------------------
    # These are the workload's and the test's view of the GPU; injected faults do not apply.

    def set_activity(self, index: int, stage: int | None, instruction: str | None) -> bool:
        """Run ``instruction`` of ``stage`` from now on, or idle/block when both are ``None``.

        Returns ``False`` if the GPU was already doing exactly that.

        Raises:
            GpuNotFoundError: no GPU ``index``.
            ValueError: ``stage``/``instruction`` is not in the profile, or only one is None.
        """
        activity = self._activity_arg(stage, instruction)
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            if gpu.activity == activity:
                return False
            self._bank_energy(gpu)
            gpu.activity = activity
            txn.dirty = True
            return True

    def metered_energy_j(self, index: int) -> float:
        """The energy counter of :meth:`energy_j`, as a test harness reads it: no fault applies."""
        with self._transaction(write=False) as txn:
            return self._energy_j(self._gpu(txn, index, check_fault=False))

    def busy_s(self, index: int) -> float:
        """Seconds the GPU has run computations since its state began (emulated telemetry)."""
        with self._transaction(write=False) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            running_s = self._clock() - gpu.last_change_s if gpu.activity is not None else 0.0
            return gpu.busy_s + max(0.0, running_s)

    def activity(self, index: int) -> Activity | None:
        """``(stage, instruction)`` the GPU is running, or ``None`` when idle/blocked."""
        with self._transaction(write=False) as txn:
            return self._gpu(txn, index, check_fault=False).activity

    def instruction_time_s(self, index: int, stage: int, instruction: str) -> float:
        """Time of ``instruction`` of ``stage`` at the GPU's current SM clock.

        The profile's measured time times the GPU's :meth:`slowdown`.
        """
        activity = self._activity_arg(stage, instruction)
        assert activity is not None
        with self._transaction(write=False) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            return self._tables[activity].at(self._current_clock_mhz(gpu)).time_s * gpu.slowdown

    def set_slowdown(self, index: int, factor: float) -> bool:
        """Make the GPU's instructions take ``factor`` times as long as profiled; 1 restores it.

        A straggler: power stays the profile's, so each instruction's energy grows by
        ``factor`` too. With a state file the slowdown is shared with other processes.
        Returns ``False`` if the GPU already had that factor.

        Raises:
            GpuNotFoundError: no GPU ``index``.
            ValueError: ``factor`` is not a finite number ``>= 1``.
        """
        factor = _slowdown_arg(factor)
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            if gpu.slowdown == factor:
                return False
            # Power does not depend on the slowdown: no energy to bank.
            gpu.slowdown = factor
            txn.dirty = True
            return True

    def slowdown(self, index: int) -> float:
        """Factor by which the GPU's instructions take longer than profiled (1: not slowed)."""
        with self._transaction(write=False) as txn:
            return self._gpu(txn, index, check_fault=False).slowdown

    def locked_sm_clock_mhz(self, index: int) -> int | None:
        """The locked SM clock, ``None`` when unlocked."""
        with self._transaction(write=False) as txn:
            return self._gpu(txn, index, check_fault=False).locked_sm_clock_mhz

    def locked_memory_clock_mhz(self, index: int) -> int | None:
        """The locked memory clock, ``None`` when unlocked."""
        with self._transaction(write=False) as txn:
            return self._gpu(txn, index, check_fault=False).locked_memory_clock_mhz

    def inject_fault(self, index: int, error: GpuError | None) -> None:
        """Make every :class:`GpuBackend` call on GPU ``index`` raise ``error``; ``None`` clears.

        Calls on other GPUs, :meth:`devices` and the emulation-only methods are unaffected.
        With a state file the fault is shared: other processes raise an error of the same
        class (when it is one of :mod:`perseus_agent.errors`, else :class:`GpuError`) and
        message.
        """
        if error is not None and not isinstance(error, GpuError):
            raise TypeError(f"error must be a GpuError or None, got {type(error).__name__}")
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            gpu.fault = error
            txn.dirty = True

    # -- internals --------------------------------------------------------------------------

    def _activity_arg(self, stage: int | None, instruction: str | None) -> Activity | None:
        if stage is None and instruction is None:
            return None
        if stage is None or instruction is None:
            raise ValueError(
                f"stage and instruction must both be given or both be None, "
                f"got {stage!r} and {instruction!r}"
            )
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ValueError(f"stage must be an integer, got {stage!r}")
        if not 0 <= stage < self._profile.num_stages:
            raise ValueError(
                f"stage {stage} is not in the profile (stages 0..{self._profile.num_stages - 1})"
            )
        if not isinstance(instruction, str) or instruction.lower() not in INSTRUCTIONS:
            raise ValueError(
                f"unknown instruction {instruction!r}; expected one of {', '.join(INSTRUCTIONS)}"
            )
        return (stage, instruction.lower())

    def _gpu(self, txn: _Transaction, index: int, *, check_fault: bool = True) -> _GpuState:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(txn.gpus):
            raise GpuNotFoundError(
                f"no emulated GPU with index {index!r} (this node has {self._num_gpus})",
                gpu_index=index if isinstance(index, int) else None,
            )
        gpu = txn.gpus[index]
        if check_fault and gpu.fault is not None:
            raise gpu.fault.with_traceback(None)
        return gpu

    def _current_clock_mhz(self, gpu: _GpuState) -> int:
        return self._max_clock_mhz if gpu.locked_sm_clock_mhz is None else gpu.locked_sm_clock_mhz

    def _power_w(self, gpu: _GpuState) -> float:
        if gpu.activity is None:
            return self._blocking_power_w
        return self._tables[gpu.activity].at(self._current_clock_mhz(gpu)).power_w

    def _energy_j(self, gpu: _GpuState) -> float:
        elapsed_s = max(0.0, self._clock() - gpu.last_change_s)
        return gpu.energy_j + self._power_w(gpu) * elapsed_s

    def _bank_energy(self, gpu: _GpuState) -> None:
        """Add the energy since the last change at the current power; call before a change."""
        now = self._clock()
        if now > gpu.last_change_s:
            gpu.energy_j += self._power_w(gpu) * (now - gpu.last_change_s)
            if gpu.activity is not None:
                gpu.busy_s += now - gpu.last_change_s
            gpu.last_change_s = now

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[_Transaction]:
        """The current state, under the thread lock and the file lock (shared for reads).

        A write transaction that sets ``dirty`` is saved to the state file when its body
        completes; a body that raises saves nothing. Readers hold the shared lock while they
        read the clock too: a reader that saw the state before another process's change, but
        read the time after it, would count the old power past the change, and the energy
        counter would then appear to go back.
        """
        with self._lock:
            if self._state_file is None:
                yield _Transaction(self._gpus)
                return
            if not write:
                with self._file_lock(shared=True):
                    yield _Transaction(self._read_state())
                return
            with self._file_lock():
                txn = _Transaction(self._read_state())
                try:
                    yield txn
                except BaseException:
                    self._cached = None  # the body may have changed the cached objects
                    raise
                if txn.dirty:
                    self._write_state(txn.gpus)

    @property
    def _lock_path(self) -> Path:
        assert self._state_file is not None
        return self._state_file.with_name(self._state_file.name + ".lock")

    @contextmanager
    def _file_lock(self, *, shared: bool = False) -> Iterator[None]:
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise GpuError(f"cannot open emulated GPU lock file {self._lock_path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def _open_state_file(self) -> None:
        assert self._state_file is not None
        with self._lock, self._file_lock():
            if self._state_file.exists():
                self._read_state()  # validates that it describes these GPUs
            else:
                now = self._clock()
                self._write_state([_GpuState(last_change_s=now) for _ in range(self._num_gpus)])

    def _read_state(self) -> list[_GpuState]:
        path = self._state_file
        assert path is not None
        try:
            with path.open("rb") as f:
                key = _file_key(os.fstat(f.fileno()))
                if self._cached is not None and self._cached[0] == key:
                    return self._cached[1]
                raw = json.loads(f.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GpuError(f"cannot read emulated GPU state file {path}: {exc}") from exc
        try:
            gpus = self._decode(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise GpuError(f"emulated GPU state file {path} is invalid: {exc}") from exc
        self._cached = (key, gpus)
        return gpus

    def _write_state(self, gpus: list[_GpuState]) -> None:
        path = self._state_file
        assert path is not None
        # Compact: json.dumps with an indent runs the pure-Python encoder, several times slower.
        text = json.dumps(self._encode(gpus))
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    key = _file_key(os.fstat(f.fileno()))
                Path(tmp).replace(path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                self._cached = None
                raise
        except OSError as exc:
            raise GpuError(f"cannot write emulated GPU state file {path}: {exc}") from exc
        self._cached = (key, gpus)

    def _encode(self, gpus: list[_GpuState]) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "gpus": [
                {
                    "uuid": info.uuid,
                    "locked_sm_clock_mhz": gpu.locked_sm_clock_mhz,
                    "locked_memory_clock_mhz": gpu.locked_memory_clock_mhz,
                    "energy_j": gpu.energy_j,
                    "busy_s": gpu.busy_s,
                    "last_change_s": gpu.last_change_s,
                    "activity": (
                        None
                        if gpu.activity is None
                        else {"stage": gpu.activity[0], "instruction": gpu.activity[1]}
                    ),
                    "fault": (
                        None
                        if gpu.fault is None
                        else {
                            "type": type(gpu.fault).__name__,
                            "reason": gpu.fault.reason,
                            "message": str(gpu.fault),
                        }
                    ),
                    "slowdown": gpu.slowdown,
                }
                for info, gpu in zip(self._infos, gpus, strict=True)
            ],
        }

    def _decode(self, raw: Any) -> list[_GpuState]:
        if not isinstance(raw, dict) or raw.get("version") != _STATE_VERSION:
            raise ValueError(f"expected an object with version {_STATE_VERSION}")
        entries = raw["gpus"]
        if not isinstance(entries, list) or len(entries) != self._num_gpus:
            count = len(entries) if isinstance(entries, list) else "no"
            raise ValueError(f"it describes {count} GPUs, this backend has {self._num_gpus}")
        return [self._decode_gpu(i, entry) for i, entry in enumerate(entries)]

    def _decode_gpu(self, index: int, entry: Any) -> _GpuState:
        if not isinstance(entry, dict):
            raise TypeError(f"GPU {index}: expected an object")
        uuid = self._infos[index].uuid
        if entry["uuid"] != uuid:
            raise ValueError(f"GPU {index} has UUID {entry['uuid']!r}, expected {uuid!r}")
        activity: Activity | None = None
        if entry["activity"] is not None:
            activity = self._activity_arg(
                entry["activity"]["stage"], entry["activity"]["instruction"]
            )
        fault: GpuError | None = None
        if entry["fault"] is not None:
            error_type = _ERROR_TYPES.get(entry["fault"]["type"], GpuError)
            fault = error_type(str(entry["fault"]["message"]), gpu_index=index)
            fault.reason = str(entry["fault"]["reason"])
        locked_sm_clock_mhz = _optional_int(entry["locked_sm_clock_mhz"], "locked SM clock")
        if locked_sm_clock_mhz is not None and locked_sm_clock_mhz not in self._clock_set:
            raise ValueError(f"GPU {index} is locked at unsupported clock {locked_sm_clock_mhz}")
        return _GpuState(
            last_change_s=_number(entry["last_change_s"], "last_change_s"),
            locked_sm_clock_mhz=locked_sm_clock_mhz,
            locked_memory_clock_mhz=_optional_int(
                entry["locked_memory_clock_mhz"], "locked memory clock"
            ),
            energy_j=_number(entry["energy_j"], "energy_j"),
            busy_s=_number(entry.get("busy_s", 0.0), "busy_s"),
            activity=activity,
            fault=fault,
            # Absent from files written before slowdowns existed.
            slowdown=_slowdown_arg(entry.get("slowdown", 1.0)),
        )


def _file_key(st: os.stat_result) -> tuple[int, int, int]:
    # Every write is a new file renamed into place, so the inode alone changes with each
    # write while the old one is still linked; mtime and size guard against inode reuse.
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _slowdown_arg(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 1.0
    ):
        raise ValueError(f"slowdown must be a finite number >= 1, got {value!r}")
    return float(value)


def _optional_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer or null, got {value!r}")
    return value


def _gpu_model(source: str) -> str:
    """The GPU a profile was measured on, from a bundled-style name (``model+gpu_dtype.csv``)."""
    stem = Path(source).stem
    if "+" not in stem:
        return "GPU"
    gpu = _DTYPE_SUFFIX_RE.sub("", stem.rsplit("+", 1)[1])
    return gpu.upper().replace("_", "-") or "GPU"
