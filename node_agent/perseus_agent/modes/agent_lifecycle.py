"""What both modes of the node agent share: start-up, recovery, servers and the final reset.

:func:`run_agent` takes the state directory's lock (a second agent on the same directory
changes nothing), resets the clocks a previous run of the agent may have left locked (see
:mod:`perseus_agent.clocks.reset_state`), starts the metrics server and the local socket training
processes call in on, then lets the :class:`Runner` of its :class:`Mode` apply plans until
SIGTERM or SIGINT, when every clock the agent changed is reset. The modes are
:class:`~perseus_agent.modes.standalone_mode.StandaloneMode` (a plan file) and
:class:`~perseus_agent.modes.kubernetes_mode.KubernetesMode` (the node's PerseusNodePlans).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Protocol

from perseus_agent.clocks.clock_owners import ClockOwnerGuard, ForeignClockPolicy
from perseus_agent.clocks.reset_state import ResetState, StateDirBusyError, StateDirLock
from perseus_agent.errors import AgentError, GpuError
from perseus_agent.exporter import AgentMetrics, GpuCollector, ManagedGpu
from perseus_agent.gpu.base import GpuBackend, GpuInfo
from perseus_agent.gpu.releasable import ReleasableBackend
from perseus_agent.metrics_server import Health, MetricsServer
from perseus_agent.modes.agent_config import (
    EXIT_FAILURE,
    EXIT_OK,
    PLAN_POLL_S,
    SOCKET_NAME,
    Config,
    StartupError,
    UsageError,
    fail,
    open_backend,
)
from perseus_agent.serving.client_dispatch import ClientHandler
from perseus_agent.serving.local_server import LocalServer

__all__ = ["Mode", "Plans", "Runner", "Server", "run_agent"]

log = logging.getLogger("perseus_agent")


class Server(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


class Plans(ClientHandler, Protocol):
    """What holds the plans: one applier (standalone) or the plans of every job; the local
    server's handler, and what is reset at shutdown."""

    @property
    def metrics(self) -> AgentMetrics: ...
    @property
    def devices(self) -> Sequence[GpuInfo]: ...
    def managed_gpus(self) -> Mapping[int, ManagedGpu]: ...
    def clear(self) -> None: ...
    def locked_gpus(self) -> list[int]: ...


class Runner(Protocol):
    """A mode of the agent with the GPUs open: its plans, its servers, its loop."""

    @property
    def plans(self) -> Plans: ...

    def start_servers(self) -> list[Server]:
        """Servers besides the local socket, started."""
        ...

    def run(self, stop: threading.Event, health: Health) -> None:
        """Apply plans until ``stop`` is set, beating ``health``."""
        ...

    def stopping(self) -> None:
        """The servers are stopped; the clocks are about to be reset."""
        ...

    def stopped(self, reset_ok: bool) -> None:
        """The clocks are reset (every one of them if ``reset_ok``) and the GPUs closed."""
        ...


class Mode(Protocol):
    """Where the plans come from (and their reports go), before the GPUs are open."""

    def open(
        self, gpus: ReleasableBackend, guard: ClockOwnerGuard, reset_state: ResetState
    ) -> Runner:
        """The mode's runner, once the clocks of a previous run are reset (GpuError and
        OSError: the agent cannot start)."""
        ...

    def close(self) -> None:
        """The agent is done: release what the mode was made with."""
        ...


