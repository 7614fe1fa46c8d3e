"""The operator's mutating admission webhook: HTTPS, in a thread of its own (thin).

``POST /mutate`` takes an ``admission.k8s.io/v1`` AdmissionReview of a pod being created and
answers with :func:`perseus_operator.webhook.injection.admission_response`, after listing the
PerseusJobs of the pod's namespace (one namespaced LIST per pod the webhook is asked about).
``GET /healthz`` answers 200.

Stateless on purpose: every operator replica serves it, leader or standby, so pods are
injected while the replicas elect a leader or one restarts; and no cache can miss a
PerseusJob created just before its workload's pods. When the PerseusJobs cannot be listed the
webhook answers 500 and the API server applies the configuration's ``failurePolicy``
(``Ignore`` by default: the pod is created as written, without the agent's address, and its
training runs with default clocks; ``Fail`` refuses it instead).

The certificate and key are read from files and read again when they change (cert-manager and
the chart's Secret rotate them in place), for the next TLS handshakes.

Exposure. Anyone who reaches the port may post an AdmissionReview, so the server is bounded
(:mod:`perseus_operator.webhook.connection_limits`: connections, whole-request time; a body
over :data:`MAX_REVIEW_BYTES` is refused unread) and answers nothing a caller could not know
without the operator's rights: the patch names no PerseusJob (:mod:`~perseus_operator.webhook.
injection`), and a failure says only that the jobs could not be listed (the details go to the
log). What remains is one bit per call, whether some PerseusJob of the namespace selects a pod
so labelled: keep callers other than the API server out with a NetworkPolicy, and where the API
server presents a client certificate (its AdmissionConfiguration), require it with
``client_ca_file``.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

from perseus_operator.webhook.connection_limits import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT_S,
    Deadlines,
)
from perseus_operator.webhook.injection import InjectionConfig, admission_response

__all__ = ["MAX_REVIEW_BYTES", "InjectionServer"]

log = logging.getLogger(__name__)

MAX_REVIEW_BYTES: Final = 3 * 1024 * 1024
"""An AdmissionReview carries one object (etcd's limit is 1.5 MiB) plus its old version."""

JobLister = Callable[[str], Sequence[Mapping[str, Any]]]
"""Namespace -> its PerseusJobs (API JSON); raises when they cannot be listed."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # the API server keeps connections open

    def setup(self) -> None:
        self.request.do_handshake()  # ssl.SSLError, OSError: socketserver logs and closes
        super().setup()

    def handle_one_request(self) -> None:
        # Each request (and a keep-alive connection's wait for it) gets the whole timeout,
        # from now: slow reads do not extend it.
        self.server.deadlines.arm(self.request, self.server.request_timeout_s)
        super().handle_one_request()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, b"ok\n", "text/plain")
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/mutate":
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            return
        length_text = self.headers.get("Content-Length") or ""
        if self.headers.get("Transfer-Encoding") or not length_text.strip().isdigit():
            self.close_connection = True  # the body's end is unknown: nothing more to read
            self._send(HTTPStatus.LENGTH_REQUIRED, b"Content-Length required\n", "text/plain")
            return
        length = int(length_text)
        if not 0 < length <= MAX_REVIEW_BYTES:
            self.close_connection = True  # the body is left unread
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"bad length\n", "text/plain")
            return
        try:
            review = json.loads(self.rfile.read(length))
            request = review["request"]
            namespace = request.get("namespace") or ""
            if not isinstance(namespace, str):
                raise TypeError("namespace")
        except (ValueError, KeyError, TypeError, AttributeError):
            self._send(HTTPStatus.BAD_REQUEST, b"not an AdmissionReview\n", "text/plain")
            return
        try:
            jobs = self.server.list_jobs(namespace) if namespace else ()
        except Exception as exc:  # the API server decides, by failurePolicy
            log.error("cannot list the PerseusJobs of namespace %s: %s", namespace, exc)
            # Not the exception's text: an API error names the operator's account and rights.
            self._send(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                b"the operator cannot list the PerseusJobs now (see its log)\n",
                "text/plain",
            )
            return
        answer = admission_response(review, jobs, self.server.config)
        if "patch" in answer["response"]:
            obj = request.get("object") or {}
            meta = obj.get("metadata") or {}
            log.info(
                "injecting the agent's address into pod %s/%s",
                namespace,
                meta.get("name") or f"{meta.get('generateName', '')}*",
            )
        self._send(HTTPStatus.OK, json.dumps(answer).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    list_jobs: JobLister
    config: InjectionConfig
    deadlines: Deadlines
    request_timeout_s: float
    max_connections: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open_lock = threading.Lock()
        self._open: set[Any] = set()
        self.refused_connections = 0

    @property
    def open_connections(self) -> int:
        with self._open_lock:
            return len(self._open)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Take the connection only below ``max_connections`` (counted until it closes)."""
        with self._open_lock:
            if len(self._open) >= self.max_connections:
                self.refused_connections += 1
                refused = self.refused_connections
            else:
                self._open.add(request)
                return True
        if refused == 1 or refused % 1000 == 0:
            log.warning(
                "webhook: %d connection(s) refused so far: %d open, the most it serves",
                refused,
                self.max_connections,
            )
        return False

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # can't start new thread: as if refused
            log.error("webhook: cannot start a thread for a connection; closing it")
            self.shutdown_request(request)

    def shutdown_request(self, request: Any) -> None:
        self.deadlines.disarm(request)
        super().shutdown_request(request)
        with self._open_lock:
            self._open.discard(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed TLS handshake, a dropped or timed-out connection: the API server retries.
        log.debug("webhook connection from %s failed", client_address, exc_info=True)


class InjectionServer:
    """Serve the webhook on ``host:port`` (0: a free port, :attr:`port` after :meth:`start`)
    with the PEM ``cert_file`` and ``key_file``; at most ``max_connections`` at once, each
    request within ``request_timeout_s`` (see :mod:`~perseus_operator.webhook.connection_limits`).
    With ``client_ca_file``, only clients presenting a certificate that CA signed are served."""

    def __init__(
        self,
        host: str,
        port: int,
        cert_file: Path,
        key_file: Path,
        list_jobs: JobLister,
        config: InjectionConfig,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        client_ca_file: Path | None = None,
    ) -> None:
        if max_connections < 1 or not request_timeout_s > 0:
            raise ValueError("max_connections and request_timeout_s must be positive")
        self.host, self.port = host, port
        self.cert_file, self.key_file = Path(cert_file), Path(key_file)
        self._list_jobs = list_jobs
        self.config = config
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_ca_file is not None:
            try:
                self._context.load_verify_locations(cafile=str(client_ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise OSError(
                    f"cannot load the webhook's client CA {client_ca_file}: {exc}"
                ) from exc
            self._context.verify_mode = ssl.CERT_REQUIRED
        self._deadlines = Deadlines()
        self._loaded: tuple[float, float] | None = None
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._reload_lock = threading.Lock()

    def _reload(self) -> None:
        """Load the certificate again when its files changed; a broken pair keeps the old."""
        try:
            stamp = (self.cert_file.stat().st_mtime, self.key_file.stat().st_mtime)
        except OSError as exc:
            if self._loaded is None:
                raise OSError(f"cannot read the webhook certificate: {exc}") from exc
            return
        with self._reload_lock:
            if stamp == self._loaded:
                return
            try:
                self._context.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                if self._loaded is None:
                    raise OSError(
                        f"cannot load the webhook certificate {self.cert_file}: {exc}"
                    ) from exc
                log.error("cannot reload the webhook certificate (keeping the old one): %s", exc)
                return
            if self._loaded is not None:
                log.info("reloaded the webhook certificate %s", self.cert_file)
            self._loaded = stamp

    def start(self) -> None:
        """Listen and serve in a daemon thread; raises OSError when it cannot."""
        self._reload()
        server_class: type[_Server] = _Server
        if ":" in self.host:
            server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        httpd = server_class((self.host, self.port), _Handler, bind_and_activate=True)
        httpd.list_jobs = self._list_jobs
        httpd.config = self.config
        httpd.deadlines = self._deadlines
        httpd.request_timeout_s = self.request_timeout_s
        httpd.max_connections = self.max_connections
        context = self._context
        server = self

        def get_request() -> tuple[Any, Any]:
            sock, address = httpd.socket.accept()
            server._reload()
            sock.settimeout(self.request_timeout_s)  # no read outlives the request either
            # The handshake runs in the request's thread (_Handler.setup), not in this loop,
            # on the request's clock (armed here, before the connection is counted).
            wrapped = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            self._deadlines.arm(wrapped, self.request_timeout_s)
            return wrapped, address

        httpd.get_request = get_request  # type: ignore[method-assign]
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, name="perseus-webhook", daemon=True
        )
        self._deadlines.start()
        self._thread.start()
        log.info(
            "serving the pod injection webhook on https://%s:%d/mutate (at most %d connections, "
            "%.0f s per request%s)",
            self.host,
            self.port,
            self.max_connections,
            self.request_timeout_s,
            ", client certificates required" if self._context.verify_mode else "",
        )

    @property
    def open_connections(self) -> int:
        return 0 if self._httpd is None else self._httpd.open_connections

    def stop(self) -> None:
        self._deadlines.stop()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
