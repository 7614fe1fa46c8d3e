"""Entry point of the ``perseus-node-agent`` command (the DaemonSet's container command).

Start-up: take the state directory's lock (a second agent on the same directory exits with
status 1 and changes nothing), reset the clocks a previous run of the agent may have left locked
(see :mod:`perseus_agent.reset_state`), start the metrics server and the local socket training
processes call in on, then apply plans until SIGTERM or SIGINT, when every clock the agent
changed is reset before it exits with status 0.

That recovery comes first whatever else is wrong: an agent that cannot start (a bad plan file, a
kubeconfig that cannot be loaded, a port in use, ...) still resets the clocks its killed
predecessor left locked before it exits, or a crash loop would keep them locked for good. Only
GPU flags that do not say which GPUs to open, or another agent holding the state directory,
leave them as they are (logged).

Kubernetes mode (the default): the plans are the PerseusNodePlans of this node
(:mod:`perseus_api.resources`), read and reported through the API by
:mod:`perseus_agent.kube` with the pod's service account (or ``--kubeconfig``). Each plan
object gets its own applier (several jobs share a node, on distinct GPUs: the older plan keeps
a GPU two plans claim). A plan's GPUs are those the kubelet allocated to the job's pods
(``--gpu-ownership=kubelet``, the default: the PodResources API on
``--pod-resources-socket``; :mod:`perseus_agent.gpu_ownership`); when the kubelet cannot be
asked (socket absent), no GPU is touched and every assignment is reported ``Failed``
(``pod_resources_unavailable``) until it can. ``--gpu-ownership=local-rank-index`` (or
``$PERSEUS_GPU_OWNERSHIP``) is for clusters without a kubelet, the emulated test clusters:
process local rank r of a pod runs on GPU index r, trusted. Each plan's status is written after
every change and every :data:`REPORT_INTERVAL_S` seconds (``--report-interval``) when it
changed, e.g. new iteration times; deleting the object resets its GPUs. An API that cannot be
reached is retried (with backoff) while the agent keeps running; only a configuration that
cannot be loaded at all is fatal (status 1).

``--standalone --plan-file PLAN.json`` runs without Kubernetes: the file holds one NodePlan
(JSON); it is checked every second and re-applied when it changes, and its removal clears the
plan. A plan that cannot be read or applied is reported and the previous plan's clocks are
reset; the agent keeps running. Write the file atomically (to a temporary file, then rename)
so the agent never reads half of it.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, Protocol

from pydantic import ValidationError

from perseus_agent.errors import AgentError, GpuError, PlanError

if TYPE_CHECKING:
    from perseus_agent.applier import PlanApplier
    from perseus_agent.clock_owners import ClockOwnerGuard
    from perseus_agent.driver_release import DriverUpgradeGate
    from perseus_agent.exporter import Health
    from perseus_agent.gpu.base import GpuBackend
    from perseus_agent.gpu.releasable import ReleasableBackend
    from perseus_agent.gpu_ownership import Ownership
    from perseus_agent.kube import JobPlans, ReportWriter
    from perseus_agent.local_server import ClientHandler
    from perseus_api.node_plan import NodePlan

__all__ = ["build_parser", "main"]

PROG: Final = "perseus-node-agent"
DEFAULT_POD_RESOURCES: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
"""As :data:`perseus_agent.pod_resources.DEFAULT_SOCKET` (not imported: it needs grpcio)."""
EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2

DEFAULT_PROFILE_PACKAGE: Final = "perseus_planner"
DEFAULT_PROFILE_FILE: Final = "gpt3-175b+a100_sxm_bf16.csv"
DEFAULT_BLOCKING_POWER_W: Final = 83.64
DEFAULT_EMULATED_GPUS: Final = 8
GPU_OWNERSHIP_MODES: Final = ("kubelet", "local-rank-index")
SOCKET_NAME: Final = "agent.sock"
PLAN_POLL_S: Final = 1.0
STOP_REPORT_TIMEOUT_S: Final = 3.0  # writing "stopped" statuses must fit the grace period
REPORT_INTERVAL_S: Final = 10.0
"""Kubernetes mode: default of how often the status of every plan is written (if it changed)."""
OWNERSHIP_REFRESH_S: Final = 5.0
"""Kubernetes mode: how often at most the kubelet is asked again which GPUs the pods own
(besides at every plan change): how soon a pod that starts after its plan is managed."""
NODE_POLL_S: Final = 5.0
"""Kubernetes mode: default of how often the node is read (its GPU driver upgrade state)."""
EVENT_POLL_S: Final = 2.0
"""Kubernetes mode: how often the loop checks for a stop request between events (CPU vs. stop
latency; plan events are handled at once)."""

log = logging.getLogger("perseus_agent")


class _UsageError(Exception):
    """A flag value is wrong: exit status 2."""


class _StartupError(Exception):
    """The agent cannot start (GPU library, port in use, ...): exit status 1."""


class _Server(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


class _Plans(Protocol):
    """What is reset at shutdown: one applier (standalone) or the plans of every job."""

    def clear(self) -> None: ...
    def locked_gpus(self) -> list[int]: ...


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Perseus node agent: applies per-GPU frequency plans, exports GPU energy metrics, "
            "and resets every clock it changed when it stops."
        ),
    )
    gpus = parser.add_argument_group("GPUs")
    gpus.add_argument(
        "--gpu-backend",
        choices=("nvml", "emulated"),
        default="nvml",
        help="nvml: the node's NVIDIA GPUs; emulated: profile-driven GPUs (default: nvml)",
    )
    gpus.add_argument(
        "--foreign-clocks",
        choices=("leave", "override"),
        default="leave",
        help="clocks another owner set before the agent started (an administrator's "
        "nvidia-smi -lgc or -ac): leave them and skip those GPUs, or override them and put "
        "them back when a plan ends (default: leave)",
    )
    gpus.add_argument(
        "--emulated-gpus",
        type=int,
        metavar="N",
        help=f"number of emulated GPUs (default: {DEFAULT_EMULATED_GPUS})",
    )
    gpus.add_argument(
        "--emulated-profile",
        type=Path,
        metavar="CSV",
        help="profile driving the emulated GPUs (default: the bundled GPT-3 175B A100 profile)",
    )
    gpus.add_argument(
        "--emulated-blocking-power",
        type=float,
        metavar="WATTS",
        help=(
            "power of an idle emulated GPU; required with --emulated-profile "
            f"(default with the bundled profile: {DEFAULT_BLOCKING_POWER_W})"
        ),
    )
    gpus.add_argument(
        "--emulated-state-file",
        type=Path,
        metavar="FILE",
        help="keep the emulated GPUs' state in FILE, shared across processes and restarts",
    )
    agent = parser.add_argument_group("agent")
    agent.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="name of this node (default: $NODE_NAME)",
    )
    agent.add_argument(
        "--metrics-port",
        type=int,
        default=9400,
        metavar="PORT",
        help="port of /metrics and /healthz; 0 picks a free one (default: 9400)",
    )
    agent.add_argument(
        "--metrics-address",
        default="0.0.0.0",
        metavar="ADDRESS",
        help="address the metrics server binds (default: 0.0.0.0)",
    )
    agent.add_argument(
        "--tcp-address",
        default="",
        metavar="HOST:PORT",
        help="also serve training processes over TCP here, the node's address "
        "(e.g. $(HOST_IP):7460 with hostNetwork; Kubernetes mode only: peers are told by their "
        "pod address, see perseus_agent.tcp_server); default: off",
    )
    agent.add_argument(
        "--socket-dir",
        type=Path,
        default=Path("/run/perseus"),
        metavar="DIR",
        help=f"directory of the socket training processes call in on, {SOCKET_NAME} "
        "(default: /run/perseus)",
    )
    agent.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/var/lib/perseus"),
        metavar="DIR",
        help="directory of the record of locked clocks, locked by one agent at a time "
        "(default: /var/lib/perseus)",
    )
    agent.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG") or None,
        metavar="FILE",
        help="Kubernetes mode: the API and credentials to use (default: $KUBECONFIG if set, "
        "else the pod's in-cluster service account)",
    )
    agent.add_argument(
        "--report-interval",
        type=float,
        default=REPORT_INTERVAL_S,
        metavar="SECONDS",
        help="Kubernetes mode: how often the status of every plan is written when it changed, "
        f"besides after every change of plan (default: {REPORT_INTERVAL_S:g})",
    )
    agent.add_argument(
        "--gpu-ownership",
        choices=GPU_OWNERSHIP_MODES,
        default=os.environ.get("PERSEUS_GPU_OWNERSHIP") or "kubelet",
        help="Kubernetes mode: kubelet: manage only the GPUs the kubelet allocated to the job's "
        "pods (PodResources API); local-rank-index: no kubelet (emulated clusters), a pod's "
        "local rank r runs on GPU index r (default: $PERSEUS_GPU_OWNERSHIP, else kubelet)",
    )
    agent.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=Path(os.environ.get("PERSEUS_POD_RESOURCES_SOCKET") or DEFAULT_POD_RESOURCES),
        metavar="PATH",
        help="Kubernetes mode: the kubelet's PodResources socket "
        f"(default: $PERSEUS_POD_RESOURCES_SOCKET, else {DEFAULT_POD_RESOURCES})",
    )
    agent.add_argument(
        "--node-poll-interval",
        type=float,
        default=NODE_POLL_S,
        metavar="SECONDS",
        help="Kubernetes mode: how often the node is read for the GPU Operator's driver upgrade "
        f"state, when the agent lets go of NVML (default: {NODE_POLL_S:g})",
    )
    agent.add_argument(
        "--standalone",
        action="store_true",
        help="no Kubernetes API: apply the NodePlan in --plan-file",
    )
    agent.add_argument(
        "--plan-file",
        type=Path,
        metavar="PLAN.json",
        help="NodePlan (JSON) to apply in --standalone mode; re-applied when it changes",
    )
    agent.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="(default: info)",
    )
    return parser


@dataclass(frozen=True)
class _GpuConfig:
    """What it takes to open the GPUs and find the record of their locks."""

    backend: str
    emulated_gpus: int
    emulated_profile: Path | None  # None: the bundled one
    emulated_blocking_power_w: float
    emulated_state_file: Path | None
    node_name: str  # names the emulated GPUs (their UUIDs); may be empty with nvml
    state_dir: Path
    foreign_clocks: str = "leave"


@dataclass(frozen=True)
class _Config:
    gpu: _GpuConfig
    node_name: str
    metrics_port: int
    metrics_address: str
    socket_dir: Path
    tcp_address: tuple[str, int] | None  # Kubernetes mode; None: Unix socket only
    standalone: bool
    plan_file: Path | None  # standalone mode
    kubeconfig: str | None  # Kubernetes mode; None: in-cluster
    gpu_ownership: str  # Kubernetes mode: "kubelet" or "local-rank-index"
    pod_resources_socket: Path  # Kubernetes mode, kubelet ownership
    report_interval_s: float  # Kubernetes mode
    node_poll_interval_s: float  # Kubernetes mode
    log_level: str

    @property
    def backend(self) -> str:
        return self.gpu.backend

    @property
    def state_dir(self) -> Path:
        return self.gpu.state_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent with ``argv`` (default: the process arguments); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help and usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    from perseus_api.extras import check_extra

    if (missing_extra := check_extra(PROG, "agent")) is not None:
        return missing_extra
    _configure_logging(args.log_level)
    signature: tuple[int, int, int] | None = None
    initial_plan: NodePlan | None = None
    api_client: Any = None
    failure: tuple[str, int] | None = None
    try:
        config = _check_args(args)
        if config.plan_file is not None:
            signature = _signature(config.plan_file)
            initial_plan = _load_plan(config.plan_file, config.node_name)
        else:
            api_client = _api_client(config)
    except (_UsageError, PlanError) as exc:
        failure = (str(exc), EXIT_USAGE)
    except _StartupError as exc:
        failure = (str(exc), EXIT_FAILURE)
    if failure is not None:
        _recover_only(args)
        return _fail(*failure)
    try:
        return _Agent(config).run(initial_plan, signature, api_client)
    except _UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except _StartupError as exc:
        return _fail(str(exc), EXIT_FAILURE)


def _recover_only(args: argparse.Namespace) -> None:
    """The agent will not start: still reset the clocks a previous run left locked.

    Opens the GPUs only when the record names some (or is unreadable), so a wrong flag on a
    node without a record touches nothing, and never while another agent holds the state
    directory (those GPUs are its own).
    """
    from perseus_agent.reset_state import ResetState, StateDirBusyError, StateDirLock
    from perseus_agent.reset_state import needs_recovery as _needs_recovery

    state_dir: Path = args.state_dir
    if not _needs_recovery(state_dir):
        return
    try:
        gpu = _check_gpu_args(args, (args.node_name or "").strip())
    except _UsageError as exc:
        log.error("cannot reset the clocks a previous run left locked: %s", exc)
        return
    try:
        lock = StateDirLock.acquire(state_dir)
    except StateDirBusyError as exc:
        log.warning("%s; leaving the clocks of its GPUs alone", exc)
        return
    except OSError as exc:
        log.error("cannot lock --state-dir %s: %s", state_dir, exc.strerror or exc)
        return
    try:
        backend = _open_backend(gpu)
        try:
            ResetState(state_dir).recover(backend)
        finally:
            backend.close()
    except (_UsageError, _StartupError, GpuError, OSError) as exc:
        log.error("cannot reset the clocks left by a previous run: %s", exc)
    finally:
        lock.release()


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


def _check_args(args: argparse.Namespace) -> _Config:
    if args.standalone and args.plan_file is None:
        raise _UsageError("--standalone needs --plan-file PLAN.json")
    if not args.standalone and args.plan_file is not None:
        raise _UsageError(
            "--plan-file needs --standalone (in Kubernetes mode the plans come from the API)"
        )
    node_name = (args.node_name or "").strip()
    if not node_name:
        raise _UsageError("no node name: pass --node-name or set $NODE_NAME")
    if not 0 <= args.metrics_port <= 65535:
        raise _UsageError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if not args.metrics_address:
        raise _UsageError("--metrics-address must not be empty")
    tcp_address = None
    if args.tcp_address:
        from perseus_agent.tcp_server import parse_listen_address

        if args.standalone:
            raise _UsageError(
                "--tcp-address needs Kubernetes mode (the agent tells TCP peers by their pods)"
            )
        try:
            tcp_address = parse_listen_address(args.tcp_address)
        except ValueError as exc:
            raise _UsageError(f"--tcp-address: {exc}") from None
    if not (math.isfinite(args.report_interval) and args.report_interval > 0):
        raise _UsageError(
            f"--report-interval must be a positive number, got {args.report_interval}"
        )
    if not (math.isfinite(args.node_poll_interval) and args.node_poll_interval > 0):
        raise _UsageError(
            f"--node-poll-interval must be a positive number, got {args.node_poll_interval}"
        )
    return _Config(
        gpu=_check_gpu_args(args, node_name),
        node_name=node_name,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        socket_dir=args.socket_dir,
        tcp_address=tcp_address,
        standalone=args.standalone,
        plan_file=args.plan_file,
        kubeconfig=args.kubeconfig,
        gpu_ownership=args.gpu_ownership,
        pod_resources_socket=args.pod_resources_socket,
        report_interval_s=args.report_interval,
        node_poll_interval_s=args.node_poll_interval,
        log_level=args.log_level,
    )


def _check_gpu_args(args: argparse.Namespace, node_name: str) -> _GpuConfig:
    emulated = args.gpu_backend == "emulated"
    if emulated and not node_name:
        raise _UsageError("no node name: pass --node-name or set $NODE_NAME")
    if not emulated:
        for flag, value in (
            ("--emulated-gpus", args.emulated_gpus),
            ("--emulated-profile", args.emulated_profile),
            ("--emulated-blocking-power", args.emulated_blocking_power),
            ("--emulated-state-file", args.emulated_state_file),
        ):
            if value is not None:
                raise _UsageError(f"{flag} needs --gpu-backend emulated")
    gpus = DEFAULT_EMULATED_GPUS if args.emulated_gpus is None else args.emulated_gpus
    if gpus < 1:
        raise _UsageError(f"--emulated-gpus must be at least 1, got {gpus}")
    power = args.emulated_blocking_power
    if args.emulated_profile is not None and power is None:
        raise _UsageError(
            "--emulated-profile needs --emulated-blocking-power WATTS (the profile's idle power)"
        )
    if power is None:
        power = DEFAULT_BLOCKING_POWER_W
    if not math.isfinite(power) or power <= 0:
        raise _UsageError(f"--emulated-blocking-power must be a positive number, got {power}")
    return _GpuConfig(
        backend=args.gpu_backend,
        emulated_gpus=gpus,
        emulated_profile=args.emulated_profile,
        emulated_blocking_power_w=power,
        emulated_state_file=args.emulated_state_file,
        node_name=node_name,
        state_dir=args.state_dir,
        foreign_clocks=args.foreign_clocks,
    )


def _load_plan(path: Path, node_name: str) -> NodePlan:
    """Read and validate a NodePlan file. Raises PlanError with a message saying what to fix."""
    from perseus_api.node_plan import NodePlan

    try:
        text = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"cannot read plan file {path}: {exc.strerror or exc}") from None
    try:
        plan = NodePlan.model_validate_json(text)
    except ValidationError as exc:
        raise PlanError(f"invalid plan file {path}: {exc}") from None
    if plan.node != node_name:
        raise PlanError(
            f"plan file {path} is for node {plan.node!r}, but this agent runs on {node_name!r}"
        )
    return plan


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _default_profile_path() -> Path:
    # find_spec locates the package without running its __init__, which would load the
    # planner with numba and scipy (~100 MiB) into an agent that only needs one CSV.
    spec = importlib.util.find_spec(DEFAULT_PROFILE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise _UsageError(
            f"the bundled profile (package {DEFAULT_PROFILE_PACKAGE}) is not installed; "
            "pass --emulated-profile"
        )
    return Path(spec.submodule_search_locations[0]) / "profiles" / DEFAULT_PROFILE_FILE


def _open_backend(config: _GpuConfig) -> GpuBackend:
    if config.backend == "nvml":
        from perseus_agent.gpu.nvml import NvmlBackend

        try:
            return NvmlBackend()
        except GpuError as exc:
            raise _StartupError(f"cannot use the NVIDIA GPUs: {exc}") from None

    from perseus_agent.gpu.emulated import EmulatedBackend
    from perseus_api.errors import ProfileError

    profile = config.emulated_profile or _default_profile_path()
    try:
        return EmulatedBackend.from_csv(
            config.emulated_gpus,
            profile,
            blocking_power_w=config.emulated_blocking_power_w,
            node_name=config.node_name,
            state_file=config.emulated_state_file,
        )
    except ProfileError as exc:
        raise _UsageError(f"--emulated-profile {profile}: {exc}") from None
    except OSError as exc:
        raise _UsageError(f"cannot read profile {profile}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise _UsageError(f"cannot emulate GPUs: {exc}") from None


class _Agent:
    def __init__(self, config: _Config) -> None:
        self.config = config
        self._stop = threading.Event()
        self._plan_signature: tuple[int, int, int] | None = None
        self._events: queue.Queue[_PlanEvent] | None = None  # Kubernetes mode's plan events
        self._gpus: ReleasableBackend | None = None
        self._guard: ClockOwnerGuard | None = None
        self._gate: DriverUpgradeGate | None = None  # Kubernetes mode

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._stop.is_set():
            log.info("received %s; resetting clocks and stopping", signal.Signals(signum).name)
        self._stop.set()

    def run(
        self,
        initial_plan: NodePlan | None,
        signature: tuple[int, int, int] | None,
        api_client: Any = None,
    ) -> int:
        """Run until SIGTERM/SIGINT. Standalone: ``initial_plan`` is the plan file's, and
        ``signature`` identifies its version read; Kubernetes mode: both are ``None`` and
        ``api_client`` is the API's (closed when the agent stops)."""
        from perseus_agent.reset_state import StateDirBusyError, StateDirLock

        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        try:
            # Before anything else: a second agent must not reset the GPUs the first one
            # drives, nor rewrite its record, nor take its socket.
            try:
                lock = StateDirLock.acquire(self.config.state_dir)
            except StateDirBusyError as exc:
                raise _StartupError(f"{exc}; this one changed nothing") from None
            except OSError as exc:
                raise _UsageError(
                    f"--state-dir {self.config.state_dir}: {exc.strerror or exc}"
                ) from None
            try:
                return self._run(initial_plan, signature, api_client)
            finally:
                lock.release()  # only once every clock is reset
        finally:
            _close_api_client(api_client)
            for sig, handler in previous.items():
                if handler is not None:  # None: installed outside Python, cannot be restored
                    signal.signal(sig, handler)

    def _run(
        self,
        initial_plan: NodePlan | None,
        signature: tuple[int, int, int] | None,
        api_client: Any,
    ) -> int:
        from perseus_agent.applier import PlanApplier
        from perseus_agent.clock_owners import ClockOwnerGuard, ForeignClockPolicy
        from perseus_agent.exporter import AgentMetrics, GpuCollector, Health, MetricsServer
        from perseus_agent.gpu.releasable import ReleasableBackend
        from perseus_agent.reset_state import ResetState

        config = self.config
        backend = self._gpus = ReleasableBackend(
            _open_backend(config.gpu), lambda: _open_backend(config.gpu)
        )
        # Everything but the recovery of the agent's own leftover locks goes through the guard.
        guard = self._guard = ClockOwnerGuard(
            backend, ForeignClockPolicy(config.gpu.foreign_clocks)
        )
        servers: list[_Server] = []
        health = Health(max_age_s=max(30.0, 10 * PLAN_POLL_S))
        applier: PlanApplier | None = None
        jobs: JobPlans | None = None
        plans: _Plans | None = None
        writer: ReportWriter | None = None
        try:
            try:
                reset_state = ResetState(config.state_dir)
            except OSError as exc:
                raise _UsageError(
                    f"--state-dir {config.state_dir}: {exc.strerror or exc}"
                ) from None
            try:
                reset_state.recover(backend)
                guard.survey(backend.devices())
                if initial_plan is not None:
                    plans = applier = PlanApplier(guard, reset_state, config.node_name)
                    metrics, devices, managed = (
                        applier.metrics,
                        applier.devices,
                        applier.managed_gpus,
                    )
                else:
                    from perseus_agent.kube import JobPlans, ReportWriter, custom_objects_api

                    metrics = AgentMetrics(config.node_name)
                    plans = jobs = JobPlans(
                        guard, reset_state, config.node_name, metrics, _ownership(config)
                    )
                    devices, managed = jobs.devices, jobs.managed_gpus
                    # Lives until the shutdown has reset the clocks, to report that.
                    writer = ReportWriter(custom_objects_api(api_client), on_gone=self._gone)
                    writer.start()
            except (GpuError, OSError) as exc:
                raise _StartupError(
                    f"cannot reset the clocks left by a previous run: {exc}"
                ) from None

            metrics.registry.register(
                GpuCollector(guard, devices, metrics, managed, foreign=guard.foreign)
            )
            try:
                exporter = MetricsServer(
                    metrics.registry, health, config.metrics_address, config.metrics_port
                )
            except OSError as exc:
                raise _StartupError(
                    f"cannot serve metrics on {config.metrics_address}:{config.metrics_port}: "
                    f"{exc.strerror or exc}"
                ) from None
            exporter.start()
            servers.append(exporter)
            log.info("serving metrics on %s/metrics", exporter.url)

            handler: ClientHandler
            if jobs is not None:
                handler = jobs
            else:
                assert applier is not None
                handler = applier
            servers.append(self._start_local_server(handler))
            if config.tcp_address is not None:
                servers.append(self._start_tcp_server(handler, api_client))

            if jobs is not None:
                assert writer is not None
                self._run_kubernetes(jobs, api_client, writer, health)
            else:
                assert applier is not None and initial_plan is not None
                self._run_standalone(applier, initial_plan, signature, health)
        finally:
            health.stop()
            ok = self._shutdown(backend, plans, servers, jobs, writer)
        if not ok:
            return _fail("some GPU clocks could not be reset (see the log)", EXIT_FAILURE)
        log.info("stopped; every clock this agent changed is reset")
        return EXIT_OK

    def _run_standalone(
        self,
        applier: PlanApplier,
        initial_plan: NodePlan,
        signature: tuple[int, int, int] | None,
        health: Health,
    ) -> None:
        config = self.config
        log.info(
            "node %s: %d GPU(s) via %s; plan file %s",
            config.node_name,
            len(applier.devices),
            config.backend,
            config.plan_file,
        )
        self._plan_signature = signature
        self._apply(applier, initial_plan)
        while not self._stop.is_set():
            health.beat()
            self._stop.wait(PLAN_POLL_S)
            if not self._stop.is_set():
                self._poll_plan(applier)

    def _gone(self, namespace: str, name: str) -> None:
        """The report writer found the plan object deleted: handle it as a deletion."""
        events = self._events
        if events is not None:
            events.put(_PlanEvent("delete", (namespace, name)))

    def _run_kubernetes(
        self, jobs: JobPlans, api_client: Any, writer: ReportWriter, health: Health
    ) -> None:
        """Apply and report this node's PerseusNodePlans until SIGTERM/SIGINT."""
        from perseus_agent.driver_release import DriverUpgradeGate
        from perseus_agent.driver_upgrade import UPGRADE_STATE_LABEL
        from perseus_agent.kube import (
            NodeLabelSource,
            NodePlanSource,
            core_v1_api,
            custom_objects_api,
        )

        config = self.config
        api = custom_objects_api(api_client)
        events: queue.Queue[_PlanEvent] = queue.Queue()
        self._events = events
        assert self._gpus is not None and self._guard is not None
        gate = self._gate = DriverUpgradeGate(jobs, self._gpus, self._guard, jobs.metrics)

        def on_upgrade_state(state: str | None) -> None:
            events.put(_PlanEvent("driver", ("", ""), message=state or ""))

        node = NodeLabelSource(
            core_v1_api(api_client),
            config.node_name,
            UPGRADE_STATE_LABEL,
            on_upgrade_state,
            interval_s=config.node_poll_interval_s,
        )

        def on_plan(namespace: str, name: str, plan: NodePlan) -> None:
            events.put(_PlanEvent("plan", (namespace, name), plan=plan))

        def on_delete(namespace: str, name: str) -> None:
            events.put(_PlanEvent("delete", (namespace, name)))

        def on_invalid(namespace: str, name: str, message: str, revision: int | None) -> None:
            events.put(_PlanEvent("invalid", (namespace, name), message=message, revision=revision))

        source = NodePlanSource(api, config.node_name, on_plan, on_delete, on_invalid)
        invalid: dict[tuple[str, str], dict[str, Any]] = {}
        log.info(
            "node %s: %d GPU(s) via %s; watching PerseusNodePlans labelled %s in all namespaces",
            config.node_name,
            len(jobs.devices),
            config.backend,
            source.selector,
        )
        source.start()
        node.start()
        interval_s = config.report_interval_s
        next_report = time.monotonic() + interval_s
        next_ownership = time.monotonic() + OWNERSHIP_REFRESH_S
        try:
            while not self._stop.is_set():
                health.beat()
                wait_s = min(EVENT_POLL_S, max(0.0, next_report - time.monotonic()))
                try:
                    event: _PlanEvent | None = events.get(timeout=wait_s)
                except queue.Empty:
                    event = None
                if self._stop.is_set():
                    break
                if event is not None:
                    try:
                        self._on_plan_event(event, jobs, writer, invalid)
                    except Exception:  # never crash on a plan
                        log.exception("error while handling plan object %s/%s", *event.key)
                if time.monotonic() >= next_report:
                    next_report = time.monotonic() + interval_s
                    if time.monotonic() >= next_ownership:  # pods started, restarted, ended
                        next_ownership = time.monotonic() + OWNERSHIP_REFRESH_S
                        jobs.refresh_ownership()
                    for key in jobs.objects():
                        _submit_status(writer, jobs, key)
                    for key, status in invalid.items():
                        writer.submit(*key, status)
                    for key in gate.retry():  # a driver upgrade over, NVML not back yet
                        _submit_status(writer, jobs, key)
        finally:
            node.stop()
            source.stop()

    def _on_plan_event(
        self,
        event: _PlanEvent,
        jobs: JobPlans,
        writer: ReportWriter,
        invalid: dict[tuple[str, str], dict[str, Any]],
    ) -> None:
        from perseus_agent.kube import invalid_status

        key = event.key
        gate = self._gate
        if gate is not None and gate.handle(event.kind, key, event.plan, event.message, writer):
            return
        invalid.pop(key, None)
        if event.kind == "plan":
            assert event.plan is not None
            changed = jobs.set_plan(key, event.plan)
        elif event.kind == "delete":
            log.info("plan object %s/%s is gone; resetting its GPUs", *key)
            writer.forget(*key)
            changed = jobs.remove(key)
        else:
            jobs.metrics.count_error("invalid_plan")
            changed = jobs.remove(key)  # its previous version's clocks, if any
            invalid[key] = invalid_status(event.message, event.revision)
            writer.submit(*key, invalid[key])
        for other in changed:
            _submit_status(writer, jobs, other)

    def _start_local_server(self, handler: ClientHandler) -> _Server:
        from perseus_agent.local_server import LocalServer

        path = self.config.socket_dir / SOCKET_NAME
        try:
            server = LocalServer(path, handler)
            server.start()
        except ValueError as exc:
            raise _UsageError(f"--socket-dir {self.config.socket_dir}: {exc}") from None
        except AgentError as exc:
            raise _StartupError(str(exc)) from None
        return server

    def _start_tcp_server(self, handler: ClientHandler, api_client: Any) -> _Server:
        from perseus_agent.kube import NodePodLister, core_v1_api
        from perseus_agent.tcp_server import PodAddressBook, TcpServer

        assert self.config.tcp_address is not None
        host, port = self.config.tcp_address
        book = PodAddressBook(
            self.config.node_name, NodePodLister(core_v1_api(api_client), self.config.node_name)
        )
        server = TcpServer(host, port, handler, book.resolve)
        try:
            server.start()
        except AgentError as exc:
            raise _StartupError(str(exc)) from None
        log.info("serving training processes on %s too", server.url)
        return server

    def _poll_plan(self, applier: PlanApplier) -> None:
        path = self.config.plan_file
        assert path is not None
        signature = _signature(path)
        if signature == self._plan_signature:
            return
        self._plan_signature = signature
        if signature is None:
            log.info("plan file %s removed; clearing the plan", path)
            applier.clear()
            return
        try:
            plan = _load_plan(path, self.config.node_name)
        except PlanError as exc:
            self._reject(applier, str(exc))
            return
        self._apply(applier, plan)

    def _apply(self, applier: PlanApplier, plan: NodePlan) -> None:
        try:
            report = applier.apply(plan)
        except PlanError as exc:
            self._reject(applier, str(exc))
        except Exception:  # never crash on a plan
            log.exception("cannot apply the plan in %s; clocks reset", self.config.plan_file)
            applier.metrics.count_error("invalid_plan")
            applier.clear()
        else:
            log.debug("report: %s", report.model_dump_json())

    def _reject(self, applier: PlanApplier, message: str) -> None:
        log.error("%s; clocks reset, waiting for a valid plan", message)
        applier.metrics.count_error("invalid_plan")
        applier.clear()

    def _shutdown(
        self,
        backend: GpuBackend,
        applier: _Plans | None,
        servers: list[_Server],
        jobs: JobPlans | None = None,
        writer: ReportWriter | None = None,
    ) -> bool:
        """Reset every clock; in Kubernetes mode, then mark each plan's status as stopped."""
        ok = True
        # The local server first: no training process may lock a clock after the reset.
        for server in reversed(servers):
            try:
                server.stop()
            except Exception:
                log.exception("error while stopping %s", type(server).__name__)
        revisions: dict[tuple[str, str], int | None] = {}
        if jobs is not None:
            for key in jobs.objects():
                report = jobs.report(key)
                revisions[key] = None if report is None else report.revision
        if applier is not None:
            try:
                applier.clear()
            except Exception:
                log.exception("error while resetting clocks")
            ok = not applier.locked_gpus()
        try:
            backend.close()
        except GpuError as exc:
            log.warning("error while closing the GPU library: %s", exc)
        if writer is not None:
            from perseus_agent.kube import stopped_status

            for key, revision in revisions.items():
                writer.submit(*key, stopped_status(revision, reset_ok=ok))
            writer.stop(timeout_s=STOP_REPORT_TIMEOUT_S)
        return ok