def run_agent(config: Config, mode: Mode) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status (``mode`` is closed in any case).

    Raises:
        UsageError: A flag value turned out wrong (exit status 2).
        StartupError: The agent cannot start (exit status 1).
    """
    return _Agent(config, mode).run()


class _Agent:
    def __init__(self, config: Config, mode: Mode) -> None:
        self.config = config
        self._mode = mode
        self._stop = threading.Event()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._stop.is_set():
            log.info("received %s; resetting clocks and stopping", signal.Signals(signum).name)
        self._stop.set()

    def run(self) -> int:
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        try:
            # Before anything else: a second agent must not reset the GPUs the first one
            # drives, nor rewrite its record, nor take its socket.
            try:
                lock = StateDirLock.acquire(self.config.state_dir)
            except StateDirBusyError as exc:
                raise StartupError(f"{exc}; this one changed nothing") from None
            except OSError as exc:
                raise UsageError(
                    f"--state-dir {self.config.state_dir}: {exc.strerror or exc}"
                ) from None
            try:
                return self._run()
            finally:
                lock.release()  # only once every clock is reset
        finally:
            self._mode.close()
            for sig, handler in previous.items():
                if handler is not None:  # None: installed outside Python, cannot be restored
                    signal.signal(sig, handler)

    def _run(self) -> int:
        config, mode = self.config, self._mode
        backend = ReleasableBackend(open_backend(config.gpu), lambda: open_backend(config.gpu))
        # Everything but the recovery of the agent's own leftover locks goes through the guard.
        guard = ClockOwnerGuard(backend, ForeignClockPolicy(config.gpu.foreign_clocks))
        servers: list[Server] = []
        health = Health(max_age_s=max(30.0, 10 * PLAN_POLL_S))
        runner: Runner | None = None
        try:
            try:
                reset_state = ResetState(config.state_dir)
            except OSError as exc:
                raise UsageError(f"--state-dir {config.state_dir}: {exc.strerror or exc}") from None
            try:
                reset_state.recover(backend)
                guard.survey(backend.devices())
                runner = mode.open(backend, guard, reset_state)
            except (GpuError, OSError) as exc:
                raise StartupError(
                    f"cannot reset the clocks and power limits left by a previous run: {exc}"
                ) from None

            plans = runner.plans
            metrics = plans.metrics
            metrics.registry.register(
                GpuCollector(
                    guard,
                    plans.devices,
                    metrics,
                    plans.managed_gpus,
                    foreign=guard.foreign,
                    foreign_power=guard.foreign_power_limits,
                )
            )
            try:
                exporter = MetricsServer(
                    metrics.registry, health, config.metrics_address, config.metrics_port
                )
            except OSError as exc:
                raise StartupError(
                    f"cannot serve metrics on {config.metrics_address}:{config.metrics_port}: "
                    f"{exc.strerror or exc}"
                ) from None
            exporter.start()
            servers.append(exporter)
            log.info("serving metrics on %s/metrics", exporter.url)

            servers.append(self._start_local_server(plans))
            servers.extend(runner.start_servers())
            runner.run(self._stop, health)
        finally:
            health.stop()
            ok = self._shutdown(backend, runner, servers)
        if not ok:
            return fail("some GPU clocks could not be reset (see the log)", EXIT_FAILURE)
        log.info("stopped; every clock this agent changed is reset")
        return EXIT_OK

    def _start_local_server(self, handler: ClientHandler) -> Server:
        path = self.config.socket_dir / SOCKET_NAME
        try:
            server = LocalServer(path, handler)
            server.start()
        except ValueError as exc:
            raise UsageError(f"--socket-dir {self.config.socket_dir}: {exc}") from None
        except AgentError as exc:
            raise StartupError(str(exc)) from None
        return server

    def _shutdown(self, backend: GpuBackend, runner: Runner | None, servers: list[Server]) -> bool:
        """Reset every clock; the runner reports it (Kubernetes mode: each plan's status)."""
        ok = True
        # The local server first: no training process may lock a clock after the reset.
        for server in reversed(servers):
            try:
                server.stop()
            except Exception:
                log.exception("error while stopping %s", type(server).__name__)
        if runner is not None:
            runner.stopping()
            try:
                runner.plans.clear()
            except Exception:
                log.exception("error while resetting clocks")
            ok = not runner.plans.locked_gpus()
        try:
            backend.close()
        except GpuError as exc:
            log.warning("error while closing the GPU library: %s", exc)
        if runner is not None:
            runner.stopped(ok)
        return ok
