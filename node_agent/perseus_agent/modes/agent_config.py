"""The node agent's flags checked into a typed configuration, and the GPU backend they name.

Flag values that are wrong raise :class:`UsageError` (exit status 2); what keeps the agent
from starting raises :class:`StartupError` (exit status 1). Parsing the flags is
:mod:`perseus_agent.main`'s; running the agent is :mod:`perseus_agent.modes.agent_lifecycle`'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from perseus_agent.errors import GpuError

if TYPE_CHECKING:
    from perseus_agent.gpu.base import GpuBackend

__all__ = [
    "Config",
    "GpuConfig",
    "StartupError",
    "UsageError",
    "check_args",
    "check_gpu_args",
    "fail",
    "open_backend",
]

PROG: Final = "perseus-node-agent"
DEFAULT_POD_RESOURCES: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
"""As :data:`perseus_agent.ownership.pod_resources.DEFAULT_SOCKET` (not imported: it needs
grpcio)."""
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
REPORT_INTERVAL_S: Final = 10.0
"""Kubernetes mode: default of how often the status of every plan is written (if it changed)."""
NODE_POLL_S: Final = 5.0
"""Kubernetes mode: default of how often the node is read (its GPU driver upgrade state)."""


class UsageError(Exception):
    """A flag value is wrong: exit status 2."""


class StartupError(Exception):
    """The agent cannot start (GPU library, port in use, ...): exit status 1."""


def fail(message: str, status: int) -> int:
    """Say why the agent stops on standard error; returns ``status``."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


@dataclass(frozen=True)
class GpuConfig:
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
class Config:
    """The agent's flags, checked (:func:`check_args`)."""

    gpu: GpuConfig
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


def check_args(args: argparse.Namespace) -> Config:
    if args.standalone and args.plan_file is None:
        raise UsageError("--standalone needs --plan-file PLAN.json")
    if not args.standalone and args.plan_file is not None:
        raise UsageError(
            "--plan-file needs --standalone (in Kubernetes mode the plans come from the API)"
        )
    node_name = (args.node_name or "").strip()
    if not node_name:
        raise UsageError("no node name: pass --node-name or set $NODE_NAME")
    if not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if not args.metrics_address:
        raise UsageError("--metrics-address must not be empty")
    tcp_address = None
    if args.tcp_address:
        from perseus_agent.serving.tcp_server import parse_listen_address

        if args.standalone:
            raise UsageError(
                "--tcp-address needs Kubernetes mode (the agent tells TCP peers by their pods)"
            )
        try:
            tcp_address = parse_listen_address(args.tcp_address)
        except ValueError as exc:
            raise UsageError(f"--tcp-address: {exc}") from None
    if not (math.isfinite(args.report_interval) and args.report_interval > 0):
        raise UsageError(f"--report-interval must be a positive number, got {args.report_interval}")
    if not (math.isfinite(args.node_poll_interval) and args.node_poll_interval > 0):
        raise UsageError(
            f"--node-poll-interval must be a positive number, got {args.node_poll_interval}"
        )
    return Config(
        gpu=check_gpu_args(args, node_name),
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


def check_gpu_args(args: argparse.Namespace, node_name: str) -> GpuConfig:
    emulated = args.gpu_backend == "emulated"
    if emulated and not node_name:
        raise UsageError("no node name: pass --node-name or set $NODE_NAME")
    if not emulated:
        for flag, value in (
            ("--emulated-gpus", args.emulated_gpus),
            ("--emulated-profile", args.emulated_profile),
            ("--emulated-blocking-power", args.emulated_blocking_power),
            ("--emulated-state-file", args.emulated_state_file),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --gpu-backend emulated")
    gpus = DEFAULT_EMULATED_GPUS if args.emulated_gpus is None else args.emulated_gpus
    if gpus < 1:
        raise UsageError(f"--emulated-gpus must be at least 1, got {gpus}")
    power = args.emulated_blocking_power
    if args.emulated_profile is not None and power is None:
        raise UsageError(
            "--emulated-profile needs --emulated-blocking-power WATTS (the profile's idle power)"
        )
    if power is None:
        power = DEFAULT_BLOCKING_POWER_W
    if not math.isfinite(power) or power <= 0:
        raise UsageError(f"--emulated-blocking-power must be a positive number, got {power}")
    return GpuConfig(
        backend=args.gpu_backend,
        emulated_gpus=gpus,
        emulated_profile=args.emulated_profile,
        emulated_blocking_power_w=power,
        emulated_state_file=args.emulated_state_file,
        node_name=node_name,
        state_dir=args.state_dir,
        foreign_clocks=args.foreign_clocks,
    )


def default_profile_path() -> Path:
    # find_spec locates the package without running its __init__, which would load the
    # planner with numba and scipy (~100 MiB) into an agent that only needs one CSV.
    spec = importlib.util.find_spec(DEFAULT_PROFILE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            f"the bundled profile (package {DEFAULT_PROFILE_PACKAGE}) is not installed; "
            "pass --emulated-profile"
        )
    return Path(spec.submodule_search_locations[0]) / "profiles" / DEFAULT_PROFILE_FILE


def open_backend(config: GpuConfig) -> GpuBackend:
    if config.backend == "nvml":
        from perseus_agent.gpu.nvml import NvmlBackend

        try:
            return NvmlBackend()
        except GpuError as exc:
            raise StartupError(f"cannot use the NVIDIA GPUs: {exc}") from None

    from perseus_agent.gpu.emulated import EmulatedBackend
    from perseus_api.errors import ProfileError

    profile = config.emulated_profile or default_profile_path()
    try:
        return EmulatedBackend.from_csv(
            config.emulated_gpus,
            profile,
            blocking_power_w=config.emulated_blocking_power_w,
            node_name=config.node_name,
            state_file=config.emulated_state_file,
        )
    except ProfileError as exc:
        raise UsageError(f"--emulated-profile {profile}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot read profile {profile}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"cannot emulate GPUs: {exc}") from None
