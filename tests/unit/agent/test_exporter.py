"""The metrics server, scraped over HTTP on the loopback interface."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.errors import GpuLostError
from perseus_agent.exporter import AgentMetrics, GpuCollector, ManagedGpu
from perseus_agent.metrics_server import Health, MetricsServer
from perseus_api.node_plan import NodePlan
from support.factories import pipeline_plan_fields
from support.fake_gpu import FakeBackend

NODE = "node-1"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def backend() -> FakeBackend:
    backend = FakeBackend(num_gpus=2)
    backend.gpus[0].locked_sm_mhz = 1200
    backend.gpus[0].power_w = 250.5
    backend.gpus[1].energy_j = 12345.5
    return backend


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def health(clock: FakeClock) -> Health:
    health = Health(max_age_s=30.0, clock=clock)
    health.beat()
    return health


@pytest.fixture
def metrics() -> AgentMetrics:
    return AgentMetrics(NODE)


MANAGED = {
    0: ManagedGpu(
        labels={"namespace": "ml", "job": "gpt3", "pod": "w-0", "dp_rank": "1", "pp_rank": "3"},
        target_mhz=1200,
    )
}


@pytest.fixture
def server(backend: FakeBackend, metrics: AgentMetrics, health: Health) -> Iterator[MetricsServer]:
    metrics.registry.register(GpuCollector(backend, backend.devices(), metrics, lambda: MANAGED))
    server = MetricsServer(metrics.registry, health, address="127.0.0.1", port=0)
    server.start()
    yield server
    server.stop()


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def scrape(server: MetricsServer) -> list[Sample]:
    status, content_type, body = get(f"{server.url}/metrics")
    assert status == 200
    assert content_type.startswith("text/plain")
    return [s for family in text_string_to_metric_families(body) for s in family.samples]


def samples(all_samples: list[Sample], name: str) -> dict[str, tuple[dict[str, str], float]]:
    """``gpu`` label -> (labels, value) of the samples called ``name``."""
    return {s.labels.get("gpu", ""): (s.labels, s.value) for s in all_samples if s.name == name}


def test_server_binds_the_loopback_on_an_ephemeral_port(server: MetricsServer) -> None:
    assert server.address == "127.0.0.1"
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"


def test_gpu_metrics_carry_names_labels_and_base_units(
    server: MetricsServer, metrics: AgentMetrics
) -> None:
    metrics.count_clock_change(0)
    metrics.count_clock_change(0)
    metrics.count_error("schedule_mismatch")
    metrics.observe_iteration({"rank": "7", "gpu": "0", "uuid": "GPU-0", "job": "gpt3"}, 1.7)

    got = scrape(server)

    managed = {
        "node": NODE,
        "gpu": "0",
        "uuid": "GPU-0",
        "job_namespace": "ml",
        "job_name": "gpt3",
        "pod_name": "w-0",
        "dp_rank": "1",
        "pp_rank": "3",
    }
    unmanaged = {"node": NODE, "gpu": "1", "uuid": "GPU-1"}
    assert samples(got, "perseus_gpu_energy_joules_total") == {
        "0": (managed, 0.0),
        "1": (unmanaged, 12345.5),
    }
    assert samples(got, "perseus_gpu_power_watts") == {
        "0": (managed, 250.5),
        "1": (unmanaged, 80.0),
    }
    assert samples(got, "perseus_gpu_sm_clock_hertz") == {
        "0": (managed, 1.2e9),
        "1": (unmanaged, 1.41e9),
    }
    assert samples(got, "perseus_gpu_target_sm_clock_hertz") == {"0": (managed, 1.2e9)}
    assert samples(got, "perseus_gpu_clock_changes_total") == {
        "0": (managed, 2.0),
        "1": (unmanaged, 0.0),
    }
    errors = {
        s.labels["reason"]: s.value for s in got if s.name == "perseus_agent_apply_errors_total"
    }
    assert errors["schedule_mismatch"] == 1.0
    assert errors["no_permission"] == 0.0  # exported before the first error
    assert all(
        s.labels["node"] == NODE for s in got if s.name == "perseus_agent_apply_errors_total"
    )
    count = [s for s in got if s.name == "perseus_iteration_seconds_count"]
    assert len(count) == 1 and count[0].value == 1.0
    assert count[0].labels["rank"] == "7" and count[0].labels["job_name"] == "gpt3"
    assert count[0].labels["node"] == NODE
    buckets = {s.labels["le"]: s.value for s in got if s.name == "perseus_iteration_seconds_bucket"}
    assert buckets["1.5"] == 0.0 and buckets["2.0"] == 1.0 and buckets["+Inf"] == 1.0


def test_failing_gpu_is_skipped_and_counted(
    server: MetricsServer, backend: FakeBackend, metrics: AgentMetrics
) -> None:
    backend.fail[("energy_j", 1)] = GpuLostError("fell off the bus", 1)

    got = scrape(server)

    for name in (
        "perseus_gpu_energy_joules_total",
        "perseus_gpu_power_watts",
        "perseus_gpu_sm_clock_hertz",
        "perseus_gpu_clock_changes_total",
    ):
        assert set(samples(got, name)) == {"0"}, name
    assert metrics.error_count("read_gpu_lost") == 1

    got = scrape(server)
    errors = {
        s.labels["reason"]: s.value for s in got if s.name == "perseus_agent_apply_errors_total"
    }
    assert errors["read_gpu_lost"] >= 1.0


def test_unexpected_exception_does_not_break_the_scrape(
    server: MetricsServer, backend: FakeBackend, metrics: AgentMetrics
) -> None:
    backend.fail[("power_w", 0)] = RuntimeError("bug")  # type: ignore[assignment]
    got = scrape(server)
    assert set(samples(got, "perseus_gpu_power_watts")) == {"1"}
    assert metrics.error_count("read_error") == 1


def test_healthz_follows_the_agent_loop(
    server: MetricsServer, health: Health, clock: FakeClock
) -> None:
    assert get(f"{server.url}/healthz")[::2] == (200, "ok\n")
    clock.now += 31.0  # the loop stopped beating
    assert get(f"{server.url}/healthz")[0] == 503
    health.beat()
    assert get(f"{server.url}/healthz")[0] == 200
    health.stop()
    status, _, body = get(f"{server.url}/healthz")
    assert status == 503 and "not running" in body


def test_health_needs_a_first_beat(clock: FakeClock) -> None:
    assert not Health(clock=clock).alive()


def test_unknown_path_is_404(server: MetricsServer) -> None:
    assert get(f"{server.url}/nope")[0] == 404


def test_openmetrics_is_served_on_request(server: MetricsServer) -> None:
    request = urllib.request.Request(
        f"{server.url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert response.read().decode().rstrip().endswith("# EOF")


def test_applier_labels_and_targets_reach_the_scrape(
    tmp_path: Path, health: Health, clock: FakeClock
) -> None:
    backend = FakeBackend(num_gpus=2)
    applier = PlanApplier(backend, ResetState(tmp_path), NODE)
    fields = pipeline_plan_fields(num_stages=2)
    fields["stages"][1]["frequency_mhz"] = 1005
    applier.apply(
        NodePlan.model_validate(
            {
                "node": NODE,
                "namespace": "ml",
                "job": "gpt3",
                "revision": 1,
                "granularity": "Stage",
                "plans": {"p": fields},
                "assignments": [{"gpu_index": 1, "plan": "p", "stage": 1, "pod": "w-1"}],
            }
        )
    )
    metrics = applier.metrics
    metrics.registry.register(GpuCollector(backend, applier.devices, metrics, applier.managed_gpus))
    server = MetricsServer(metrics.registry, health, address="127.0.0.1", port=0)
    server.start()
    try:
        got = scrape(server)
    finally:
        server.stop()
    target = samples(got, "perseus_gpu_target_sm_clock_hertz")
    assert target == {
        "1": (
            {
                "node": NODE,
                "gpu": "1",
                "uuid": "GPU-1",
                "job_namespace": "ml",
                "job_name": "gpt3",
                "pod_name": "w-1",
                "dp_rank": "0",
                "pp_rank": "1",
            },
            1.005e9,
        )
    }
    assert samples(got, "perseus_gpu_sm_clock_hertz")["1"][1] == 1.005e9
    assert samples(got, "perseus_gpu_clock_changes_total")["1"][1] == 1.0
    assert samples(got, "perseus_gpu_energy_joules_total")["0"][0] == {
        "node": NODE,
        "gpu": "0",
        "uuid": "GPU-0",
    }
