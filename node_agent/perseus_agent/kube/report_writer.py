"""Node plan statuses out: :class:`ReportWriter` patches each object's ``status`` subresource.

From a background thread: latest report wins, reports that say nothing new are not sent
(:mod:`perseus_agent.kube.report_cadence`: a dead-band on the iteration times and a heartbeat,
when the writer is given a cadence; else only unchanged ones are held back), conflicts,
throttling, server errors and connection errors are retried a bounded number of times, and
nothing raises into the agent loop. Needs RBAC: ``patch`` on ``perseusnodeplans/status``. The
documents it writes are :mod:`perseus_agent.plans.plan_status`'s.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from perseus_agent.kube import ObjectKey
from perseus_agent.kube.report_cadence import ReportCadence, write_due
from perseus_api import resources
from perseus_api.conventions import now_rfc3339, transition_time
from perseus_api.kube_client import describe_api_error, http_status

__all__ = ["ReportWriter"]

log = logging.getLogger(__name__)

_RETRIABLE_HTTP: Final = frozenset({409, 429, 500, 502, 503, 504})


class ReportWriter:
    """Writes node plan statuses (the ``status`` subresource), never raising.

    :meth:`submit` queues a status for a background thread (the latest one per object wins);
    :meth:`write` patches at once. A status equal to the last one written for the object is
    not sent again (:meth:`forget` an object when it is deleted); with a ``cadence``, neither
    is one that differs only by iteration times within the dead-band, until the heartbeat is
    due (:func:`~perseus_agent.kube.report_cadence.write_due`), and every report says the
    cadence. Each condition keeps its ``lastTransitionTime`` while its status stays the same.

    Args:
        api: A ``kubernetes.client.CustomObjectsApi``.
        attempts: Tries per write, for conflicts, throttling, server and connection errors.
        on_gone: Called with (namespace, name) when the object turns out not to exist.
        retry_delay_s: Delay before the second try; doubles with each further try.
        request_timeout_s: Timeout of each request.
        cadence: When reports are worth writing (None: whenever they change at all).
    """

    def __init__(
        self,
        api: Any,
        *,
        attempts: int = 4,
        retry_delay_s: float = 0.5,
        request_timeout_s: float = 10.0,
        on_gone: Callable[[str, str], None] | None = None,
        cadence: ReportCadence | None = None,
    ) -> None:
        self._api = api
        self._cadence = cadence
        self._written_at: dict[ObjectKey, float] = {}  # monotonic seconds
        self.sent = 0
        """Statuses written (for the logs and the tests)."""
        self.held = 0
        """Statuses not written: nothing new in them."""
        self._on_gone = on_gone
        self._attempts = max(1, attempts)
        self._retry_delay_s = retry_delay_s
        self._request_timeout_s = request_timeout_s
        self._lock = threading.Condition()
        self._pending: dict[ObjectKey, dict[str, Any]] = {}
        self._written: dict[ObjectKey, dict[str, Any]] = {}
        self._epochs: dict[ObjectKey, int] = {}  # bumped by forget()
        self._busy = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="perseus-reports", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is pending (for up to ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Queue ``status`` for the object (replacing one not written yet)."""
        with self._lock:
            self._pending[(namespace, name)] = dict(status)
            self._lock.notify_all()

    def forget(self, namespace: str, name: str) -> None:
        """The object is gone: drop its pending status and what was written to it."""
        with self._lock:
            self._pending.pop((namespace, name), None)
            self._written.pop((namespace, name), None)
            self._written_at.pop((namespace, name), None)
            self._epochs[(namespace, name)] = self._epochs.get((namespace, name), 0) + 1

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is pending; ``False`` if that took longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                    return not (self._pending or self._busy)
                self._lock.wait(remaining)
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stop.is_set():
                    self._lock.wait()
                if not self._pending:
                    return
                key = next(iter(self._pending))
                status = self._pending.pop(key)
                self._busy = True
            try:
                self.write(*key, status)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def write(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Patch the object's status now; ``True`` once written (or unchanged)."""
        key = (namespace, name)
        with self._lock:
            previous = self._written.get(key)
            written_at = self._written_at.get(key)
            epoch = self._epochs.get(key, 0)
        document = _with_transition_times(status, previous)
        cadence = self._cadence
        if cadence is None:
            due = document != previous
        else:
            document = cadence.stamp(document)
            since_s = math.inf if written_at is None else time.monotonic() - written_at
            due = (
                write_due(previous, document, since_written_s=since_s, cadence=cadence) is not None
            )
        if not due:
            with self._lock:
                self.held += 1
            return True
        delay = self._retry_delay_s
        for attempt in range(1, self._attempts + 1):
            try:
                self._api.patch_namespaced_custom_object_status(
                    resources.GROUP,
                    resources.VERSION,
                    namespace,
                    resources.NODE_PLAN_PLURAL,
                    name,
                    {"status": document},
                    _request_timeout=self._request_timeout_s,
                )
            except Exception as exc:
                code = http_status(exc)
                if code == 404:
                    log.debug("%s/%s is gone; its status is not written", namespace, name)
                    if self._on_gone is not None:
                        # A deletion the watch missed (e.g. between a list and the next watch):
                        # the plan must not stay applied.
                        self._on_gone(namespace, name)
                    return False
                retriable = code is None or code in _RETRIABLE_HTTP
                if not retriable or attempt == self._attempts or self._stop.is_set():
                    log.error(
                        "cannot write the status of %s %s/%s (try %d of %d): %s",
                        resources.NODE_PLAN_KIND,
                        namespace,
                        name,
                        attempt,
                        self._attempts,
                        describe_api_error(exc),
                    )
                    return False
                log.debug("status of %s/%s: %s; retrying", namespace, name, describe_api_error(exc))
                self._stop.wait(delay)
                delay *= 2
                continue
            with self._lock:
                self.sent += 1
                if self._epochs.get(key, 0) == epoch:  # not forgotten meanwhile
                    self._written[key] = document
                    self._written_at[key] = time.monotonic()
            return True
        return False  # pragma: no cover - the loop always returns


def _with_transition_times(
    status: Mapping[str, Any], previous: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``status`` with each condition's ``lastTransitionTime``: the previous one's if the
    condition's status did not change, else now."""
    before = {
        c.get("type"): c for c in (previous or {}).get("conditions") or () if isinstance(c, Mapping)
    }
    now = now_rfc3339()
    conditions = []
    for c in status.get("conditions") or ():
        old = before.get(c.get("type")) or {}
        since = transition_time(c["status"], old.get("status"), old.get("lastTransitionTime"), now)
        conditions.append({**c, "lastTransitionTime": since})
    return {**status, "conditions": conditions}
