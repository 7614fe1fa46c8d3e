"""The operator process's own HTTP endpoints, served by every replica, leader and standby alike.

Why not kopf's: kopf's liveness endpoint and the handlers' metrics server start with kopf, which
runs only once the replica holds the leader Lease. A standby then answered no probe and no
scrape: the kubelet restarted it, a rolling update (``maxUnavailable: 0``) never finished, and
its target read ``up == 0``. So the process serves, from its start:

- ``/healthz`` (liveness) and ``/readyz`` (readiness) on the health address (``--liveness``);
- ``/metrics`` on the metrics address: the process's own series (leader, build info,
  ``process_*``) and, once it leads, the handlers' (they register on the same registry).

What the probes say (:func:`liveness`, :func:`readiness`, pure):

================  ==========================================  =============================
phase             live (restart when not)                     ready (in the Service)
================  ==========================================  =============================
starting          until ``start_s`` (imports, webhook)        no
standby           while its election attempts keep coming     same
leader            kopf's own liveness endpoint answers 200     same
                  (or kopf started less than ``kopf_start_s``
                  ago)
================  ==========================================  =============================

A standby is Ready: it serves the injection webhook and takes over within the Lease's
duration, which is what a Ready replica of a leader-elected controller means (client-go's
controllers report ready on standbys likewise). It is not live when its election loop is stuck
(no attempt, failed or not, for ``election_stale_s``): a restart helps then, and not when the
API server is merely down (the attempts fail, but keep coming).

A leader's liveness is kopf's own check (its event loop answers, its probe handlers run):
kopf serves it on a loopback port and ``/healthz`` asks it, so the port the kubelet probes
never changes hands when a standby becomes the leader.

Every listener is bounded: :data:`MAX_CONNECTIONS` at once, :data:`REQUEST_TIMEOUT_S` each,
GET only, no request body read.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = [
    "MAX_CONNECTIONS",
    "REQUEST_TIMEOUT_S",
    "EndpointServer",
    "Limits",
    "Phase",
    "ProcessHealth",
    "Snapshot",
    "Verdict",
    "liveness",
    "metrics_route",
    "probe_http",
    "readiness",
    "verdict_route",
]

log = logging.getLogger(__name__)

MAX_CONNECTIONS: Final = 16
"""Connections served at once per listener; more are closed at once (a kubelet and a
Prometheus or two need a handful)."""
REQUEST_TIMEOUT_S: Final = 10.0
"""A connection that sends no complete request line and headers for this long is closed."""
_TEXT: Final = "text/plain; charset=utf-8"


class Phase(StrEnum):
    STARTING = "starting"
    """Importing kopf and the handlers, starting the webhook: not yet electing."""
    STANDBY = "standby"
    """Waiting for the leader Lease."""
    LEADER = "leader"
    """Holding the Lease: kopf runs the handlers."""


@dataclass(frozen=True)
class Limits:
    """How long each phase may go without the sign of life it is judged by, seconds."""

    start_s: float = 300.0
    """Longest start-up (imports on a loaded node, the webhook's certificate)."""
    election_stale_s: float = 25.0
    """Longest a standby may go without an election attempt (a few Lease calls of at most
    5 s each, every retry period)."""
    kopf_start_s: float = 60.0
    """Longest a new leader's kopf may take to answer its liveness endpoint."""


@dataclass(frozen=True)
class Snapshot:
    """The process as a probe finds it."""

    phase: Phase
    phase_age_s: float
    """Since the process entered ``phase``."""
    election_age_s: float | None = None
    """Since the last election attempt ended (None: none yet)."""
    kopf_status: int | None = None
    """What kopf's liveness endpoint answered (None: it did not, or was not asked)."""


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str

    @property
    def status(self) -> int:
        return 200 if self.ok else 503


def _election(s: Snapshot, limits: Limits) -> Verdict:
    age = s.election_age_s
    if age is None:
        age = s.phase_age_s  # no attempt has ended yet: count from the phase's start
    if age <= limits.election_stale_s:
        return Verdict(True, "standby: waiting for the leader Lease")
    return Verdict(False, f"standby: no leader election attempt for {age:.0f} s")


def liveness(s: Snapshot, limits: Limits) -> Verdict:
    """Whether the kubelet should leave the process running (see the module's table)."""
    if s.phase is Phase.STARTING:
        if s.phase_age_s <= limits.start_s:
            return Verdict(True, "starting")
        return Verdict(False, f"still starting after {s.phase_age_s:.0f} s")
    if s.phase is Phase.STANDBY:
        return _election(s, limits)
    if s.kopf_status == 200:
        return Verdict(True, "leader")
    if s.phase_age_s <= limits.kopf_start_s:
        return Verdict(True, "leader: kopf starting")
    answer = "no answer" if s.kopf_status is None else f"HTTP {s.kopf_status}"
    return Verdict(False, f"leader: kopf's liveness endpoint: {answer}")


def readiness(s: Snapshot, limits: Limits) -> Verdict:
    """Whether the process belongs in its Services' endpoints (see the module's table)."""
    if s.phase is Phase.STARTING:
        return Verdict(False, "starting")
    if s.phase is Phase.STANDBY:
        return _election(s, limits)
    if s.kopf_status == 200:
        return Verdict(True, "leader")
    return Verdict(False, "leader: kopf starting" if s.kopf_status is None else "leader: unwell")


class ProcessHealth:
    """The phase of the process, and the signs of life its probes are judged by.

    Args:
        limits: What the verdicts allow.
        election_attempt_s: Monotonic time the last election attempt ended (None: none yet).
        probe_kopf: Asks kopf's liveness endpoint; its HTTP status, None when no answer.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        limits: Limits,
        *,
        election_attempt_s: Callable[[], float | None] = lambda: None,
        probe_kopf: Callable[[], int | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.election_attempt_s = election_attempt_s
        self.probe_kopf = probe_kopf
        self._clock = clock
        self._lock = threading.Lock()
        self._phase = Phase.STARTING
        self._since_s = clock()

    @property
    def phase(self) -> Phase:
        return self._phase

    def enter(self, phase: Phase) -> None:
        with self._lock:
            if phase is not self._phase:
                self._phase, self._since_s = phase, self._clock()

    def snapshot(self) -> Snapshot:
        with self._lock:
            phase, since_s = self._phase, self._since_s
        now_s = self._clock()
        attempt_s = self.election_attempt_s() if phase is Phase.STANDBY else None
        kopf = self.probe_kopf() if phase is Phase.LEADER else None
        return Snapshot(
            phase,
            now_s - since_s,
            None if attempt_s is None else max(0.0, now_s - attempt_s),
            kopf,
        )

    def live(self) -> Verdict:
        return liveness(self.snapshot(), self.limits)

    def ready(self) -> Verdict:
        return readiness(self.snapshot(), self.limits)


def probe_http(url: str, timeout_s: float = 3.0) -> int | None:
    """GET ``url``: its HTTP status, None when nothing answers in ``timeout_s``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


Response = tuple[int, bytes, str]
"""Status, body, content type."""
Route = Callable[[Mapping[str, str]], Response]
"""Request headers -> the response."""


def verdict_route(check: Callable[[], Verdict]) -> Route:
    def route(_headers: Mapping[str, str]) -> Response:
        verdict = check()
        return verdict.status, f"{verdict.message}\n".encode(), _TEXT

    return route


def metrics_route(registry: CollectorRegistry) -> Route:
    def route(headers: Mapping[str, str]) -> Response:
        encoder, content_type = choose_encoder(headers.get("Accept", ""))
        try:
            return 200, encoder(registry), content_type
        except Exception:  # a scrape fails alone; the process carries on
            log.exception("metrics scrape failed")
            return 500, b"scrape failed\n", _TEXT

    return route


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    routes: Mapping[str, Route]
    slots: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            log.warning("%s: too many connections; closing one from %s", self, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("endpoint connection from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "perseus-operator"
    timeout = REQUEST_TIMEOUT_S

    def do_GET(self) -> None:
        route = self.server.routes.get(self.path.split("?", 1)[0])
        if route is None:
            paths = ", ".join(sorted(self.server.routes))
            status, body, content_type = 404, f"not found: try {paths}\n".encode(), _TEXT
        else:
            status, body, content_type = route(dict(self.headers.items()))
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class EndpointServer:
    """GET ``routes`` (path -> :data:`Route`) on ``host:port`` in a daemon thread.

    Raises:
        OSError: the address cannot be bound (in the constructor).
    """

    def __init__(self, host: str, port: int, routes: Mapping[str, Route]) -> None:
        server_class = _IPv6Server if ":" in host else _Server
        self._httpd = server_class((host, port), _Handler)
        self._httpd.routes = dict(routes)
        self._httpd.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> EndpointServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="perseus-endpoints", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(5.0)
            self._thread = None
        with contextlib.suppress(OSError):
            self._httpd.server_close()
