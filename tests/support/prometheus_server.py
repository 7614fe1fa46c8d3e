"""A real Prometheus (Debian package) on 127.0.0.1 for tests, started and stopped by them."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from support.control_plane import BACKGROUND

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Prometheus:
    """Query helper for a running server."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def query(self, promql: str, at_s: float | None = None) -> list[dict[str, Any]]:
        params = {"query": promql}
        if at_s is not None:
            params["time"] = f"{at_s:.3f}"
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise AssertionError(f"query {promql!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scalar(self, promql: str, at_s: float | None = None) -> float:
        result = self.query(promql, at_s)
        if len(result) != 1:
            raise AssertionError(f"query {promql!r} returned {len(result)} series: {result}")
        return float(result[0]["value"][1])

    def wait_for(self, promql: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll until the query returns data (the first scrape lands seconds after start)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = self.query(promql)
            except OSError:
                result = []
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"no data for {promql!r} after {timeout_s} s")
            time.sleep(0.25)


@contextmanager
def running_prometheus(
    workdir: Path,
    targets: list[str],
    scrape_interval_s: float = 1.0,
    scrape_configs: list[dict[str, Any]] | None = None,
) -> Iterator[Prometheus]:
    """Start Prometheus scraping ``targets`` (``host:port``; or the given ``scrape_configs``),
    stop it on exit."""
    if PROMETHEUS is None:
        raise RuntimeError("prometheus is not installed (apt-get install prometheus)")
    port = free_port()
    config = workdir / "prometheus.yml"
    interval = f"{round(scrape_interval_s * 1000)}ms"  # Prometheus durations are integers
    if scrape_configs is None:
        scrape_configs = [{"job_name": "perseus", "static_configs": [{"targets": targets}]}]
    document = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": scrape_configs,
    }
    config.write_text(json.dumps(document, indent=2))  # JSON is YAML
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            *BACKGROUND,
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        server = Prometheus(port)
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"prometheus did not start: {(workdir / 'prometheus.log').read_text()}"
                    ) from None
                time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
