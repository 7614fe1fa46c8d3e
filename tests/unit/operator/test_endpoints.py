"""What an operator replica's /healthz and /readyz say in each phase (pure), and the process's
own metrics (leader, build info, process_*)."""

from __future__ import annotations

from prometheus_client import generate_latest

from perseus_operator.endpoints import (
    Limits,
    Phase,
    ProcessHealth,
    Snapshot,
    liveness,
    readiness,
)
from perseus_operator.metrics import JOB_LABELS, OperatorMetrics, ProcessMetrics

LIMITS = Limits(start_s=300.0, election_stale_s=25.0, kopf_start_s=60.0)


def both(s: Snapshot) -> tuple[bool, bool]:
    return liveness(s, LIMITS).ok, readiness(s, LIMITS).ok


def test_a_starting_replica_is_live_for_a_while_and_never_ready() -> None:
    assert both(Snapshot(Phase.STARTING, 10.0)) == (True, False)
    assert both(Snapshot(Phase.STARTING, 301.0)) == (False, False)
    assert "still starting" in liveness(Snapshot(Phase.STARTING, 301.0), LIMITS).message


def test_a_standby_is_live_and_ready_while_its_election_attempts_keep_coming() -> None:
    assert both(Snapshot(Phase.STANDBY, 500.0, election_age_s=2.0)) == (True, True)
    # No attempt has ended yet: counted from entering the phase.
    assert both(Snapshot(Phase.STANDBY, 3.0, election_age_s=None)) == (True, True)
    stuck = Snapshot(Phase.STANDBY, 500.0, election_age_s=26.0)
    assert both(stuck) == (False, False)
    assert liveness(stuck, LIMITS).message == "standby: no leader election attempt for 26 s"
    assert liveness(stuck, LIMITS).status == 503


def test_a_leader_is_judged_by_kopf_s_own_liveness_endpoint() -> None:
    assert both(Snapshot(Phase.LEADER, 100.0, kopf_status=200)) == (True, True)
    # kopf starting: live (not restarted) but not ready, for kopf_start_s.
    assert both(Snapshot(Phase.LEADER, 5.0, kopf_status=None)) == (True, False)
    assert both(Snapshot(Phase.LEADER, 61.0, kopf_status=None)) == (False, False)
    assert both(Snapshot(Phase.LEADER, 61.0, kopf_status=500)) == (False, False)
    assert "HTTP 500" in liveness(Snapshot(Phase.LEADER, 61.0, kopf_status=500), LIMITS).message


def test_process_health_asks_only_what_its_phase_is_judged_by() -> None:
    now = [1000.0]
    asked: list[str] = []

    def attempt() -> float:
        asked.append("election")
        return now[0] - 1.0

    def kopf() -> int:
        asked.append("kopf")
        return 200

    health = ProcessHealth(
        LIMITS, election_attempt_s=attempt, probe_kopf=kopf, clock=lambda: now[0]
    )
    assert health.ready().message == "starting" and asked == []
    health.enter(Phase.STANDBY)
    now[0] += 5.0
    assert health.snapshot() == Snapshot(Phase.STANDBY, 5.0, 1.0, None)
    assert asked == ["election"]
    health.enter(Phase.LEADER)
    assert health.live().ok and asked == ["election", "kopf"]


def test_every_replica_exports_leader_build_info_and_process_metrics() -> None:
    process = ProcessMetrics("1.2.3")
    text = generate_latest(process.registry).decode()
    assert "perseus_operator_leader 0.0" in text
    assert 'perseus_operator_build_info{python_version="' in text and 'version="1.2.3"' in text
    assert "process_cpu_seconds_total" in text and "process_resident_memory_bytes" in text
    process.leader.set(1)
    # The handlers' series join the same registry once the replica leads.
    jobs = OperatorMetrics(registry=process.registry)
    jobs.stragglers.labels("ml", "gpt3").inc()
    text = generate_latest(process.registry).decode()
    assert "perseus_operator_leader 1.0" in text
    assert 'perseus_straggler_events_total{job_name="gpt3",job_namespace="ml"} 1.0' in text


def test_job_series_never_use_prometheus_target_label_names() -> None:
    assert not set(JOB_LABELS) & {"namespace", "job", "pod", "instance", "service"}
