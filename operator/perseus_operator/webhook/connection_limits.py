"""Bounds on the webhook's connections: how many at once, and how long each request may take.

The webhook runs in the operator's own process (:mod:`perseus_operator.webhook.injection_server`):
a caller holding many slow connections must not take the threads and file descriptors its
reconciles and Lease renewals need. So:

* at most ``max_connections`` connections are open; a further one is closed at accept, before
  its TLS handshake (the API server retries a webhook call, and applies its ``failurePolicy``);
* each request, TLS handshake included, has ``request_timeout_s`` in all, from its start, not
  per read: a byte dripped every few seconds does not extend it. A keep-alive connection waiting
  for its next request is on the same clock (it is closed when that runs out; the API server
  opens a new one).

:class:`Deadlines` enforces the second: one thread shuts down the socket of every request past
its deadline, which ends the blocked read of the request's thread.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Final

__all__ = ["DEFAULT_MAX_CONNECTIONS", "DEFAULT_REQUEST_TIMEOUT_S", "Deadlines"]

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS: Final = 32
"""The API servers call with a few connections each; room for several of them and retries."""
DEFAULT_REQUEST_TIMEOUT_S: Final = 10.0
"""The API server's default webhook timeout (``timeoutSeconds``): later, its answer is unused."""


class Deadlines:
    """Shut down each registered socket at its deadline (``time.monotonic()``), from one
    thread. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._due: dict[socket.socket, float] = {}
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name="perseus-webhook-deadlines", daemon=True
        )
        self.expired = 0
        """Sockets shut down at their deadline so far."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(5.0)

    def arm(self, sock: socket.socket, timeout_s: float) -> None:
        """``sock`` is shut down ``timeout_s`` from now unless disarmed or armed again."""
        with self._lock:
            self._due[sock] = time.monotonic() + timeout_s
            self._lock.notify()

    def disarm(self, sock: socket.socket) -> None:
        with self._lock:
            self._due.pop(sock, None)

    def open(self) -> int:
        """Sockets armed now."""
        with self._lock:
            return len(self._due)

    def _run(self) -> None:
        with self._lock:
            while not self._stopping:
                now = time.monotonic()
                for sock in [s for s, due in self._due.items() if due <= now]:
                    del self._due[sock]
                    self.expired += 1
                    # The plain socket's shutdown, not SSLSocket's (which would also drop its
                    # TLS state under the thread reading it): that read then ends at once.
                    with contextlib.suppress(OSError):
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)
                    log.debug("webhook connection %s ran out of time; closed", sock)
                wait_s = min(self._due.values(), default=now + 60.0) - now
                self._lock.wait(max(0.0, wait_s))
