"""This node's PerseusNodePlans from the Kubernetes API: a list, then a watch, as callbacks.

:class:`NodePlanSource` lists and then watches the node plans of this node in all namespaces
(label ``perseus.energy/node=<node>``; objects are also checked client-side, by label and by
``spec.node``, and ``spec.namespace`` must be the object's own namespace: the CRD's CEL rules
cannot see ``metadata.namespace``, so the agent is where a plan naming another namespace's
pods is refused) in a background thread, and calls ``on_plan`` for every new or changed plan,
``on_delete`` when one goes away and ``on_invalid`` for a malformed one. It resumes after a
watch ends, expires (410 Gone: it lists again and reports what changed meanwhile) or fails
(connection errors: exponential backoff), and never stops on bad data. Needs RBAC: ``list``
and ``watch`` on ``perseusnodeplans.perseus.energy`` in all namespaces.

It delivers the objects of its first listing in ``creationTimestamp`` order, so that
:func:`perseus_agent.plans.gpu_arbitration.arbitrate_gpus` gives a restarted agent the same winners.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from perseus_agent.kube import REQUEST_TIMEOUT_S, ObjectKey, close_response
from perseus_agent.kube.watch_stream import Backoff, lines, list_version, watch_arguments
from perseus_api import resources
from perseus_api.kube_client import describe_api_error, http_status
from perseus_api.node_plan import NodePlan

__all__ = [
    "DeleteCallback",
    "InvalidCallback",
    "NodePlanSource",
    "PlanCallback",
]

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S: Final = 300
"""Server-side end of each watch request; the source then watches again from where it was."""
MIN_BACKOFF_S: Final = 0.5
MAX_BACKOFF_S: Final = 30.0
_HTTP_GONE: Final = 410
_RBAC_HINT: Final = (
    f" (the agent's service account needs list and watch on {resources.NODE_PLAN_PLURAL}"
    f".{resources.GROUP} in all namespaces, and patch on their status)"
)
_HINTS: Final = {
    401: " (the agent's credentials are not accepted)",
    403: _RBAC_HINT,
    404: f" (is the {resources.NODE_PLAN_KIND} CustomResourceDefinition installed?)",
}


class _WatchExpiredError(Exception):
    """The watch's resource version is too old (410 Gone): list again."""


@dataclass(frozen=True)
class _Seen:
    uid: str | None
    fingerprint: str


PlanCallback = Callable[[str, str, NodePlan], None]
DeleteCallback = Callable[[str, str], None]
InvalidCallback = Callable[[str, str, str, int | None], None]


