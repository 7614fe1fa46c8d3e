"""``perseus-operator``: run the kopf operator with the Perseus handlers.

Settings are ``PERSEUS_OPERATOR_*`` environment variables (see
:class:`perseus_operator.config.OperatorConfig`); the command line chooses what to watch and
the health endpoint. With ``PERSEUS_OPERATOR_LEADER_ELECTION_NAMESPACE`` set, the process
waits for the leader Lease before it starts kopf, and exits the moment it loses it
(:mod:`perseus_operator.cluster.leader_election`). Its health and metrics endpoints are served
from the start, while it waits too (:mod:`perseus_operator.endpoints`). ``--hook`` runs one
of the chart's Helm hooks instead (:mod:`perseus_operator.chart_hooks`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import socket
import sys
import urllib.parse
import uuid
from collections.abc import Sequence
from pathlib import Path

from perseus_api.extras import check_extra
from perseus_operator.cluster.leader_election import Elector
from perseus_operator.config import ConfigError, OperatorConfig
from perseus_operator.endpoints import (
    EndpointServer,
    Limits,
    Phase,
    ProcessHealth,
    metrics_route,
    probe_http,
    verdict_route,
)
from perseus_operator.metrics import ProcessMetrics

log = logging.getLogger("perseus_operator")
LOST_LEASE_EXIT_CODE = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perseus-operator",
        description="Kubernetes operator that removes energy bloat from large-model training.",
    )
    from perseus_api.version import distribution_version

    parser.add_argument("--version", action="version", version=f"%(prog)s {distribution_version()}")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="manage PerseusJobs (and apply PerseusPolicies) in this namespace only "
        "(repeatable; default: all namespaces)",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8081/healthz",
        help="health endpoint, served by every replica from its start (leader or standby): "
        "its path answers liveness, /readyz beside it readiness (default: %(default)s); '' "
        "disables both",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--hook",
        choices=["before-uninstall", "test"],
        help="run a Helm hook of the chart and exit: before-uninstall deletes every "
        "PerseusPolicy and PerseusJob and waits until the running operator has reset their "
        "GPUs; test checks the release (CRDs served, operator leading and renewing)",
    )
    webhook = parser.add_argument_group(
        "pod injection webhook (perseus_operator.webhook.injection)"
    )
    webhook.add_argument(
        "--webhook-address",
        default="",
        metavar="HOST:PORT",
        help="serve the mutating admission webhook that gives managed workloads' pods the "
        "agent's address, on every replica (default: off)",
    )
    webhook.add_argument(
        "--webhook-cert-dir",
        type=Path,
        default=Path("/etc/perseus/webhook-tls"),
        metavar="DIR",
        help="directory holding the webhook's tls.crt and tls.key (default: %(default)s)",
    )
    webhook.add_argument(
        "--webhook-max-connections",
        type=int,
        default=32,
        metavar="N",
        help="connections the webhook serves at once; more are closed at accept "
        "(default: %(default)s)",
    )
    webhook.add_argument(
        "--webhook-request-timeout-s",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="time for one webhook request in all, TLS handshake included (default: %(default)s)",
    )
    webhook.add_argument(
        "--webhook-client-ca",
        type=Path,
        default=None,
        metavar="FILE",
        help="serve only clients presenting a certificate this CA signed (the API server's, "
        "where its AdmissionConfiguration gives it one; default: any client)",
    )
    webhook.add_argument(
        "--agent-tcp-port",
        type=int,
        default=7460,
        metavar="PORT",
        help="the agents' TCP port the webhook injects (default: %(default)s)",
    )
    parser.add_argument(
        "--hook-timeout-s", type=float, default=300.0, help="limit of --hook (default: %(default)s)"
    )
    return parser


def _elector(config: OperatorConfig) -> Elector:
    from perseus_operator.cluster.kube.client import load_api_client
    from perseus_operator.cluster.kube.lease_api import LeaseApi

    kubeconfig = config.kubeconfig or os.environ.get("KUBECONFIG", "")
    store = LeaseApi(
        load_api_client(kubeconfig), config.leader_election_namespace, config.leader_election_lease
    )
    identity = config.leader_election_identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    return Elector(store, identity, config.leader_election_timings())


def _start_webhook(args: argparse.Namespace, config: OperatorConfig) -> None:
    """Serve the injection webhook (before the election: standbys serve it too)."""
    from perseus_operator.cluster.kube.blocking_clients import PerseusJobLister
    from perseus_operator.cluster.kube.client import load_api_client
    from perseus_operator.webhook.injection import InjectionConfig
    from perseus_operator.webhook.injection_server import InjectionServer

    host, sep, port = args.webhook_address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--webhook-address: expected HOST:PORT, got {args.webhook_address!r}")
    kubeconfig = config.kubeconfig or os.environ.get("KUBECONFIG", "")
    InjectionServer(
        host.strip("[]"),
        int(port),
        args.webhook_cert_dir / "tls.crt",
        args.webhook_cert_dir / "tls.key",
        PerseusJobLister(load_api_client(kubeconfig)),
        InjectionConfig(agent_port=args.agent_tcp_port),
        max_connections=args.webhook_max_connections,
        request_timeout_s=args.webhook_request_timeout_s,
        client_ca_file=args.webhook_client_ca,
    ).start()


def _health_address(url: str) -> tuple[str, int, str]:
    """``(host, port, path)`` of ``--liveness``; raises ValueError when it is not one."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"--liveness: expected http://HOST:PORT/PATH, got {url!r}")
    path = parts.path or "/healthz"
    if path == READY_PATH:
        raise ValueError(f"--liveness: {READY_PATH} is the readiness path; choose another")
    return parts.hostname, parts.port, path


