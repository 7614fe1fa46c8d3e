"""The emulated GPUs' hardware state, shared by the processes that open the same file.

An agent and the emulated training ranks of a node see the same GPUs: the agent locks a clock,
a rank marks the GPU busy and reads how fast it runs now, a harness reads the energy counter.
They share a small binary file that each maps into memory (``mmap``): a header and one
fixed-size record per GPU, read and written in place under an ``fcntl.flock`` on a sidecar
``<file>.lock`` (shared for reads, exclusive for writes). A read or write is a few
microseconds; a JSON file rewritten on every change cost ~250 µs a write (p99 ~1.2 ms on a
loaded 2-core machine) and a decode in every other process after each one, which delayed the
clock changes and the pipeline's hand-offs it emulates.

Layout (little-endian)::

    header:  magic "PERSEMU\\0", version u32, GPU count u32, generation u64
    per GPU: uuid 64s, locked SM clock i32, locked memory clock i32 (-1: not locked),
             energy f64 (J), busy f64 (s), last change f64 (s), slowdown f64,
             activity stage i32, instruction i32 (-1: idle), fault type 48s, reason 48s,
             message 256s (empty type: no fault), injected clock event reasons u64,
             power limit f64 (W; NaN: the default)

The generation is odd while a writer is changing records and even otherwise: a reader finds
it odd only when a writer died in the middle of a write (the file is then refused, never read
half-written), and a reader whose generation is unchanged reuses what it decoded last. The
file is created whole (temporary file + rename) and never replaced, so every process maps the
same inode; its size is checked before each access, so a file cut short elsewhere is an error
rather than a ``SIGBUS``.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from perseus_agent import errors
from perseus_agent.errors import GpuError

__all__ = ["Activity", "GpuState", "SharedGpuStates", "Transaction"]

Activity = tuple[int, str]

_MAGIC = b"PERSEMU\x00"
_VERSION = 4
_HEADER = struct.Struct("<8sIIQ")
_GENERATION_OFFSET = 16
_GENERATION = struct.Struct("<Q")
_RECORD = struct.Struct("<64sii4dii48s48s256sQd")
_NONE = -1
_TEXT_LIMITS = {"uuid": 64, "type": 48, "reason": 48, "message": 256}

# Error classes a fault read back from the file is rebuilt as, by class name.
_ERROR_TYPES: dict[str, type[GpuError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, GpuError)
}


@dataclass
class GpuState:
    """Mutable hardware state of one emulated GPU."""

    last_change_s: float
    locked_sm_clock_mhz: int | None = None
    locked_memory_clock_mhz: int | None = None
    energy_j: float = 0.0
    busy_s: float = 0.0
    activity: Activity | None = None
    fault: GpuError | None = None
    slowdown: float = 1.0
    event_reasons: int = 0
    """Clock event reasons injected by a test (power cap, slowdown, ...), a bit mask."""
    power_limit_w: float | None = None
    """The power limit set (``None``: the default, which caps nothing)."""


@dataclass
class Transaction:
    """The GPUs' records during a transaction; a write transaction saves them if ``dirty``."""

    gpus: list[GpuState]
    dirty: bool = False


