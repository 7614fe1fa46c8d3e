"""The node agent's HTTP server: ``/metrics`` (a registry, :mod:`perseus_agent.exporter`) and
``/healthz`` (:class:`Health`, the agent loop's liveness), in a background thread."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["Health", "MetricsServer"]

log = logging.getLogger(__name__)


@dataclass
class Health:
    """Liveness of the agent loop: alive while :meth:`beat` is called often enough.

    Args:
        max_age_s: How long after the last beat the agent still counts as alive.
        clock: Monotonic clock, in seconds.
    """

    max_age_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _last_beat: float | None = field(default=None, init=False)
    _stopped: bool = field(default=False, init=False)

    def beat(self) -> None:
        self._last_beat = self.clock()

    def stop(self) -> None:
        """The loop has ended: unhealthy from now on."""
        self._stopped = True

    def alive(self) -> bool:
        last = self._last_beat
        return not self._stopped and last is not None and self.clock() - last <= self.max_age_s


class MetricsServer:
    """HTTP server of ``/metrics`` and ``/healthz`` in a background thread.

    Args:
        registry: What ``/metrics`` serves.
        health: What ``/healthz`` reports (200 ``ok`` or 503).
        address: Address to bind (``0.0.0.0`` for all IPv4 interfaces, ``::`` for IPv6).
        port: TCP port; 0 picks a free one (see :attr:`port`).

    Raises:
        OSError: The address cannot be bound (in the constructor).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        health: Health,
        address: str = "0.0.0.0",
        port: int = 9400,
    ) -> None:
        handler = _handler_class(registry, health)
        server_class = _IPv6Server if ":" in address else ThreadingHTTPServer
        self._server = server_class((address, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            # Wake-ups cost the idle agent CPU; stop() wakes the loop itself.
            kwargs={"poll_interval": _POLL_S},
            name="perseus-metrics",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            stopper = threading.Thread(target=self._server.shutdown, daemon=True)
            stopper.start()
            # shutdown() only sets a flag the loop reads after select() returns: a connection
            # makes select() return now rather than at the end of the poll interval.
            while stopper.is_alive():
                self._poke()
                stopper.join(0.05)
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def _poke(self) -> None:
        host = "::1" if ":" in self.address else "127.0.0.1"
        if self.address not in ("0.0.0.0", "::"):
            host = self.address
        with contextlib.suppress(OSError), socket.create_connection((host, self.port), 0.05):
            pass


_POLL_S: Final = 30.0


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler_class(registry: CollectorRegistry, health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "perseus-node-agent"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                try:
                    body = encoder(registry)
                except Exception:
                    log.exception("metrics scrape failed")
                    self._reply(500, b"scrape failed\n", "text/plain; charset=utf-8")
                    return
                self._reply(200, body, content_type)
            elif path == "/healthz":
                if health.alive():
                    self._reply(200, b"ok\n", "text/plain; charset=utf-8")
                else:
                    self._reply(503, b"agent loop not running\n", "text/plain; charset=utf-8")
            else:
                self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s - %s", self.address_string(), format % args)

    return Handler
