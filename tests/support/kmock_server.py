"""A Kubernetes API for tests: kmock's in-memory emulator served on 127.0.0.1 from a thread.

``kmock`` (PyPI, by kopf's author) emulates the API's CRUD, watch streams and status patches in
memory. Version 0.8 has gaps a real client trips over; :class:`Emulator` closes the ones the
project's components need:

- objects get ``metadata.uid``, ``creationTimestamp``, ``generation`` (bumped when the spec
  changes) and a ``resourceVersion`` that increases with every write (kmock stamps none of them,
  so e.g. kopf's JSON patches that test ``/metadata/resourceVersion`` fail);
- a failed JSON-patch ``test`` operation is HTTP 422, not 500; a create answers 201, not 200;
- ``metadata.generateName`` gives a created object a unique name (kopf's events use it);
- list responses carry ``kind``/``apiVersion`` and a real ``metadata.resourceVersion``;
- the ``status`` subresource: a patch of ``.../status`` changes only ``status``, a patch of the
  object itself never changes ``status`` (kmock merges whatever it is sent into the object);
- label selectors (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-separated) filter lists
  and watches (kmock ignores them; ``enforce_label_selectors=False`` keeps that behaviour so a
  client's own filtering can be tested);
- the collection of namespaces, ``/api/v1/namespaces`` (kmock cannot parse its path): list
  and create, kept apart from the other objects;
- a watch with ``resourceVersion`` does not replay the objects not changed since that version
  (kmock replays every object as ADDED on every watch), and ``timeoutSeconds`` ends it.

- PUT (replace) of an existing object: refused with 409 when its ``metadata.resourceVersion``
  is not the stored one (leader election's conditional renewals), else applied as a merge
  patch of the new ``metadata``/``spec`` (good enough for the Lease's fixed fields; the check
  and the write are not one atomic step).

Still missing (not needed yet): CRD schemas are not enforced, no field selectors, no 410 Gone
(there is no history to expire), and deletions that happen between a list and the next watch
are not replayed.

Usage::

    resource = "perseus.energy/v1alpha1/perseusnodeplans"
    info = {"kind": "PerseusNodePlan", "namespaced": True, "subresources": {"status"}}
    with KmockServer({resource: info}) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        ...  # any Kubernetes client on kubeconfig; server.objects(resource) to assert on
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import attrs
import jsonpatch  # kmock's own dependency
import kmock
from kmock._internal import rendering  # Request / Payload types of the handler hooks

__all__ = ["Emulator", "KmockServer", "label_selector_matches"]

START_TIMEOUT_S = 10.0
_NAMESPACES_PATH = "/api/v1/namespaces"


def label_selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` match an equality-based label ``selector`` (set-based: unsupported)."""
    for raw in selector.split(","):
        term = raw.strip()
        if not term:
            continue
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.split("=", 1))
            if labels.get(key) != value.lstrip("="):
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    metadata = obj.get("metadata") or {}
    labels = metadata.get("labels") or {}
    return labels if isinstance(labels, Mapping) else {}


def _resource_version(obj: Mapping[str, Any]) -> int | None:
    value: Any = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class _TestServer(aiohttp.test_utils.RawTestServer):
    """aiohttp's test server, but its shutdown does not wait a minute for open watch streams."""

    async def _make_runner(self, debug: bool = True, **kwargs: Any) -> aiohttp.web.ServerRunner:
        server = aiohttp.web.Server(self._handler, loop=self._loop, debug=debug, **kwargs)
        return aiohttp.web.ServerRunner(server, debug=debug, shutdown_timeout=0.5, **kwargs)


class Emulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the fixes listed in the module docstring."""

    enforce_label_selectors: bool = True

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._revisions = itertools.count(1000)
        self.last_resource_version = "999"
        self.namespace_objects: dict[str, dict[str, Any]] = {}

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") == _NAMESPACES_PATH:
            return await self._serve_namespaces(raw_request)
        return await super().__call__(raw_request)

    async def _serve_namespaces(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.Response:
        if raw.method == "POST":
            body = await raw.json()
            name = (body.get("metadata") or {}).get("name")
            if not name:
                return aiohttp.web.json_response({"code": 422, "message": "no name"}, status=422)
            async with self._lock:
                if name in self.namespace_objects:
                    return aiohttp.web.json_response(
                        {"code": 409, "message": f"namespace {name} exists"}, status=409
                    )
                metadata = body["metadata"]
                metadata.update(
                    uid=str(uuid.uuid4()), resourceVersion=self._next_resource_version()
                )
                self.namespace_objects[name] = body
            return aiohttp.web.json_response(body, status=201)
        if raw.method == "GET":
            async with self._lock:
                items = [copy.deepcopy(o) for o in self.namespace_objects.values()]
            selector = raw.query.get("labelSelector")
            if selector and self.enforce_label_selectors:
                items = [i for i in items if label_selector_matches(selector, _labels(i))]
            listing = {
                "apiVersion": "v1",
                "kind": "NamespaceList",
                "metadata": {"resourceVersion": self.last_resource_version},
                "items": items,
            }
            return aiohttp.web.json_response(listing)
        return aiohttp.web.json_response({"code": 405, "message": raw.method}, status=405)

    def _next_resource_version(self) -> str:
        self.last_resource_version = str(next(self._revisions))
        return self.last_resource_version

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None and request.method == "PUT" and request.name:
            request = await self._replace_as_patch(request)
        if request.resource is not None:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._stamp_create(request)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                await self._stamp_update(request)
        try:
            return await super()._handle(request)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None

    async def _replace_as_patch(self, request: rendering.Request) -> rendering.Request:
        assert request.resource is not None
        key: Any = (request.resource, request.namespace, request.name)
        body = request.data if isinstance(request.data, dict) else {}
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesError(status=404, reason="NotFound", message="not found")
            stored = (self.objects[key].raw.get("metadata") or {}).get("resourceVersion")
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != stored:
            raise kmock.KubernetesError(
                status=409, reason="Conflict", message=f"resourceVersion {wanted} != {stored}"
            )
        patch = {k: copy.deepcopy(body[k]) for k in ("metadata", "spec") if k in body}
        patch.get("metadata", {}).pop("resourceVersion", None)
        patched = attrs.evolve(
            request, method=kmock.method.PATCH, action=kmock.action.UPDATE, data=patch
        )
        # kmock serves a request only while it is in its log (its reactions filter the log).
        log = self._requests
        log[next(i for i in range(len(log) - 1, -1, -1) if log[i] is request)] = patched
        return patched

    def _stamp_create(self, request: rendering.Request) -> None:
        body: dict[str, Any] = request.data
        metadata = body.setdefault("metadata", {})
        if request.namespace and not metadata.get("namespace"):
            metadata["namespace"] = request.namespace
        if not metadata.get("name") and metadata.get("generateName"):
            metadata["name"] = f"{metadata['generateName']}{uuid.uuid4().hex[:5]}"
        now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        metadata.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=now,
            generation=1,
            resourceVersion=self._next_resource_version(),
        )

    async def _stamp_update(self, request: rendering.Request) -> None:
        assert request.resource is not None
        # kmock's key types say a name is always there; an update request always has one.
        key: Any = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                return  # kmock answers 404
            current = self.objects[key].raw
            rv = self._next_resource_version()
            data = request.data
            if isinstance(data, dict):  # merge patch
                if request.subresource == "status":
                    for field in [k for k in data if k != "status"]:
                        del data[field]
                else:
                    data.pop("status", None)
                    if "spec" in data:
                        patched = kmock.Object(copy.deepcopy(current))
                        patched.patch({"spec": copy.deepcopy(data["spec"])})
                        if patched.raw.get("spec") != current.get("spec"):
                            generation = (current.get("metadata") or {}).get("generation", 1)
                            data.setdefault("metadata", {})["generation"] = generation + 1
                meta = data.get("metadata")
                if not isinstance(meta, dict):
                    meta = data["metadata"] = {}
                meta["resourceVersion"] = rv
            elif isinstance(data, list):  # JSON patch: tests run before the version changes
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": rv})

    async def _serve_create(self, request: rendering.Request) -> Any:
        response: Any = kmock.Response  # type: ignore[attr-defined]  # kmock exports it untyped
        return response(status=201, payload=await super()._serve_create(request))

    async def _serve_list(self, request: rendering.Request) -> Any:
        result: Any = await super()._serve_list(request)  # a list document (dict)
        assert request.resource is not None
        items = result.get("items", [])
        selector = request.params.get("labelSelector")
        if selector and self.enforce_label_selectors:
            items = [i for i in items if label_selector_matches(selector, _labels(i))]
        info = self.resources.get(request.resource) if request.resource in self.resources else None
        kind = getattr(info, "kind", None) or request.resource.plural or ""
        group, version = request.resource.group, request.resource.version
        return {
            "apiVersion": f"{group}/{version}" if group else version,
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": self.last_resource_version},
            "items": items,
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        selector = request.params.get("labelSelector") if self.enforce_label_selectors else None
        since: int | None
        try:
            since = int(request.params.get("resourceVersion", ""))
        except ValueError:
            since = None
        try:
            timeout_s: float | None = float(request.params["timeoutSeconds"])
        except (KeyError, ValueError):
            timeout_s = None
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        events: Any = super()._serve_watch(request)  # an async generator (aclose below)
        try:
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return
                try:
                    event = await asyncio.wait_for(anext(events), remaining)
                except (StopAsyncIteration, TimeoutError):
                    return
                if isinstance(event, dict):
                    obj = event.get("object") or {}
                    if selector and not label_selector_matches(selector, _labels(obj)):
                        continue
                    rv = _resource_version(obj)
                    if event.get("type") == "ADDED" and since and rv is not None and rv <= since:
                        continue  # unchanged since the version the client asked to watch from
                yield event
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()


class KmockServer:
    """An :class:`Emulator` served on ``127.0.0.1`` (a free port) by a background thread.

    Args:
        resources: Resources to declare for discovery, e.g.
            ``{"perseus.energy/v1alpha1/perseusnodeplans": {"kind": "PerseusNodePlan",
            "namespaced": True, "subresources": {"status"}}}`` (fields of
            ``kmock.ResourceInfo``). Objects of undeclared resources can still be created.
        enforce_label_selectors: Filter lists and watches by ``labelSelector``.
        port: The port to listen on (default: a free one).
    """

    def __init__(
        self,
        resources: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        enforce_label_selectors: bool = True,
        port: int | None = None,
    ) -> None:
        self._resources = {k: dict(v) for k, v in (resources or {}).items()}
        self._enforce = enforce_label_selectors
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.emulator: Emulator | None = None
        self.port: int | None = port

    @property
    def url(self) -> str:
        assert self.port is not None, "not started"
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> KmockServer:
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError("kmock did not start in time")
        if self._error is not None:
            raise RuntimeError(f"kmock did not start: {self._error!r}") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)
            if self._thread.is_alive():
                raise RuntimeError("kmock did not stop in time")
            self._thread = None

    def __enter__(self) -> KmockServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start() or visible in the test's failure
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        emulator = Emulator()
        emulator.enforce_label_selectors = self._enforce
        for key, info in self._resources.items():
            emulator.resources[key] = kmock.ResourceInfo(**info)
        server = kmock.Server(emulator, host="127.0.0.1", port=self.port, server_cls=_TestServer)
        async with emulator, server:
            self.emulator = emulator
            self.port = server.port
            self._ready.set()
            await self._stopping.wait()

    def call(self, fn: Callable[[Emulator], Any]) -> Any:
        """Run ``fn(emulator)`` on the server's loop (where its state may be touched)."""
        assert self._loop is not None and self.emulator is not None, "not started"
        emulator = self.emulator

        async def run() -> Any:
            async with emulator._lock:
                return fn(emulator)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(START_TIMEOUT_S)

    def objects(self, resource: str) -> dict[tuple[str | None, str], dict[str, Any]]:
        """A copy of the live objects of ``resource`` (``"group/version/plural"``)."""

        def collect(emulator: Emulator) -> dict[tuple[str | None, str], dict[str, Any]]:
            wanted = kmock.resource(resource)
            return {
                (namespace, name): copy.deepcopy(obj.raw)
                for (res, namespace, name), obj in emulator.objects.items()
                if res == wanted and not obj.deleted
            }

        result: dict[tuple[str | None, str], dict[str, Any]] = self.call(collect)
        return result

    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """Every request served so far (but those of the namespaces' collection), in order:
        its action (``list``, ``watch``, ``fetch``, ``create``, ``update``, ``delete``; the
        HTTP method when it has none),
        the plural of its resource (empty when none) and its query parameters."""

        def collect(emulator: Emulator) -> list[tuple[str, str, dict[str, str]]]:
            return [
                (
                    str(getattr(r.action, "value", r.action or r.method)).lower(),
                    str(getattr(r.resource, "plural", "") or ""),
                    dict(r.params),
                )
                for r in emulator
            ]

        result: list[tuple[str, str, dict[str, str]]] = self.call(collect)
        return result

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """Write a kubeconfig (JSON, which is YAML) for this server to ``path``."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock-test-token"}}],
            "contexts": [
                {
                    "name": "kmock",
                    "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace},
                }
            ],
            "current-context": "kmock",
        }
        path.write_text(json.dumps(config, indent=2))
        return path