class SharedGpuStates:
    """The records of ``uuids`` in ``path``, created with ``initial()`` if it does not exist.

    Args:
        path: The state file.
        uuids: The GPUs it must describe, in index order.
        instructions: Instruction names by their code in the file.
        initial: The state of new GPUs, for a file that does not exist yet.
        validate: Checks a record read from the file (raises ``ValueError``: the file is
            then invalid), e.g. that its clock is one the GPU supports.

    Raises:
        ValueError: the file exists but describes other GPUs or is not a state file of this
            version.
    """

    def __init__(
        self,
        path: Path,
        uuids: list[str],
        instructions: tuple[str, ...],
        initial: Callable[[], list[GpuState]],
        validate: Callable[[int, GpuState], None] = lambda index, gpu: None,
    ) -> None:
        self._path = path
        self._validate = validate
        self._uuids = uuids
        self._instructions = instructions
        self._size = _HEADER.size + len(uuids) * _RECORD.size
        self._lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        self._fd = -1  # of the mapped file: fstat tells whether it was cut short
        self._lock_fd = -1
        # The decoded records and the generation they were decoded at.
        self._cached: tuple[int, list[GpuState]] | None = None
        try:
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ValueError(
                f"cannot open emulated GPU lock file {self._lock_path}: {exc}"
            ) from exc
        try:
            with self._file_lock(exclusive=True):
                if not path.exists():
                    self._create(initial())
                self._map()
                self._read()  # validates that it describes these GPUs
        except (GpuError, OSError) as exc:
            self.close()
            raise ValueError(str(exc)) from exc

    @property
    def path(self) -> Path:
        return self._path

    def close(self) -> None:
        with self._lock:
            if self._mm is not None:
                self._mm.close()
                self._mm = None
            for fd in (self._fd, self._lock_fd):
                if fd >= 0:
                    os.close(fd)  # the lock file's last descriptor: its flock goes too
            self._fd = self._lock_fd = -1

    def __del__(self) -> None:
        if hasattr(self, "_lock"):  # not when __init__ failed before setting it
            self.close()

    @contextmanager
    def transaction(self, *, write: bool) -> Iterator[Transaction]:
        """The records, under the thread lock and the file lock (shared for reads).

        A write transaction whose body sets ``dirty`` saves the records when the body
        completes; a body that raises saves nothing. Readers hold the shared lock while they
        read the clock too: a reader that saw the state before another process's change, but
        read the time after it, would count the old power past the change, and the energy
        counter would appear to go back.
        """
        with self._lock, self._file_lock(exclusive=write):
            txn = Transaction(self._read())
            if not write:
                yield txn
                return
            try:
                yield txn
            except BaseException:
                self._cached = None  # the body may have changed the cached objects
                raise
            if txn.dirty:
                self._write(txn.gpus)

    # -- file ---------------------------------------------------------------------------------

    @property
    def _lock_path(self) -> Path:
        return self._path.with_name(self._path.name + ".lock")

    @contextmanager
    def _file_lock(self, *, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _create(self, gpus: list[GpuState]) -> None:
        data = bytearray(self._size)
        _HEADER.pack_into(data, 0, _MAGIC, _VERSION, len(self._uuids), 0)
        for index, gpu in enumerate(gpus):
            self._pack(data, index, gpu)
        fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=f".{self._path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            Path(tmp).replace(self._path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _map(self) -> None:
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
            size = os.fstat(self._fd).st_size
            if size < _HEADER.size:
                raise GpuError(self._not_ours(f"it holds {size} bytes"))
            self._mm = mmap.mmap(self._fd, size)
        except OSError as exc:
            raise GpuError(f"cannot read emulated GPU state file {self._path}: {exc}") from exc

    def _not_ours(self, why: str) -> str:
        return (
            f"{self._path} is not an emulated GPU state file of version {_VERSION} ({why}); "
            "delete it to start with fresh GPUs"
        )

    def _mapped(self) -> mmap.mmap:
        mm = self._mm
        if mm is None:
            raise GpuError(f"emulated GPU state file {self._path} is closed")
        try:
            size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise GpuError(f"cannot read emulated GPU state file {self._path}: {exc}") from exc
        if size != len(mm):
            raise GpuError(
                f"emulated GPU state file {self._path} is invalid: its size changed from "
                f"{len(mm)} to {size} bytes"
            )
        return mm

    def _read(self) -> list[GpuState]:
        mm = self._mapped()
        magic, version, count, generation = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC or version != _VERSION:
            raise GpuError(self._not_ours(f"magic {magic!r}, version {version}"))
        if count != len(self._uuids) or len(mm) != self._size:
            raise GpuError(
                f"emulated GPU state file {self._path} describes {count} GPUs, this backend "
                f"has {len(self._uuids)}"
            )
        if generation % 2:
            raise GpuError(
                f"emulated GPU state file {self._path} is invalid: a process died while "
                "writing it; delete it to start with fresh GPUs"
            )
        if self._cached is not None and self._cached[0] == generation:
            return self._cached[1]
        gpus = [self._unpack(mm, index) for index in range(count)]
        self._cached = (generation, gpus)
        return gpus

    def _write(self, gpus: list[GpuState]) -> None:
        mm = self._mapped()
        (generation,) = _GENERATION.unpack_from(mm, _GENERATION_OFFSET)
        _GENERATION.pack_into(mm, _GENERATION_OFFSET, generation + 1)
        for index, gpu in enumerate(gpus):
            self._pack(mm, index, gpu)
        _GENERATION.pack_into(mm, _GENERATION_OFFSET, generation + 2)
        self._cached = (generation + 2, gpus)

    # -- records ------------------------------------------------------------------------------

    def _pack(self, buffer: bytearray | mmap.mmap, index: int, gpu: GpuState) -> None:
        stage, instruction = (_NONE, _NONE)
        if gpu.activity is not None:
            stage, instruction = gpu.activity[0], self._instructions.index(gpu.activity[1])
        fault = gpu.fault
        _RECORD.pack_into(
            buffer,
            _HEADER.size + index * _RECORD.size,
            _text(self._uuids[index], "uuid"),
            _NONE if gpu.locked_sm_clock_mhz is None else gpu.locked_sm_clock_mhz,
            _NONE if gpu.locked_memory_clock_mhz is None else gpu.locked_memory_clock_mhz,
            gpu.energy_j,
            gpu.busy_s,
            gpu.last_change_s,
            gpu.slowdown,
            stage,
            instruction,
            _text(type(fault).__name__ if fault else "", "type"),
            _text(fault.reason if fault else "", "reason"),
            _text(str(fault) if fault else "", "message"),
            gpu.event_reasons,
            math.nan if gpu.power_limit_w is None else gpu.power_limit_w,
        )

    def _unpack(self, mm: mmap.mmap, index: int) -> GpuState:
        offset = _HEADER.size + index * _RECORD.size
        (uuid, sm, memory, energy, busy, last, slowdown, stage, instruction, ftype, reason, msg,
         event_reasons, power_limit) = _RECORD.unpack_from(mm, offset)  # fmt: skip
        found = uuid.rstrip(b"\0").decode("utf-8", "replace")
        if found != self._uuids[index]:
            raise GpuError(
                f"emulated GPU state file {self._path} is invalid: GPU {index} has UUID "
                f"{found!r}, expected {self._uuids[index]!r}"
            )
        if not 0 <= instruction < len(self._instructions) and instruction != _NONE:
            raise GpuError(
                f"emulated GPU state file {self._path} is invalid: GPU {index} runs unknown "
                f"instruction code {instruction}"
            )
        fault: GpuError | None = None
        if ftype.rstrip(b"\0"):
            error_type = _ERROR_TYPES.get(ftype.rstrip(b"\0").decode(), GpuError)
            fault = error_type(msg.rstrip(b"\0").decode("utf-8", "replace"), gpu_index=index)
            fault.reason = reason.rstrip(b"\0").decode("utf-8", "replace")
        gpu = GpuState(
            last_change_s=last,
            locked_sm_clock_mhz=None if sm == _NONE else sm,
            locked_memory_clock_mhz=None if memory == _NONE else memory,
            energy_j=energy,
            busy_s=busy,
            activity=None if instruction == _NONE else (stage, self._instructions[instruction]),
            fault=fault,
            slowdown=slowdown,
            event_reasons=event_reasons,
            power_limit_w=None if math.isnan(power_limit) else power_limit,
        )
        try:
            self._validate(index, gpu)
        except ValueError as exc:
            raise GpuError(f"emulated GPU state file {self._path} is invalid: {exc}") from exc
        return gpu


def _text(value: str, field: str) -> bytes:
    """``value`` as UTF-8, cut to its field (a fault message may be longer than 256 bytes)."""
    encoded = value.encode("utf-8")
    limit = _TEXT_LIMITS[field]
    if len(encoded) > limit and field == "uuid":
        raise ValueError(f"GPU UUID {value!r} is longer than {limit} bytes")
    return encoded[:limit]
