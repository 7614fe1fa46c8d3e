"""Persistent record of the GPU clocks and power limits this agent changed, so none outlives it.

The record is a small JSON file in the agent's state directory, replaced atomically (write to a
temporary file, ``fsync``, ``rename``, ``fsync`` the directory) every time it changes. A GPU is
recorded *before* its clock is locked: if the agent dies between the record and the lock, the
next start resets a GPU that was perhaps never locked, which is harmless; the other order could
leave a locked GPU nobody knows about.

On start-up the agent calls :meth:`ResetState.recover`: every GPU in the record is reset and the
record is cleared. A record that cannot be read or parsed is no proof that nothing is locked, so
then *every* GPU of the node is reset and the file is rewritten.

Recovery uses ``GpuBackend.force_reset_clocks``: the plain resets only undo locks the backend
itself made, and a new agent's backend knows nothing of the locks a killed one left (NVML keeps
them after the process is gone).

Power limits are recorded the same way, with the limit in force before the agent first set one
(``power_limit_w``): recovery puts that limit back (the GPU's default for a record that cannot be
read). A GPU whose power limit only was changed gets its clocks left alone.

One agent per state directory: :class:`StateDirLock` (``flock`` on :data:`LOCK_FILENAME`) is
taken before anything else, so a second agent started on the same directory (a rollout overlap,
a stray manual run) exits without resetting the GPUs of the one that is running or rewriting its
record. The kernel drops the lock when its holder dies, SIGKILL included, so a stale lock file
never blocks a restart.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from perseus_agent.errors import GpuError, GpuNotSupportedError
from perseus_agent.gpu.base import GpuBackend, GpuInfo

__all__ = [
    "LOCK_FILENAME",
    "STATE_FILENAME",
    "ClockKind",
    "LockedGpu",
    "RecoveryResult",
    "ResetState",
    "StateDirBusyError",
    "StateDirLock",
    "needs_recovery",
]

log = logging.getLogger(__name__)

STATE_FILENAME: Final = "reset-state.json"
LOCK_FILENAME: Final = "agent.lock"
_FORMAT_VERSION: Final = 1

ClockKind = Literal["sm", "memory", "power_limit"]
"""What the agent changed on a GPU: its SM clock, its memory clock or its power limit."""
_CLOCKS: Final[frozenset[ClockKind]] = frozenset({"sm", "memory"})


class LockedGpu(BaseModel):
    """One GPU whose clocks this agent (may have) changed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str
    index: int = Field(ge=0)
    locked: tuple[ClockKind, ...] = Field(min_length=1, description="Which clocks were locked.")
    since: datetime = Field(description="When the first of them was recorded (UTC).")
    power_limit_w: float | None = Field(
        default=None,
        gt=0,
        description="With power_limit: the limit in force before the agent set one (watts).",
    )


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = _FORMAT_VERSION
    gpus: list[LockedGpu] = Field(default_factory=list)


@dataclass
class RecoveryResult:
    """What :meth:`ResetState.recover` did."""

    reset: list[GpuInfo] = field(default_factory=list)
    """GPUs whose clocks (and power limits) were reset."""
    failed: list[tuple[str, str]] = field(default_factory=list)
    """``(gpu label, error)`` of GPUs that could not be reset; they stay in the record."""
    corrupt: bool = False
    """The record could not be read, so every GPU was reset."""


