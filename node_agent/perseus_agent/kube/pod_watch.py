"""This node's pods from the Kubernetes API: a list, then a watch, as callbacks.

Who a training connection comes from (a TCP peer's address, a Unix peer's cgroup pod UID) is
told by the pods of the node as the API server says they are *now*: :class:`NodePodWatch` lists
them (field selector ``spec.nodeName``) and then watches them in a background thread, and hands
each full listing and each change over (:mod:`perseus_agent.ownership.node_pods` keeps them). No
request is made on a connection's path, so neither a slow API server nor a flood of strangers
holds a training process up or costs an API call per connection: the watch costs one request
per ``watch_timeout_s`` whatever happens. Needs RBAC: ``list`` and ``watch`` on ``pods`` in all
namespaces (RBAC cannot require the field selector).

It resumes after a watch ends, expires (410 Gone: it lists again) or fails (connection errors:
exponential backoff), and says when it lost the API (``on_lost``) so that the pods' view can
age.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from perseus_agent.kube import REQUEST_TIMEOUT_S, close_response
from perseus_agent.kube.watch_stream import Backoff, lines, list_version, watch_arguments
from perseus_api.kube_client import describe_api_error, http_status

__all__ = ["NodePodWatch"]

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S: Final = 300
MIN_BACKOFF_S: Final = 0.5
MAX_BACKOFF_S: Final = 30.0
_HTTP_GONE: Final = 410
_HINTS: Final = {
    401: " (the agent's credentials are not accepted)",
    403: " (the agent's service account needs list and watch on pods in all namespaces)",
}


class _ExpiredError(Exception):
    """The watch's resource version is too old (410 Gone): list again."""


class NodePodWatch:
    """The pods of one node, listed then watched, as callbacks on the watch's thread:

    - ``on_listed(pods)``: every pod of the node (API JSON), after each listing;
    - ``on_event(kind, pod)``: ``ADDED``, ``MODIFIED`` or ``DELETED`` of one pod;
    - ``on_lost(message)``: the API cannot be listed or watched now (retrying).

    A callback that raises is logged. ``api``: a ``kubernetes.client.CoreV1Api``.
    """

    def __init__(
        self,
        api: Any,
        node_name: str,
        on_listed: Callable[[Sequence[Mapping[str, Any]]], None],
        on_event: Callable[[str, Mapping[str, Any]], None],
        on_lost: Callable[[str], None],
        *,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self._api = api
        self.node_name = node_name
        self.field_selector = f"spec.nodeName={node_name}"
        self._on_listed, self._on_event, self._on_lost = on_listed, on_event, on_lost
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._backoff = Backoff(min_backoff_s, max_backoff_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream_lock = threading.Lock()
        self._stream: Any = None
        self.lists = 0
        """Listings made so far (each one LIST request)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="perseus-pods", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._stream_lock:
            response = self._stream
        if response is not None:
            shutdown = getattr(response, "shutdown", None)  # urllib3 >= 2.3: unblocks a read
            try:
                shutdown() if callable(shutdown) else close_response(response)
            except Exception:
                log.debug("error while aborting the pod watch", exc_info=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                version = self._list()
                if failures:
                    log.info("API reachable again; watching the pods of %s", self.node_name)
                failures = 0
                self._backoff.reset()
                while not self._stop.is_set():
                    started = time.monotonic()
                    version = self._watch(version)
                    if time.monotonic() - started < 1.0:  # a server ending watches at once
                        self._stop.wait(MIN_BACKOFF_S)
            except _ExpiredError:
                continue
            except Exception as exc:
                if self._stop.is_set():
                    break
                if http_status(exc) == _HTTP_GONE:
                    continue
                failures += 1
                delay = self._backoff.next()
                message = f"{describe_api_error(exc)}{_HINTS.get(http_status(exc) or 0, '')}"
                (log.error if failures == 1 else log.warning)(
                    "cannot list/watch the pods of node %s: %s; retrying in %.1f s",
                    self.node_name,
                    message,
                    delay,
                )
                self._call(self._on_lost, message)
                self._stop.wait(delay)

    def _list(self) -> str | None:
        response = self._api.list_pod_for_all_namespaces(
            field_selector=self.field_selector,
            _preload_content=False,
            _request_timeout=self._request_timeout_s,
        )
        try:
            body = json.loads(response.data)
        finally:
            close_response(response)
        self.lists += 1
        items = [i for i in body.get("items") or () if isinstance(i, Mapping)]
        self._call(self._on_listed, [i for i in items if self._ours(i)])
        return list_version(body)

    def _watch(self, version: str | None) -> str | None:
        kwargs = watch_arguments(
            version,
            self._watch_timeout_s,
            self._request_timeout_s,
            field_selector=self.field_selector,
        )
        response = self._api.list_pod_for_all_namespaces(**kwargs)
        with self._stream_lock:
            self._stream = response
        try:
            for line in lines(response):
                if self._stop.is_set():
                    break
                version = self._event(line) or version
        finally:
            with self._stream_lock:
                self._stream = None
            close_response(response)
        return version

    def _event(self, line: str) -> str | None:
        try:
            event = json.loads(line)
        except ValueError:
            return None
        if not isinstance(event, Mapping) or not isinstance(event.get("object"), Mapping):
            return None
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            if obj.get("code") == _HTTP_GONE:
                raise _ExpiredError()
            raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
        metadata = obj.get("metadata")
        version = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
        if kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(kind, str):
            # A pod moved off this node (it cannot, but a test API might): gone from it.
            self._call(self._on_event, kind if self._ours(obj) else "DELETED", obj)
        return version if isinstance(version, str) and version else None

    def _ours(self, pod: Mapping[str, Any]) -> bool:
        """Client-side too: an API server (or a stand-in) may ignore the field selector."""
        spec = pod.get("spec")
        return isinstance(spec, Mapping) and spec.get("nodeName") == self.node_name

    def _call(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("error in the pod watch callback")