@dataclass(frozen=True)
class _PlanEvent:
    """Kubernetes mode: what the plan source saw, for the agent loop."""

    kind: str  # "plan", "delete" or "invalid"
    key: tuple[str, str]  # namespace, name of the object
    plan: NodePlan | None = None
    message: str = ""
    revision: int | None = None


def _ownership(config: _Config) -> Ownership:
    from perseus_agent.gpu_ownership import KubeletOwnership, LocalRankIndexOwnership

    if config.gpu_ownership == "local-rank-index":
        log.warning(
            "--gpu-ownership=local-rank-index: a pod's local rank r is taken to run on GPU "
            "index r, without asking the kubelet; only for clusters without one"
        )
        return LocalRankIndexOwnership()
    from perseus_agent.pod_resources import PodResourcesClient

    socket = config.pod_resources_socket
    if not socket.exists():
        log.error(
            "the kubelet's PodResources socket %s does not exist: no GPU will be managed until "
            "it does (mount /var/lib/kubelet/pod-resources, or pass "
            "--gpu-ownership=local-rank-index on a cluster without a kubelet)",
            socket,
        )
    return KubeletOwnership(PodResourcesClient(str(socket)))


def _submit_status(writer: ReportWriter, jobs: JobPlans, key: tuple[str, str]) -> None:
    status = jobs.status(key)
    if status is not None:
        writer.submit(*key, status)


def _api_client(config: _Config) -> Any:
    """The Kubernetes API client; a configuration that cannot be loaded is fatal."""
    from perseus_agent.kube import KubeConfigError, load_api_client

    try:
        return load_api_client(config.kubeconfig)
    except KubeConfigError as exc:
        raise _StartupError(str(exc)) from None


def _close_api_client(api_client: Any) -> None:
    close = getattr(api_client, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            log.debug("error while closing the Kubernetes client", exc_info=True)


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
