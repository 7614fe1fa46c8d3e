"""A kubelet's probes, for containers run as local processes: startup, liveness, readiness.

:class:`Prober` runs a container's ``startupProbe``, ``livenessProbe`` and ``readinessProbe``
(``httpGet`` and ``tcpSocket``, as a pod spec writes them) the way the kubelet's prober does:

- until the startup probe has succeeded once, only it runs; ``failureThreshold`` failures in a
  row and the kubelet would restart the container;
- then liveness and readiness run, each every ``periodSeconds`` (after ``initialDelaySeconds``
  from the container's start); ``failureThreshold`` liveness failures in a row: restart;
  readiness turns True after ``successThreshold`` successes in a row and False after
  ``failureThreshold`` failures in a row (it starts False);
- an HTTP probe succeeds on a status from 200 to 399 within ``timeoutSeconds``.

A restart the kubelet would make is recorded (:attr:`Prober.restarts`, with the reason), not
made: the tests assert there is none. Named ports resolve through the container's ``ports``;
``port_map`` maps a container port to the local port its process listens on (each "pod" of a
test has its own), as a pod's IP would.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULTS = {
    "initialDelaySeconds": 0,
    "periodSeconds": 10,
    "timeoutSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 3,
}
"""The API server's defaults for unset probe fields."""


def probe_field(probe: Mapping[str, Any], name: str) -> float:
    return float(probe.get(name, DEFAULTS[name]))


def container_port(container: Mapping[str, Any], port: int | str) -> int:
    """The number of ``port`` (a number or the name of one of the container's ports)."""
    if isinstance(port, int):
        return port
    for entry in container.get("ports") or ():
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise AssertionError(f"probe port {port!r} is not a port of container {container['name']}")


@dataclass
class _State:
    started: bool = False
    ready: bool = False
    successes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)


class Prober:
    """Probes ``container`` (a pod spec's container) in a thread, until :meth:`stop`.

    Args:
        container: The container spec, probes and ports as rendered.
        port_map: Container port -> local port of this "pod"'s process.
        host: Where the process listens.
    """

    def __init__(
        self, container: Mapping[str, Any], port_map: Mapping[int, int], host: str = "127.0.0.1"
    ) -> None:
        self.container = container
        self.port_map = dict(port_map)
        self.host = host
        self.restarts: list[str] = []
        self.log: list[tuple[float, str, bool, str]] = []
        """(seconds since start, probe, succeeded, detail) of every probe run."""
        self._state = _State()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kubelet-prober", daemon=True)
        self.ready_since: float | None = None

    def start(self) -> Prober:
        self._started_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._state.ready

    @property
    def started(self) -> bool:
        with self._lock:
            return self._state.started

    def run_probe(self, probe: Mapping[str, Any]) -> tuple[bool, str]:
        """One run of ``probe``: (success, what it saw)."""
        timeout_s = probe_field(probe, "timeoutSeconds")
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = self.port_map[container_port(self.container, get["port"])]
            url = f"http://{self.host}:{port}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as response:
                    status = int(response.status)
                    body = response.read(200).decode(errors="replace").strip()
            except urllib.error.HTTPError as exc:
                status, body = int(exc.code), exc.read(200).decode(errors="replace").strip()
            except OSError as exc:
                return False, f"{url}: {exc}"
            return 200 <= status < 400, f"{url}: {status} {body}"
        if "tcpSocket" in probe:
            port = self.port_map[container_port(self.container, probe["tcpSocket"]["port"])]
            try:
                with socket.create_connection((self.host, port), timeout_s):
                    return True, f"tcp {port}: open"
            except OSError as exc:
                return False, f"tcp {port}: {exc}"
        raise AssertionError(f"probe kind not supported here: {sorted(probe)}")

    def _run(self) -> None:
        probes = {
            kind: self.container[key]
            for kind, key in (
                ("startup", "startupProbe"),
                ("liveness", "livenessProbe"),
                ("readiness", "readinessProbe"),
            )
            if self.container.get(key)
        }
        if "startup" not in probes:
            self._state.started = True
        next_at = {
            kind: self._started_at + probe_field(p, "initialDelaySeconds")
            for kind, p in probes.items()
        }
        while not self._stop.is_set():
            now = time.monotonic()
            for kind, probe in probes.items():
                if kind != "startup" and not self.started:
                    continue
                if kind == "startup" and self.started:
                    continue
                if now < next_at[kind]:
                    continue
                next_at[kind] = now + probe_field(probe, "periodSeconds")
                ok, detail = self.run_probe(probe)
                self._record(kind, probe, ok, detail)
            self._stop.wait(0.05)

    def _record(self, kind: str, probe: Mapping[str, Any], ok: bool, detail: str) -> None:
        with self._lock:
            state = self._state
            self.log.append((round(time.monotonic() - self._started_at, 2), kind, ok, detail))
            if ok:
                state.failures[kind] = 0
                state.successes[kind] = state.successes.get(kind, 0) + 1
            else:
                state.successes[kind] = 0
                state.failures[kind] = state.failures.get(kind, 0) + 1
            failed_out = state.failures.get(kind, 0) >= probe_field(probe, "failureThreshold")
            succeeded = state.successes.get(kind, 0) >= probe_field(probe, "successThreshold")
            if kind == "startup":
                if succeeded:
                    state.started = True
                elif failed_out:
                    self.restarts.append(f"startup probe failed: {detail}")
                    state.failures[kind] = 0
            elif kind == "liveness" and failed_out:
                self.restarts.append(f"liveness probe failed: {detail}")
                state.failures[kind] = 0
            elif kind == "readiness":
                if succeeded and not state.ready:
                    state.ready = True
                    self.ready_since = time.monotonic()
                elif failed_out and state.ready:
                    state.ready = False
                    self.ready_since = None
