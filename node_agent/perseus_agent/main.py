"""Entry point of the ``perseus-node-agent`` command (the DaemonSet's container command).

Start-up: take the state directory's lock (a second agent on the same directory exits with
status 1 and changes nothing), reset the clocks a previous run of the agent may have left locked
(see :mod:`perseus_agent.clocks.reset_state`), start the metrics server and the local socket
training processes call in on, then apply plans until SIGTERM or SIGINT, when every clock the agent
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
``--pod-resources-socket``; :mod:`perseus_agent.ownership.gpu_ownership`); when the kubelet cannot
be asked (socket absent), no GPU is touched and every assignment is reported ``Failed``
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
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_agent.errors import GpuError, PlanError
from perseus_agent.modes.agent_config import (
    DEFAULT_BLOCKING_POWER_W,
    DEFAULT_EMULATED_GPUS,
    DEFAULT_POD_RESOURCES,
    EXIT_FAILURE,
    EXIT_USAGE,
    GPU_OWNERSHIP_MODES,
    NODE_POLL_S,
    PROG,
    REPORT_INTERVAL_S,
    SOCKET_NAME,
    Config,
    StartupError,
    UsageError,
    check_args,
    check_gpu_args,
    fail,
    open_backend,
)

if TYPE_CHECKING:
    from perseus_agent.modes.agent_lifecycle import Mode

__all__ = ["build_parser", "main"]

log = logging.getLogger("perseus_agent")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Perseus node agent: applies per-GPU frequency plans, exports GPU energy metrics, "
            "and resets every clock it changed when it stops."
        ),
    )
    from perseus_api.version import distribution_version

    parser.add_argument("--version", action="version", version=f"%(prog)s {distribution_version()}")
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
        help="clocks or power limits another owner set before the agent started (an "
        "administrator's nvidia-smi -lgc, -ac or -pl): leave them and skip those GPUs, or "
        "override them and put them back when a plan ends (default: leave)",
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
        default=7461,
        metavar="PORT",
        # Not dcgm-exporter's 9400: both run on GPU nodes, both may use the host network.
        help="port of /metrics and /healthz; 0 picks a free one (default: %(default)s)",
    )
    agent.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="address the metrics server binds (default: %(default)s, this host only; the "
        "chart passes the pod's address; 0.0.0.0 binds all of them)",
    )
    agent.add_argument(
        "--tcp-address",
        default="",
        metavar="HOST:PORT",
        help="also serve training processes over TCP here, the node's address "
        "(e.g. $(HOST_IP):7460 with hostNetwork; Kubernetes mode only: peers are told by their "
        "pod address, see perseus_agent.serving.tcp_server); default: off",
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
    failure: tuple[str, int] | None = None
    try:
        config = check_args(args)
        mode = _mode(config)
    except (UsageError, PlanError) as exc:
        failure = (str(exc), EXIT_USAGE)
    except StartupError as exc:
        failure = (str(exc), EXIT_FAILURE)
    if failure is not None:
        _recover_only(args)
        return fail(*failure)
    from perseus_agent.modes.agent_lifecycle import run_agent

    try:
        return run_agent(config, mode)
    except UsageError as exc:
        return fail(str(exc), EXIT_USAGE)
    except StartupError as exc:
        return fail(str(exc), EXIT_FAILURE)


def _mode(config: Config) -> Mode:
    """The plan file (standalone mode), or the Kubernetes API client."""
    if config.plan_file is not None:
        from perseus_agent.modes.standalone_mode import StandaloneMode

        return StandaloneMode.load(config, config.plan_file)
    from perseus_agent.modes.kubernetes_mode import KubernetesMode

    return KubernetesMode.connect(config)


def _recover_only(args: argparse.Namespace) -> None:
    """The agent will not start: still reset the clocks a previous run left locked.

    Opens the GPUs only when the record names some (or is unreadable), so a wrong flag on a
    node without a record touches nothing, and never while another agent holds the state
    directory (those GPUs are its own).
    """
    from perseus_agent.clocks.reset_state import ResetState, StateDirBusyError, StateDirLock
    from perseus_agent.clocks.reset_state import needs_recovery as _needs_recovery

    state_dir: Path = args.state_dir
    if not _needs_recovery(state_dir):
        return
    try:
        gpu = check_gpu_args(args, (args.node_name or "").strip())
    except UsageError as exc:
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
        backend = open_backend(gpu)
        try:
            ResetState(state_dir).recover(backend)
        finally:
            backend.close()
    except (UsageError, StartupError, GpuError, OSError) as exc:
        log.error("cannot reset the clocks left by a previous run: %s", exc)
    finally:
        lock.release()


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
