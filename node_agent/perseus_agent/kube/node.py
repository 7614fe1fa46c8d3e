"""This node's own object from the Kubernetes API: one of its labels.

:class:`NodeLabelSource` reads this node's object every few seconds for one label, the GPU
Operator's driver upgrade state (:mod:`perseus_agent.modes.driver_upgrade`), and calls back when
it changes. Needs RBAC: ``get`` on ``nodes``. The node's pods are watched by
:mod:`perseus_agent.kube.pod_watch`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Final

from perseus_agent.kube import REQUEST_TIMEOUT_S
from perseus_api.kube_client import describe_api_error, http_status

__all__ = ["NodeLabelSource"]

log = logging.getLogger(__name__)


NODE_POLL_S: Final = 5.0
"""How often :class:`NodeLabelSource` reads the node (a driver upgrade's states last minutes)."""


_NODE_RBAC_HINT: Final = " (the agent's service account needs get on nodes)"


class NodeLabelSource:
    """One label of this node, read every ``interval_s`` from a background thread:
    ``on_value(value)`` with its value (``None``: no such label, or no such node) at the first
    successful read and whenever it changes. Errors are logged and retried; callbacks that
    raise are logged. Needs RBAC: ``get`` on ``nodes``.

    Polling rather than watching: one small GET per interval, nothing to resume, and the
    upgrade states it follows last minutes.
    """

    def __init__(
        self,
        api: Any,
        node_name: str,
        label: str,
        on_value: Callable[[str | None], None],
        *,
        interval_s: float = NODE_POLL_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self._api = api
        self.node_name = node_name
        self.label = label
        self._on_value = on_value
        self._interval_s = interval_s
        self._request_timeout_s = request_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="perseus-node", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def run(self) -> None:
        seen: tuple[str | None] | None = None  # nothing read yet
        failures = 0
        while not self._stop.is_set():
            try:
                node = self._api.read_node(self.node_name, _request_timeout=self._request_timeout_s)
                labels = getattr(getattr(node, "metadata", None), "labels", None) or {}
                value = labels.get(self.label)
            except Exception as exc:
                if http_status(exc) == 404:
                    value = None
                else:
                    failures += 1
                    (log.error if failures == 1 else log.debug)(
                        "cannot read node %s (for its label %s): %s%s; retrying every %.0f s",
                        self.node_name,
                        self.label,
                        describe_api_error(exc),
                        _NODE_RBAC_HINT if http_status(exc) == 403 else "",
                        self._interval_s,
                    )
                    self._stop.wait(self._interval_s)
                    continue
            failures = 0
            if seen is None or seen[0] != value:
                seen = (value,)
                try:
                    self._on_value(value)
                except Exception:
                    log.exception("error while handling label %s=%s", self.label, value)
            self._stop.wait(self._interval_s)