class ResetState:
    """The record of locked GPUs in ``state_dir``; thread-safe.

    Args:
        state_dir: Directory of the record; created if missing.
        filename: Name of the record in ``state_dir``.

    Raises:
        OSError: ``state_dir`` cannot be created.
    """

    def __init__(self, state_dir: Path | str, filename: str = STATE_FILENAME) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / filename
        self._lock = threading.Lock()
        self._gpus: dict[str, LockedGpu] = {}

    # -- queries -----------------------------------------------------------------------------

    def entries(self) -> list[LockedGpu]:
        """GPUs recorded by this process (the file mirrors them), by index."""
        with self._lock:
            return sorted(self._gpus.values(), key=lambda g: (g.index, g.uuid))

    def is_recorded(self, gpu: GpuInfo, kind: ClockKind = "sm") -> bool:
        with self._lock:
            entry = self._gpus.get(gpu.uuid)
            return entry is not None and kind in entry.locked

    # -- updates -----------------------------------------------------------------------------

    def record(
        self, gpu: GpuInfo, kind: ClockKind = "sm", *, original_power_limit_w: float | None = None
    ) -> None:
        """Record that ``gpu``'s ``kind`` clock (or power limit) is about to be changed; call
        *before* changing it. For ``power_limit``, ``original_power_limit_w`` is the limit in
        force now, which recovery puts back.

        Writes the file only when the entry is new, so re-locking at another clock (or setting
        another limit) costs nothing and keeps the first original limit.

        Raises:
            OSError: The record cannot be written; the caller must then not change the GPU.
        """
        power_w = original_power_limit_w if kind == "power_limit" else None
        with self._lock:
            entry = self._gpus.get(gpu.uuid)
            if entry is not None and kind in entry.locked:
                return
            if entry is None:
                new = LockedGpu(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    locked=(kind,),
                    since=_now(),
                    power_limit_w=power_w,
                )
            else:
                update: dict[str, object] = {"locked": (*entry.locked, kind)}
                if kind == "power_limit":
                    update["power_limit_w"] = power_w
                new = entry.model_copy(update=update)
            self._gpus[gpu.uuid] = new
            try:
                self._write_locked()
            except OSError:
                if entry is None:
                    del self._gpus[gpu.uuid]
                else:
                    self._gpus[gpu.uuid] = entry
                raise

    def original_power_limit_w(self, gpu: GpuInfo) -> float | None:
        """The limit recorded before the agent first set ``gpu``'s (None: not recorded)."""
        with self._lock:
            entry = self._gpus.get(gpu.uuid)
            return None if entry is None else entry.power_limit_w

    def forget(self, gpu: GpuInfo, kind: ClockKind | None = None) -> None:
        """Drop ``gpu`` (or only its ``kind`` clock) from the record once it has been reset.

        A failed write is logged, not raised: the stale entry only causes a harmless extra
        reset at the next start.
        """
        with self._lock:
            entry = self._gpus.get(gpu.uuid)
            if entry is None:
                return
            remaining = () if kind is None else tuple(k for k in entry.locked if k != kind)
            if remaining == entry.locked:
                return
            if remaining:
                update: dict[str, object] = {"locked": remaining}
                if "power_limit" not in remaining:
                    update["power_limit_w"] = None
                self._gpus[gpu.uuid] = entry.model_copy(update=update)
            else:
                del self._gpus[gpu.uuid]
            try:
                self._write_locked()
            except OSError as exc:
                log.error("cannot update reset record %s: %s", self.path, exc)

    # -- start-up ------------------------------------------------------------------------------

    def recover(self, backend: GpuBackend) -> RecoveryResult:
        """Reset every GPU a previous run of the agent left recorded, then clear the record.

        A missing record means a clean start. An unreadable or corrupt record is logged as an
        error and every GPU of ``backend`` is reset. GPUs that cannot be reset stay in the
        record (and are retried at the next start).

        Raises:
            OSError: The cleared record cannot be written.
            GpuError: The backend cannot list its GPUs.
        """
        result = RecoveryResult()
        with self._lock:
            previous = self._read()
            devices = backend.devices()
            if previous is None:
                result.corrupt = True
                todo: list[tuple[GpuInfo, Iterable[ClockKind], LockedGpu | None]] = [
                    (gpu, ("sm", "memory", "power_limit"), None) for gpu in devices
                ]
            else:
                todo = []
                by_uuid = {g.uuid: g for g in devices}
                for entry in previous.gpus:
                    gpu = by_uuid.get(entry.uuid)
                    if gpu is None:
                        log.warning(
                            "GPU %s (index %d) of the reset record is not on this node any more; "
                            "dropping it",
                            entry.uuid,
                            entry.index,
                        )
                        continue
                    todo.append((gpu, entry.locked, entry))
            self._gpus = {}
            for gpu, kinds, recorded in todo:
                original_w = recorded.power_limit_w if recorded is not None else None
                left = _restore(backend, gpu, tuple(kinds), original_w, result)
                if left:
                    self._gpus[gpu.uuid] = LockedGpu(
                        uuid=gpu.uuid,
                        index=gpu.index,
                        locked=left,
                        since=recorded.since if recorded is not None else _now(),
                        power_limit_w=original_w if "power_limit" in left else None,
                    )
                else:
                    result.reset.append(gpu)
            if previous is not None and not previous.gpus and not self._gpus:
                return result  # clean start: nothing to rewrite
            self._write_locked()
        if result.reset:
            log.info(
                "reset the clocks of %d GPU(s) left by a previous run: %s",
                len(result.reset),
                ", ".join(str(g.index) for g in result.reset),
            )
        return result

    # -- file I/O ------------------------------------------------------------------------------

    def _read(self) -> _Record | None:
        """The record on disk; an empty one if missing; ``None`` if unreadable or corrupt."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return _Record()
        except (OSError, UnicodeDecodeError) as exc:
            log.error("cannot read reset record %s (%s); resetting every GPU", self.path, exc)
            return None
        try:
            return _Record.model_validate_json(text)
        except ValidationError as exc:
            log.error(
                "corrupt reset record %s; resetting every GPU to be safe: %s",
                self.path,
                _one_line(exc),
            )
            return None

    def _write_locked(self) -> None:
        record = _Record(gpus=sorted(self._gpus.values(), key=lambda g: (g.index, g.uuid)))
        data = json.dumps(record.model_dump(mode="json"), indent=2).encode() + b"\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.state_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            Path(tmp).replace(self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                Path(tmp).unlink()
            raise
        _fsync_dir(self.state_dir)


def _restore(
    backend: GpuBackend,
    gpu: GpuInfo,
    kinds: tuple[ClockKind, ...],
    original_power_limit_w: float | None,
    result: RecoveryResult,
) -> tuple[ClockKind, ...]:
    """Undo ``kinds`` on ``gpu``; what could not be undone (logged, in ``result.failed``)."""
    left: list[ClockKind] = []
    if _CLOCKS.intersection(kinds):
        try:
            backend.force_reset_clocks(gpu.index)
        except GpuError as exc:
            log.error("cannot reset the clocks of GPU %d (%s): %s", gpu.index, gpu.uuid, exc)
            left += [k for k in kinds if k in _CLOCKS]
            result.failed.append((gpu.uuid, f"{exc.reason}: {exc}"))
    if "power_limit" in kinds:
        try:
            if original_power_limit_w is None:
                backend.reset_power_limit(gpu.index)
            else:
                backend.set_power_limit(gpu.index, original_power_limit_w)
        except GpuNotSupportedError:
            pass  # a GPU without power limits has none to put back
        except GpuError as exc:
            log.error("cannot restore the power limit of GPU %d (%s): %s", gpu.index, gpu.uuid, exc)
            left.append("power_limit")
            result.failed.append((gpu.uuid, f"{exc.reason}: {exc}"))
    return tuple(left)


def needs_recovery(state_dir: Path | str, filename: str = STATE_FILENAME) -> bool:
    """Whether the record in ``state_dir`` may name locked GPUs: it lists some, or it exists but
    cannot be read or parsed (no proof that nothing is locked). Creates nothing."""
    path = Path(state_dir) / filename
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError):
        return True
    try:
        return bool(_Record.model_validate_json(text).gpus)
    except ValidationError:
        return True


class StateDirBusyError(Exception):
    """Another live process holds the lock of the state directory."""

    def __init__(self, state_dir: Path, holder_pid: int | None) -> None:
        holder = "another process" if holder_pid is None else f"another process (pid {holder_pid})"
        super().__init__(
            f"{holder} already holds state directory {state_dir} "
            f"(lock file {state_dir / LOCK_FILENAME}): another agent is running on this node"
        )
        self.state_dir = state_dir
        self.holder_pid = holder_pid


class StateDirLock:
    """Exclusive lock on an agent state directory, held until :meth:`release` or exit.

    Use :meth:`acquire`. The lock file keeps the holder's pid, for the loser's message only:
    the ``flock`` is what counts (a pid in a file outlives its process, the lock does not).
    """

    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self.path = state_dir / LOCK_FILENAME
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, state_dir: Path | str) -> StateDirLock:
        """Take the lock, creating ``state_dir`` if missing; never waits.

        Raises:
            StateDirBusyError: A live process holds it (nothing was changed).
            OSError: The directory or the lock file cannot be created or opened.
        """
        directory = Path(state_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILENAME
        # O_CLOEXEC: a child process must not inherit (and so extend) the lock.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateDirBusyError(directory, holder) from None
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # the pid is only informative
            log.debug("cannot write the pid into %s: %s", path, exc)
        return cls(directory, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Release the lock (idempotent). The file stays: removing it would race a new holder."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse to fsync directories
        pass
    finally:
        os.close(fd)


def _now() -> datetime:
    return datetime.now(UTC)


def _one_line(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'record'}: {e['msg']}" for e in exc.errors()
    )
