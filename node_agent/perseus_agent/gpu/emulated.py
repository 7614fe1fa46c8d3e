"""Emulated GPUs whose time and power per SM clock follow a real Perseus profile.

The default backend for ``--gpu-backend emulated``, for tests and for demos without GPUs.
Each emulated GPU is, at any moment, either busy running one (stage, instruction) of the
profile or idle/blocked:

* busy: power is the profile's ``energy / time`` of that (stage, instruction) at the GPU's
  current SM clock (the nearest profiled clock of that (stage, instruction) if the exact one
  was not measured there);
* idle or blocked: power is ``blocking_power_w``.

The energy counter integrates that piecewise-constant power exactly over ``clock()`` time
(:mod:`perseus_agent.gpu.emulated_meter` reads clock, power and energy from a GPU's state). The
profile's times and powers by clock are read through
:class:`~perseus_agent.gpu.emulated_profile.ProfileModel`; this module owns the GPUs' state.

The workload side (an emulated training rank) drives the activity with :meth:`set_activity`
and asks :meth:`instruction_time_s` how long an instruction takes at the current clock; the
agent side uses the :class:`GpuBackend` methods.

Under a power limit each computation runs at its highest profiled clock (not above the locked
one) whose power fits, as firmware capping does and ``perseus simulate --power-budget``'s uniform
cap assumes (reason ``sw_power_cap``). Limits: blocking power .. the profile's highest (default).

A GPU can be made a straggler with :meth:`set_slowdown`: a factor ``>= 1`` by which its
instructions take longer than the profile says, at the same power (as a thermally throttled
or degraded GPU would), so the energy of each instruction grows by that factor too.

Hardware state is in memory by default. With ``state_file`` it lives in a small binary file
shared by every process that opens it (:mod:`perseus_agent.gpu.emulated_state`: mapped into
memory, read and written in place under a file lock, a few microseconds a change). So a clock
lock survives the agent process being killed, and a restarted agent or an emulated training
rank in another process sees the same hardware. Faults injected with :meth:`inject_fault` and
slowdowns set with :meth:`set_slowdown` are part of that shared state too.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from perseus_agent.errors import (
    GpuError,
    GpuInvalidArgumentError,
    GpuNotFoundError,
)
from perseus_agent.gpu.base import (
    CLOCK_EVENT_REASONS,
    GpuBackend,
    GpuInfo,
    PowerLimitRange,
    check_power_limit,
)
from perseus_agent.gpu.emulated_meter import GpuMeter
from perseus_agent.gpu.emulated_profile import ProfileModel, finite_number, slowdown_factor
from perseus_agent.gpu.emulated_state import Activity, GpuState, SharedGpuStates, Transaction
from perseus_api.profile import INSTRUCTIONS, Profile, load_profile

__all__ = ["EmulatedBackend"]


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
        model = ProfileModel(profile)  # raises ValueError for a bad profile
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

        self._model = model
        self._meter = GpuMeter(model, self._blocking_power_w, clock)
        self._clocks_mhz = model.clocks_mhz
        self._clock_set = model.clock_set
        self._max_clock_mhz = model.max_clock_mhz
        top_w = float(math.ceil(max(model.max_power_w, self._blocking_power_w)))
        self._power_limits = PowerLimitRange(float(math.ceil(self._blocking_power_w)), top_w, top_w)

        self._infos = [
            GpuInfo(index=i, uuid=f"GPU-emu-{node_name}-{i}", name=model.gpu_name)
            for i in range(num_gpus)
        ]

        self._gpus: list[GpuState] = []
        self._shared: SharedGpuStates | None = None
        if state_file is None:
            now = clock()
            self._gpus = [GpuState(last_change_s=now) for _ in range(num_gpus)]
        else:
            self._shared = SharedGpuStates(
                Path(state_file),
                [info.uuid for info in self._infos],
                INSTRUCTIONS,
                lambda: [GpuState(last_change_s=clock()) for _ in range(num_gpus)],
                self._check_state,
            )

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
        return None if self._shared is None else self._shared.path

    def close(self) -> None:
        """Unmap the state file (if any); the backend is unusable afterwards."""
        if self._shared is not None:
            self._shared.close()

    # -- GpuBackend -------------------------------------------------------------------------

    def devices(self) -> list[GpuInfo]:
        return list(self._infos)

    def supported_sm_clocks_mhz(self, index: int) -> list[int]:
        with self._transaction(write=False) as txn:
            self._gpu(txn, index)
        return list(self._clocks_mhz)

    def sm_clock_mhz(self, index: int) -> int:
        with self._transaction(write=False) as txn:
            return self._meter.current_clock_mhz(self._gpu(txn, index))

    def power_w(self, index: int) -> float:
        with self._transaction(write=False) as txn:
            return self._meter.power_w(self._gpu(txn, index))

    def energy_j(self, index: int) -> float:
        with self._transaction(write=False) as txn:
            return self._meter.energy_j(self._gpu(txn, index))

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
            self._meter.bank_energy(gpu)
            gpu.locked_sm_clock_mhz = clock_mhz
            txn.dirty = True
            return True

    def reset_sm_clock(self, index: int) -> bool:
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index)
            if gpu.locked_sm_clock_mhz is None:
                return False
            self._meter.bank_energy(gpu)
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

    def clock_event_reasons(self, index: int) -> int:
        """Idle when no computation runs, user-defined clocks while locked, and what a test
        injected with :meth:`set_clock_event_reasons`."""
        with self._transaction(write=False) as txn:
            gpu = self._gpu(txn, index)
            reasons = gpu.event_reasons
            if gpu.activity is None:
                reasons |= CLOCK_EVENT_REASONS["gpu_idle"]
            if gpu.locked_sm_clock_mhz is not None:
                reasons |= CLOCK_EVENT_REASONS["user_defined_clocks"]
            if self._meter.current_clock_mhz(gpu) < self._meter.requested_clock_mhz(gpu):
                reasons |= CLOCK_EVENT_REASONS["sw_power_cap"]
            return reasons

    def application_sm_clocks_mhz(self, index: int) -> tuple[int, int]:
        """Always the default (the emulation has no application clocks to set)."""
        with self._transaction(write=False) as txn:
            self._gpu(txn, index)
        return self._max_clock_mhz, self._max_clock_mhz

    def power_limit_w(self, index: int) -> float:
        with self._transaction(write=False) as txn:
            limit_w = self._gpu(txn, index).power_limit_w
        return self._power_limits.default_w if limit_w is None else limit_w

    def power_limit_range_w(self, index: int) -> PowerLimitRange:
        with self._transaction(write=False) as txn:
            self._gpu(txn, index)
        return self._power_limits

    def set_power_limit(self, index: int, limit_w: float) -> bool:
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index)
            check_power_limit(index, limit_w, self._power_limits)
            new = None if limit_w == self._power_limits.default_w else float(limit_w)
            if gpu.power_limit_w == new:
                return False
            self._meter.bank_energy(gpu)  # the clock may change with the limit
            gpu.power_limit_w = new
            txn.dirty = True
            return True

    # -- emulation only ---------------------------------------------------------------------

    def set_clock_event_reasons(self, index: int, reasons: int) -> None:
        """Make the GPU report these clock event reasons (a bit mask of
        :data:`~perseus_agent.gpu.base.CLOCK_EVENT_REASONS`) besides idle and user-defined
        clocks, e.g. a power cap; 0 clears them. Shared through the state file. They change
        no clock: the emulation's time and power follow the SM clock only.

        Raises:
            GpuNotFoundError: no GPU ``index``.
            ValueError: ``reasons`` has bits NVML does not define.
        """
        known = sum(CLOCK_EVENT_REASONS.values())
        if isinstance(reasons, bool) or not isinstance(reasons, int) or reasons & ~known:
            raise ValueError(
                f"reasons must be a bit mask of CLOCK_EVENT_REASONS (0..{known:#x}), "
                f"got {reasons!r}"
            )
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            gpu.event_reasons = reasons
            txn.dirty = True

    # These are the workload's and the test's view of the GPU; injected faults do not apply.

    def set_activity(self, index: int, stage: int | None, instruction: str | None) -> bool:
        """Run ``instruction`` of ``stage`` from now on, or idle/block when both are ``None``.

        Returns ``False`` if the GPU was already doing exactly that.

        Raises:
            GpuNotFoundError: no GPU ``index``.
            ValueError: ``stage``/``instruction`` is not in the profile, or only one is None.
        """
        activity = self._model.activity(stage, instruction)
        with self._transaction(write=True) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            if gpu.activity == activity:
                return False
            self._meter.bank_energy(gpu)
            gpu.activity = activity
            txn.dirty = True
            return True

    def metered_energy_j(self, index: int) -> float:
        """The energy counter of :meth:`energy_j`, as a test harness reads it: no fault applies."""
        with self._transaction(write=False) as txn:
            return self._meter.energy_j(self._gpu(txn, index, check_fault=False))

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
        activity = self._model.activity(stage, instruction)
        assert activity is not None
        with self._transaction(write=False) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            return self._model.time_s(activity, self._meter.current_clock_mhz(gpu)) * gpu.slowdown

    def instruction_rate(self, index: int, stage: int, instruction: str) -> tuple[float, float]:
        """:meth:`instruction_time_s`, and how many seconds ago the GPU's clock or activity
        last changed: a rank that finds a new rate learns when it began (a slowdown's change
        is not timed: it reads as the last other change)."""
        activity = self._model.activity(stage, instruction)
        assert activity is not None
        with self._transaction(write=False) as txn:
            gpu = self._gpu(txn, index, check_fault=False)
            time_s = self._model.time_s(activity, self._meter.current_clock_mhz(gpu)) * gpu.slowdown
            return time_s, max(0.0, self._clock() - gpu.last_change_s)

    def set_slowdown(self, index: int, factor: float) -> bool:
        """Make the GPU's instructions take ``factor`` times as long as profiled; 1 restores it.

        A straggler: power stays the profile's, so each instruction's energy grows by
        ``factor`` too. With a state file the slowdown is shared with other processes.
        Returns ``False`` if the GPU already had that factor.

        Raises:
            GpuNotFoundError: no GPU ``index``.
            ValueError: ``factor`` is not a finite number ``>= 1``.
        """
        factor = slowdown_factor(factor)
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

    def _gpu(self, txn: Transaction, index: int, *, check_fault: bool = True) -> GpuState:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(txn.gpus):
            raise GpuNotFoundError(
                f"no emulated GPU with index {index!r} (this node has {self._num_gpus})",
                gpu_index=index if isinstance(index, int) else None,
            )
        gpu = txn.gpus[index]
        if check_fault and gpu.fault is not None:
            raise gpu.fault.with_traceback(None)
        return gpu

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[Transaction]:
        """The current state: in memory under the thread lock, or the shared file's records
        (:meth:`SharedGpuStates.transaction`). A write transaction whose body sets ``dirty``
        is saved; a body that raises saves nothing."""
        if self._shared is None:
            with self._lock:
                yield Transaction(self._gpus)
            return
        with self._shared.transaction(write=write) as txn:
            yield txn

    def _check_state(self, index: int, gpu: GpuState) -> None:
        """A record read from the state file: clocks and activity this profile knows."""
        locked = gpu.locked_sm_clock_mhz
        if locked is not None and locked not in self._clock_set:
            raise ValueError(f"GPU {index} is locked at unsupported clock {locked}")
        if gpu.activity is not None:
            self._model.activity(*gpu.activity)
        limits, limit_w = self._power_limits, gpu.power_limit_w
        if limit_w is not None and not limits.min_w <= limit_w <= limits.max_w:
            raise ValueError(f"GPU {index} has power limit {limit_w} W, outside this profile's")
        finite_number(gpu.energy_j, "energy_j")
        finite_number(gpu.last_change_s, "last_change_s")
        slowdown_factor(gpu.slowdown)
