"""The power domains' GPU draw read from the Prometheus that scrapes the node agents.

Why Prometheus and not the node plans' reports: every node agent exports the energy counter
of *every* GPU of its node (``perseus_gpu_energy_joules_total``; reading a GPU is not touching
it), a managed one with the labels of its PerseusJob (``job_namespace``, ``job_name``), so one
query per averaging window gives each node's draw split by job, the GPUs no PerseusJob manages
included, at no write to the API server. The node plans' reports carry only the GPUs of a plan
(issue 37 keeps those writes few); they stay the fallback when no URL is set.

The client is bounded: one GET per query, a timeout, a cap on the response's size, a cap on its
series. Any failure raises :class:`PrometheusDrawError`; the controller then falls back to the
reports for that round.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from http.client import HTTPResponse
from typing import Any, Final

__all__ = [
    "DRAW_QUERY",
    "MAX_RESPONSE_BYTES",
    "MAX_SERIES",
    "DrawByJob",
    "PrometheusDraw",
    "PrometheusDrawError",
    "draw_query",
    "parse_draw",
]

MAX_RESPONSE_BYTES: Final = 8 * 1024 * 1024
"""A response larger than this is refused: ~50,000 series of (node, job), far beyond a domain."""
MAX_SERIES: Final = 50_000

DRAW_QUERY: Final = (
    "sum by (node, job_namespace, job_name) (rate(perseus_gpu_energy_joules_total[{window}s]))"
)

DrawByJob = dict[tuple[str, str, str], float]
"""Watts by (node, job namespace, job name); ("", "") for the GPUs no PerseusJob manages."""


class PrometheusDrawError(Exception):
    """Prometheus could not be asked or its answer was not a draw; the message says which."""


def draw_query(window_s: int) -> str:
    """The PromQL of the draw averaged over ``window_s`` seconds, by node and job."""
    return DRAW_QUERY.format(window=int(window_s))


def parse_draw(payload: Mapping[str, Any]) -> DrawByJob:
    """The watts of an instant query's answer (``/api/v1/query`` JSON).

    Raises:
        PrometheusDrawError: Not a successful vector answer, or a series without a node.
    """
    if payload.get("status") != "success":
        raise PrometheusDrawError(f"query failed: {str(payload.get('error', payload))[:200]}")
    data = payload.get("data")
    if not isinstance(data, Mapping) or data.get("resultType") != "vector":
        raise PrometheusDrawError("the answer is not an instant vector")
    result = data.get("result")
    if not isinstance(result, list):
        raise PrometheusDrawError("the answer has no result list")
    if len(result) > MAX_SERIES:
        raise PrometheusDrawError(f"{len(result)} series, more than {MAX_SERIES}")
    out: DrawByJob = {}
    for series in result:
        metric = series.get("metric") if isinstance(series, Mapping) else None
        value = series.get("value") if isinstance(series, Mapping) else None
        if not isinstance(metric, Mapping) or not isinstance(value, list) or len(value) != 2:
            raise PrometheusDrawError(f"malformed series: {str(series)[:200]}")
        node = metric.get("node")
        if not isinstance(node, str) or not node:
            continue  # not an agent's GPU series (another exporter's name clash)
        try:
            watts = float(value[1])
        except (TypeError, ValueError):
            raise PrometheusDrawError(f"not a number: {str(value[1])[:50]}") from None
        if not math.isfinite(watts) or watts < 0:
            continue  # NaN: a counter with one sample in the window
        key = (node, str(metric.get("job_namespace", "")), str(metric.get("job_name", "")))
        out[key] = out.get(key, 0.0) + watts
    return out


class PrometheusDraw:
    """Asks a Prometheus server for the GPUs' draw (blocking: call it off the event loop).

    Args:
        url: The server's base URL, e.g. ``http://prometheus-operated.monitoring:9090``.
        timeout_s: Longest a query may take, connection included.
        max_bytes: Largest answer read.
    """

    def __init__(
        self, url: str, *, timeout_s: float = 5.0, max_bytes: int = MAX_RESPONSE_BYTES
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        # No proxy from the environment: the server is inside the cluster.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def draw(self, window_s: int) -> DrawByJob:
        """Watts by (node, namespace, job) averaged over the last ``window_s`` seconds.

        Raises:
            PrometheusDrawError: The server did not answer in time, answered an error, too
                much, or not a draw.
        """
        query = urllib.parse.urlencode({"query": draw_query(window_s)})
        url = f"{self.url}/api/v1/query?{query}"
        deadline = time.monotonic() + self._timeout_s
        try:
            with self._opener.open(url, timeout=self._timeout_s) as response:
                body = _read_until(response, self._max_bytes + 1, deadline)
        except urllib.error.HTTPError as exc:
            detail = exc.read(2000).decode(errors="replace")
            raise PrometheusDrawError(f"HTTP {exc.code} from {self.url}: {detail}") from None
        except (OSError, ValueError) as exc:  # URLError, timeouts and resets are OSErrors
            raise PrometheusDrawError(f"cannot query {self.url}: {exc}") from None
        if body is None:
            raise PrometheusDrawError(f"{self.url} took over {self._timeout_s:g} s to answer")
        if len(body) > self._max_bytes:
            raise PrometheusDrawError(f"the answer of {self.url} is over {self._max_bytes} bytes")
        try:
            payload = json.loads(body)
        except ValueError:
            raise PrometheusDrawError(f"the answer of {self.url} is not JSON") from None
        if not isinstance(payload, Mapping):
            raise PrometheusDrawError(f"the answer of {self.url} is not a JSON object")
        return parse_draw(payload)


_CHUNK_BYTES: Final = 64 * 1024


def _read_until(response: HTTPResponse, max_bytes: int, deadline: float) -> bytes | None:
    """Up to ``max_bytes`` of ``response``, or None past ``deadline``: the socket timeout bounds
    each read, not the answer, which a server sending a byte at a time could stretch."""
    chunks: list[bytes] = []
    size = 0
    while size < max_bytes:
        if time.monotonic() > deadline:
            return None
        chunk = response.read1(min(_CHUNK_BYTES, max_bytes - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