class NodePlanSource:
    """The node plans of one node, from the Kubernetes API, as callbacks.

    Callbacks run on the source's thread, one at a time, in the order of the events:

    - ``on_plan(namespace, name, plan)``: a plan for this node appeared or its spec changed
      (a status update or a re-listing of an unchanged object calls nothing);
    - ``on_delete(namespace, name)``: a plan delivered before (by ``on_plan`` or
      ``on_invalid``) is gone — deleted, relabelled for another node, or deleted and created
      again (then ``on_plan`` follows);
    - ``on_invalid(namespace, name, message, revision)``: the object is labelled for this node
      but its spec is not a valid NodePlan for it; ``revision`` is ``spec.revision`` if it is
      an integer. The message names the object and the problem. Logged, never raised.

    A callback that raises is logged; the source goes on.

    Args:
        api: A ``kubernetes.client.CustomObjectsApi`` (or anything with its
            ``list_cluster_custom_object``).
        node_name: This node.
        watch_timeout_s: Server-side timeout of each watch request.
        request_timeout_s: Connect timeout, and read timeout of the listing.
        min_backoff_s, max_backoff_s: Retry delays after errors (doubling, with jitter).
    """

    def __init__(
        self,
        api: Any,
        node_name: str,
        on_plan: PlanCallback,
        on_delete: DeleteCallback,
        on_invalid: InvalidCallback | None = None,
        *,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self._api = api
        self.node_name = node_name
        self._label = resources.label_value(node_name)
        self.selector = resources.node_label_selector(node_name)
        self._on_plan = on_plan
        self._on_delete = on_delete
        self._on_invalid = on_invalid
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._backoff = Backoff(min_backoff_s, max_backoff_s)
        self._known: dict[ObjectKey, _Seen] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream_lock = threading.Lock()
        self._stream: Any = None
        self.synced = threading.Event()
        """Set once the first listing has been delivered."""

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start listing and watching in a background (daemon) thread."""
        self._thread = threading.Thread(target=self.run, name="perseus-plans", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching; no callback is called after this returns (unless it times out)."""
        self._stop.set()
        self._abort_stream()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the plan watch did not stop within %.1f s", timeout_s)

    def run(self) -> None:
        """List and watch until :meth:`stop` (the thread's body)."""
        failures = 0
        while not self._stop.is_set():
            try:
                version = self._list()
                if failures:
                    log.info("Kubernetes API reachable again; watching node plans")
                failures = 0
                self._backoff.reset()
                while not self._stop.is_set():
                    started = time.monotonic()
                    version = self._watch(version)
                    if time.monotonic() - started < 1.0:  # a server ending watches at once
                        self._stop.wait(MIN_BACKOFF_S)
            except _WatchExpiredError as exc:
                log.info("watch of node plans expired (%s); listing them again", exc)
            except Exception as exc:
                if self._stop.is_set():
                    break
                if http_status(exc) == _HTTP_GONE:
                    log.info("watch of node plans expired; listing them again")
                    continue
                failures += 1
                delay = self._backoff.next()
                (log.error if failures == 1 else log.warning)(
                    "cannot list/watch %s (%s) for node %s: %s%s; retrying in %.1f s",
                    resources.NODE_PLAN_PLURAL,
                    self.selector,
                    self.node_name,
                    describe_api_error(exc),
                    _HINTS.get(http_status(exc) or 0, ""),
                    delay,
                )
                self._stop.wait(delay)

    # -- listing and watching ----------------------------------------------------------------------

    def _list(self) -> str | None:
        result = self._api.list_cluster_custom_object(
            resources.GROUP,
            resources.VERSION,
            resources.NODE_PLAN_PLURAL,
            label_selector=self.selector,
            _request_timeout=self._request_timeout_s,
        )
        if not isinstance(result, Mapping):
            raise TypeError(f"unexpected list response: {type(result).__name__}")
        items = [i for i in result.get("items") or () if isinstance(i, Mapping)]
        items.sort(key=_creation_order)
        seen: set[ObjectKey] = set()
        for item in items:
            if self._stop.is_set():
                return None
            key = self._upsert(item)
            if key is not None:
                seen.add(key)
        for key in [k for k in self._known if k not in seen]:
            self._gone(key)
        self.synced.set()
        return list_version(result)

    def _watch(self, version: str | None) -> str | None:
        kwargs = watch_arguments(
            version, self._watch_timeout_s, self._request_timeout_s, label_selector=self.selector
        )
        response = self._api.list_cluster_custom_object(
            resources.GROUP, resources.VERSION, resources.NODE_PLAN_PLURAL, **kwargs
        )
        with self._stream_lock:
            self._stream = response
        try:
            if self._stop.is_set():
                return version
            for line in lines(response):
                if self._stop.is_set():
                    break
                version = self._event(line) or version
        finally:
            with self._stream_lock:
                self._stream = None
            close_response(response)
        return version

    def _abort_stream(self) -> None:
        with self._stream_lock:
            response = self._stream
        if response is not None:
            shutdown = getattr(response, "shutdown", None)  # urllib3 >= 2.3: unblocks a read
            try:
                if callable(shutdown):
                    shutdown()
                else:
                    close_response(response)
            except Exception:
                log.debug("error while aborting the watch", exc_info=True)

    def _event(self, line: str) -> str | None:
        """Handle one watch event; returns its resource version, if any."""
        try:
            event = json.loads(line)
        except ValueError:
            log.warning("ignoring a malformed watch event: %.200s", line)
            return None
        if not isinstance(event, Mapping) or not isinstance(event.get("object"), Mapping):
            log.warning("ignoring a malformed watch event: %.200s", line)
            return None
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            code, message = obj.get("code"), obj.get("message", "")
            if code == _HTTP_GONE:
                raise _WatchExpiredError(message or "410 Gone")
            raise RuntimeError(f"watch error {code}: {message}")
        metadata = obj.get("metadata")
        version = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
        if kind in ("ADDED", "MODIFIED"):
            self._upsert(obj)
        elif kind == "DELETED":
            namespace, name = resources.object_key(obj)
            self._gone((namespace, name))
        return version if isinstance(version, str) and version else None

    # -- objects -----------------------------------------------------------------------------------

    def _upsert(self, obj: Mapping[str, Any]) -> ObjectKey | None:
        """Deliver ``obj`` if it is new or changed; its key if it is for this node."""
        namespace, name = resources.object_key(obj)
        if not namespace or not name:
            log.warning("ignoring a %s without namespace or name", resources.NODE_PLAN_KIND)
            return None
        key = (namespace, name)
        metadata = obj.get("metadata")
        labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
        if not isinstance(labels, Mapping) or labels.get(resources.NODE_LABEL) != self._label:
            self._gone(key)  # not for this node (any more)
            return None
        uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
        uid = uid if isinstance(uid, str) else None
        spec = obj.get("spec")
        seen = _Seen(uid, json.dumps(spec, sort_keys=True, default=str))
        known = self._known.get(key)
        if known == seen:
            return key  # a status update, or a re-listing of an unchanged object
        if known is not None and known.uid != uid:
            self._gone(key)  # deleted and created again
        self._known[key] = seen
        try:
            plan = resources.parse_node_plan_object(obj)
            if plan.namespace != namespace:
                # A namespaced object speaks for its own namespace only: whoever may write plans
                # in one namespace must not reach the pods (and GPUs) of another.
                raise resources.NodePlanObjectError(
                    f"{resources.NODE_PLAN_KIND} {namespace}/{name}: spec.namespace is "
                    f"{plan.namespace!r} but the object is in namespace {namespace!r}; a node "
                    "plan manages pods of its own namespace only (the operator writes each plan "
                    "in its job's namespace): nothing of it is applied"
                )
            if plan.node != self.node_name:
                raise resources.NodePlanObjectError(
                    f"{resources.NODE_PLAN_KIND} {namespace}/{name}: spec.node is {plan.node!r}"
                    f" but the object is labelled {resources.NODE_LABEL}={self._label}"
                    f" (node {self.node_name!r})"
                )
        except resources.NodePlanObjectError as exc:
            log.error("%s; ignoring it", exc)
            revision = spec.get("revision") if isinstance(spec, Mapping) else None
            valid_revision = (
                revision if isinstance(revision, int) and not isinstance(revision, bool) else None
            )
            if self._on_invalid is not None:
                self._call(self._on_invalid, namespace, name, str(exc), valid_revision)
            return key
        self._call(self._on_plan, namespace, name, plan)
        return key

    def _gone(self, key: ObjectKey) -> None:
        if self._known.pop(key, None) is not None:
            self._call(self._on_delete, *key)

    def _call(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("error in the node plan callback %s", getattr(callback, "__name__", ""))


def _creation_order(item: Mapping[str, Any]) -> tuple[str, str, str]:
    metadata = item.get("metadata")
    created = metadata.get("creationTimestamp") if isinstance(metadata, Mapping) else None
    namespace, name = resources.object_key(item)
    return (created if isinstance(created, str) else "", namespace, name)
