"""The power domains' draw: read from Prometheus (a bounded client, against a real HTTP server
on loopback), split into the allocated jobs' and the unmanaged GPUs', and the fallback on the
node plans' reports (issue 35: unmanaged GPUs count at their measured draw)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from perseus_api.conventions import rfc3339
from perseus_operator.power.domain import DrawMeter, domain_draw
from perseus_operator.power.prometheus_draw import (
    PrometheusDraw,
    PrometheusDrawError,
    draw_query,
    parse_draw,
)

NODES = {"node-a1", "node-a2"}


def _vector(*series: tuple[dict[str, str], str]) -> dict[str, Any]:
    result = [{"metric": m, "value": [1_800_000_000.0, v]} for m, v in series]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


ANSWER = _vector(
    ({"node": "node-a1", "job_namespace": "ml", "job_name": "gpt3"}, "2400.5"),
    ({"node": "node-a1"}, "167.25"),  # two GPUs no PerseusJob manages, idle
    ({"node": "node-a2", "job_namespace": "ml", "job_name": "bloom"}, "1800"),
    ({"node": "node-a2", "job_namespace": "ml", "job_name": "profiling"}, "900"),
    ({"node": "node-b1", "job_namespace": "ml", "job_name": "other-rack"}, "5000"),
    ({"node": "node-a2"}, "NaN"),  # a GPU with one sample in the window yet
)


def test_the_answer_is_split_by_node_and_job() -> None:
    draw = parse_draw(ANSWER)
    assert draw[("node-a1", "ml", "gpt3")] == 2400.5
    assert draw[("node-a1", "", "")] == 167.25
    assert ("node-a2", "", "") not in draw


def test_unmanaged_draw_is_the_domain_less_the_allocated_jobs() -> None:
    """GPUs of no job, and of a job the allocation does not hold (profiling), count at their
    draw; another rack's node does not count at all."""
    measured_w, unmanaged_w = domain_draw(
        NODES,
        {("ml", "gpt3"), ("ml", "bloom")},
        scraped=parse_draw(ANSWER),
        meter=DrawMeter(),
        plans=[],
        window_s=60,
        now_s=0.0,
    )
    assert measured_w == pytest.approx(2400.5 + 167.25 + 1800 + 900)
    assert unmanaged_w == pytest.approx(167.25 + 900)


def test_no_series_in_the_domain_is_no_measurement() -> None:
    assert domain_draw(
        {"node-c1"}, set(), scraped=parse_draw(ANSWER), meter=DrawMeter(), plans=[],
        window_s=60, now_s=0.0,
    ) == (None, 0.0)  # fmt: skip


def _plan(job: str, node: str, t_s: float, energy_j: float) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": f"{job}-{node}"},
        "spec": {"node": node, "job": job},
        "status": {
            "reportedAt": rfc3339(t_s),
            "gpus": [
                {
                    "uuid": f"GPU-{job}",
                    "index": 0,
                    "plan": "p",
                    "stage": 0,
                    "status": "Applied",
                    "energyJoules": energy_j,
                }
            ],
        },
    }


def test_without_prometheus_the_reports_of_unallocated_jobs_count_as_unmanaged() -> None:
    meter = DrawMeter()
    start_s = 1_800_000_000.0
    for dt_s in (0.0, 30.0):
        plans = [
            _plan("gpt3", "node-a1", start_s + dt_s, 400.0 * dt_s),
            _plan("profiling", "node-a2", start_s + dt_s, 250.0 * dt_s),
        ]
        meter.record(plans)
    measured_w, unmanaged_w = domain_draw(
        NODES, {("ml", "gpt3")}, scraped=None, meter=meter, plans=plans, window_s=60,
        now_s=start_s + 30.0,
    )  # fmt: skip
    assert measured_w == pytest.approx(650.0)
    assert unmanaged_w == pytest.approx(250.0)


def test_the_query_averages_the_counters_over_the_window() -> None:
    assert draw_query(60) == (
        "sum by (node, job_namespace, job_name) (rate(perseus_gpu_energy_joules_total[60s]))"
    )


@pytest.mark.parametrize(
    "payload",
    [
        {"status": "error", "error": "bad_data"},
        {"status": "success", "data": {"resultType": "matrix", "result": []}},
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}},
        _vector(({"node": "n"}, "many")),
    ],
)
def test_an_answer_that_is_no_draw_is_refused(payload: dict[str, Any]) -> None:
    with pytest.raises(PrometheusDrawError):
        parse_draw(payload)


# -- the client against a real HTTP server --


@contextmanager
def _server(respond: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            respond(self)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _reply(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_the_client_asks_for_the_window_and_reads_the_answer() -> None:
    asked: list[str] = []

    def respond(handler: BaseHTTPRequestHandler) -> None:
        url = urlsplit(handler.path)
        asked.append(url.path)
        asked.extend(parse_qs(url.query)["query"])
        _reply(handler, 200, json.dumps(ANSWER).encode())

    with _server(respond) as url:
        draw = PrometheusDraw(url + "/").draw(30)
    assert asked == ["/api/v1/query", draw_query(30)]
    assert draw == parse_draw(ANSWER)


def test_an_error_status_says_what_prometheus_said() -> None:
    def respond(handler: BaseHTTPRequestHandler) -> None:
        _reply(handler, 400, b'{"status":"error","error":"parse error"}')

    with _server(respond) as url, pytest.raises(PrometheusDrawError, match=r"HTTP 400.*parse"):
        PrometheusDraw(url).draw(30)


def test_an_answer_over_the_cap_is_refused() -> None:
    def respond(handler: BaseHTTPRequestHandler) -> None:
        _reply(handler, 200, json.dumps(ANSWER).encode() + b" " * 4096)

    with _server(respond) as url, pytest.raises(PrometheusDrawError, match="over 2048 bytes"):
        PrometheusDraw(url, max_bytes=2048).draw(30)


def test_a_server_that_does_not_answer_times_out() -> None:
    release = threading.Event()

    def respond(handler: BaseHTTPRequestHandler) -> None:
        release.wait(10)

    with _server(respond) as url:
        started = time.monotonic()
        try:
            with pytest.raises(PrometheusDrawError, match="cannot query"):
                PrometheusDraw(url, timeout_s=0.2).draw(30)
        finally:
            release.set()
    assert time.monotonic() - started < 5  # bounded by the timeout, not the server


def test_a_server_that_drips_its_answer_is_cut_at_the_timeout() -> None:
    """Each byte comes within the socket timeout; the whole answer would take 30 s."""
    release = threading.Event()

    def respond(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "300")
        handler.end_headers()
        for _ in range(300):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            if release.wait(0.1):
                return

    with _server(respond) as url:
        started = time.monotonic()
        try:
            with pytest.raises(PrometheusDrawError, match=r"took over 0\.5 s"):
                PrometheusDraw(url, timeout_s=0.5).draw(30)
        finally:
            release.set()
    assert time.monotonic() - started < 5  # bounded by the timeout, not the server


def test_a_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        PrometheusDraw("prometheus:9090")