READY_PATH = "/readyz"


def _loopback_port() -> int:
    """A free port on 127.0.0.1 for kopf's own liveness endpoint (asked by ``/healthz``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _version() -> str:
    try:
        return importlib.metadata.version("perseus-k8s")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _serve_endpoints(
    args: argparse.Namespace, config: OperatorConfig, health: ProcessHealth, metrics: ProcessMetrics
) -> list[EndpointServer]:
    """Serve ``/healthz``, ``/readyz`` and ``/metrics``; raises OSError or ValueError."""
    servers: list[EndpointServer] = []
    try:
        if args.liveness:
            host, port, path = _health_address(args.liveness)
            routes = {path: verdict_route(health.live), READY_PATH: verdict_route(health.ready)}
            servers.append(EndpointServer(host, port, routes).start())
        if config.metrics_port:
            routes = {"/metrics": metrics_route(metrics.registry)}
            servers.append(
                EndpointServer(config.metrics_address, config.metrics_port, routes).start()
            )
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def _lost(reason: str) -> None:
    # Crash-only, as client-go's controllers: a leader that lost its Lease must not make one
    # more API call, and a graceful kopf shutdown would (handlers finishing, finalizers).
    # Kubernetes restarts the container, which then waits as a standby.
    log.critical("lost the leader Lease (%s): exiting", reason)
    logging.shutdown()
    os._exit(LOST_LEASE_EXIT_CODE)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (missing_extra := check_extra("perseus-operator", "operator")) is not None:
        return missing_extra
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":
        # kopf logs every handler run per object at INFO: a line per job per timer tick.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # kopf's liveness endpoint logs every request at INFO: a line per probe.
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        config = OperatorConfig.from_env()  # fail fast, before connecting anywhere
    except ConfigError as exc:
        print(f"perseus-operator: error: {exc}", file=sys.stderr)
        return 2
    if args.hook:
        from perseus_operator.chart_hooks import run_hook

        return run_hook(args.hook, config, args.namespace, timeout_s=args.hook_timeout_s)
    metrics = ProcessMetrics(_version())
    kopf_liveness = f"http://127.0.0.1:{_loopback_port()}/healthz" if args.liveness else None
    health = ProcessHealth(
        Limits(election_stale_s=config.lease_duration_s + 10.0),
        probe_kopf=(lambda: probe_http(kopf_liveness)) if kopf_liveness else (lambda: None),
    )
    try:
        servers = _serve_endpoints(args, config, health, metrics)
    except (OSError, ValueError) as exc:
        print(f"perseus-operator: error: health and metrics endpoints: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, config, health, metrics, kopf_liveness)
    finally:
        for server in servers:
            server.stop()


def _run(
    args: argparse.Namespace,
    config: OperatorConfig,
    health: ProcessHealth,
    metrics: ProcessMetrics,
    kopf_liveness: str | None,
) -> int:
    # Imported (a few seconds: the planner) before waiting for the Lease, so that a standby
    # that takes over starts reconciling at once.
    import kopf

    import perseus_operator.handlers  # registers the handlers

    perseus_operator.handlers.watch_namespaces(args.namespace)
    if args.webhook_address:
        from perseus_operator.cluster.kube.client import KubeError

        try:
            _start_webhook(args, config)
        except (OSError, ValueError, KubeError) as exc:
            print(f"perseus-operator: error: pod injection webhook: {exc}", file=sys.stderr)
            return 2
    elector = None
    if config.leader_election_namespace:
        elector = electing = _elector(config)
        health.election_attempt_s = lambda: electing.last_attempt_s
        health.enter(Phase.STANDBY)
        elector.acquire()
        elector.keep(_lost)
    metrics.leader.set(1)
    health.enter(Phase.LEADER)
    try:
        # standalone: kopf's own peering is off; the Lease above decides who runs. kopf's
        # liveness endpoint is a loopback one, asked by this process's /healthz.
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=kopf_liveness,
            memo=kopf.Memo(perseus_registry=metrics.registry),
        )
    finally:
        if elector is not None and elector.release():
            log.info("released the leader Lease")
    return 0


if __name__ == "__main__":
    sys.exit(main())
