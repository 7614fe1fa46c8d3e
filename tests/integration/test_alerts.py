"""The chart's alerts (PrometheusRule) through ``promtool check rules`` and ``promtool test rules``.

The rules are rendered from the chart (default and non-default values), written as a plain
Prometheus rules file, and unit-tested with promtool (Debian package ``prometheus``) on series
shaped like the agents', the operator's and kube-state-metrics'. Each test case states when an
alert fires, with which labels and which annotations, and when it stays quiet.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.helm_render import NAMESPACE, render

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)"
)

AGENT_JOB = "perseus-node-agent"
OPERATOR_JOB = "perseus-operator"
DAEMONSET = "perseus-node-agent"  # release "perseus"


def rules_of(values: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**values, "prometheusRule": {"enabled": True, **values.get("prometheusRule", {})}}
    rule = render(merged).one("PrometheusRule")
    spec: dict[str, Any] = rule["spec"]
    return spec


def rules_by_alert(rules: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def go_value(value: float) -> str:
    """``{{ $value }}`` as Prometheus's templates print it (Go's %v of a float64)."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def expand(template: str, labels: Mapping[str, str], value: float) -> str:
    """The few template actions the chart's annotations use; anything else fails the test, and
    so does a label the alert does not have (Prometheus would print ``<no value>``)."""

    def action(match: re.Match[str]) -> str:
        expr = match.group(1).strip()
        if expr.startswith("$labels."):
            return labels[expr.removeprefix("$labels.")]
        if expr == "$value":
            return go_value(value)
        printf = re.fullmatch(r'\$value \| printf "(%[^"]+)"', expr)
        if printf:
            return printf.group(1) % value
        raise AssertionError(f"unexpected template action {{{{ {expr} }}}}")

    return re.sub(r"\{\{(.*?)\}\}", action, template)


def expected(
    rules: Mapping[str, Any], alert: str, labels: Mapping[str, str], value: float
) -> dict[str, Any]:
    """An ``exp_alerts`` entry: ``labels`` (the series' labels the alert keeps) plus the rule's
    own labels, and the rule's annotations expanded for them."""
    rule = rules_by_alert(rules)[alert]
    all_labels = {**rule.get("labels", {}), **labels}
    annotations = {k: expand(v, all_labels, value) for k, v in rule["annotations"].items()}
    return {"exp_labels": all_labels, "exp_annotations": annotations}


def series(name: str, labels: Mapping[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def run_rule_tests(rules: Mapping[str, Any], tests: list[dict[str, Any]], tmp: Path) -> None:
    (tmp / "rules.yaml").write_text(yaml.safe_dump(dict(rules), sort_keys=False))
    (tmp / "tests.yaml").write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests},
            sort_keys=False,
        )
    )
    checked = promtool("check", "rules", "rules.yaml", cwd=tmp)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "tests.yaml", cwd=tmp)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def quiet(alert: str, at_m: int) -> dict[str, Any]:
    """An ``alert_rule_test`` entry: ``alert`` is not firing ``at_m`` minutes in."""
    return {"eval_time": f"{at_m}m", "alertname": alert, "exp_alerts": []}


def fires(
    rules: Mapping[str, Any], alert: str, at_m: int, labels: Mapping[str, str], value: float
) -> dict[str, Any]:
    """An ``alert_rule_test`` entry: ``alert`` fires ``at_m`` minutes in, once, for ``labels``
    with ``value``."""
    return {
        "eval_time": f"{at_m}m",
        "alertname": alert,
        "exp_alerts": [expected(rules, alert, labels, value)],
    }


def case(inputs: list[dict[str, str]], *checks: dict[str, Any]) -> dict[str, Any]:
    """A promtool test case: ``inputs`` sampled every minute, then ``checks``."""
    return {"interval": "1m", "input_series": inputs, "alert_rule_test": list(checks)}


# -- the test cases, one function per alert ------------------------------------------------------


def rank(job: str, dp: int, pp: int, node: str = "n1") -> dict[str, str]:
    return {
        "job_namespace": "ml",
        "job_name": job,
        "pod_name": f"{job}-worker-{dp}-{pp}",
        "dp_rank": str(dp),
        "pp_rank": str(pp),
        "node": node,
        "gpu": str(pp),
        "uuid": f"GPU-{job}-{dp}-{pp}",
        "rank": str(dp * 2 + pp),
    }


def iterations(labels: Mapping[str, str], per_minute: int, seconds_each: float) -> list[Any]:
    return [
        series("perseus_iteration_seconds_count", labels, f"0+{per_minute}x40"),
        series("perseus_iteration_seconds_sum", labels, f"0+{per_minute * seconds_each:g}x40"),
    ]


def straggler_cases(rules: Mapping[str, Any], slowdown_for_m: int) -> dict[str, Any]:
    """Job gpt3: replica 1 needs 1.5 s per iteration (its slowest rank), replica 0 1 s. Job
    even: both replicas alike. Job single: one replica."""
    inputs: list[Any] = []
    for pp in (0, 1):
        inputs += iterations(rank("gpt3", 0, pp), 60, 1.0)
        inputs += iterations(rank("even", 0, pp), 60, 1.0)
        inputs += iterations(rank("even", 1, pp), 60, 1.0)
        inputs += iterations(rank("single", 0, pp), 60, 2.0)
    inputs += iterations(rank("gpt3", 1, 0), 40, 1.5)
    inputs += iterations(rank("gpt3", 1, 1), 40, 1.2)  # the replica's other stage waits less
    fires_at = slowdown_for_m + 1  # the first rate needs two samples (at 1m)
    alert = "PerseusStragglerPersistent"
    return case(
        inputs,
        quiet(alert, fires_at - 1),
        fires(rules, alert, fires_at, {"job_namespace": "ml", "job_name": "gpt3"}, 1.5),
    )


def agent_down_cases(rules: Mapping[str, Any]) -> dict[str, Any]:
    down = {"job": AGENT_JOB, "node": "n1", "instance": "10.0.0.1:9400"}
    up = {"job": AGENT_JOB, "node": "n2", "instance": "10.0.0.2:9400"}
    return case(
        [
            series("up", down, "1 1 0x20"),
            series("up", up, "1x22"),
            series("up", {"job": OPERATOR_JOB, "instance": "10.0.0.9:8080"}, "1x22"),
        ],
        quiet("PerseusAgentDown", 6),
        fires(rules, "PerseusAgentDown", 7, down, 0),
        quiet("PerseusOperatorDown", 10),
    )


def operator_absent_cases(rules: Mapping[str, Any]) -> dict[str, Any]:
    """The operator's targets vanish at 3m (no `up == 0` to see: PerseusOperatorDown stays
    quiet); absent() holds once the last sample is out of the 5m lookback, and fires 10m later.
    Another release's replicas answer, but none leads."""
    target = {"job": OPERATOR_JOB, "instance": "10.0.0.9:8080"}
    return case(
        [series("up", target, "1x3"), series("perseus_operator_leader", target, "1x3")],
        quiet("PerseusOperatorAbsent", 16),
        fires(rules, "PerseusOperatorAbsent", 21, {"job": OPERATOR_JOB}, 1),
        quiet("PerseusOperatorDown", 21),
    )


def no_leader_cases(rules: Mapping[str, Any]) -> dict[str, Any]:
    """Two replicas scraped, neither holds the Lease from 2m on; the alert fires 10m later."""
    a = {"job": OPERATOR_JOB, "instance": "10.0.0.9:8080"}
    b = {"job": OPERATOR_JOB, "instance": "10.0.0.10:8080"}
    return case(
        [
            series("perseus_operator_leader", a, "1 1 0x20"),
            series("perseus_operator_leader", b, "0x22"),
            series("up", a, "1x22"),
            series("up", b, "1x22"),
        ],
        quiet("PerseusOperatorNoLeader", 11),
        fires(rules, "PerseusOperatorNoLeader", 13, {}, 0),
        quiet("PerseusOperatorAbsent", 13),
    )


def operator_down_cases(rules: Mapping[str, Any]) -> dict[str, Any]:
    target = {"job": OPERATOR_JOB, "instance": "10.0.0.9:8080"}
    return case(
        [series("up", target, "0x10")],
        quiet("PerseusOperatorDown", 4),
        fires(rules, "PerseusOperatorDown", 5, target, 0),
        quiet("PerseusAgentDown", 5),
    )


def agent_unavailable_cases(rules: Mapping[str, Any]) -> dict[str, Any]:
    ds = {"namespace": NAMESPACE, "daemonset": DAEMONSET}
    other = {"namespace": "kube-system", "daemonset": "kube-proxy"}
    return case(
        [
            series("kube_daemonset_status_desired_number_scheduled", ds, "4x12"),
            series("kube_daemonset_status_number_available", ds, "4 4 3x10"),
            series("kube_daemonset_status_desired_number_scheduled", other, "5x12"),
            series("kube_daemonset_status_number_available", other, "0x12"),
        ],
        quiet("PerseusAgentUnavailable", 6),
        fires(rules, "PerseusAgentUnavailable", 7, ds, 1),
    )


def apply_error_cases(rules: Mapping[str, Any]) -> dict[str, Any]:
    def errors(node: str, reason: str, values: str) -> dict[str, str]:
        return series("perseus_agent_apply_errors_total", {"node": node, "reason": reason}, values)

    return case(
        [
            errors("n1", "no_permission", "0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1"),
            errors("n1", "invalid_plan", "0x19"),
            errors("n2", "read_gpu_lost", "0 0 0 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2"),
        ],
        quiet("PerseusPlanApplyErrors", 2),
        fires(rules, "PerseusPlanApplyErrors", 3, {"node": "n1", "reason": "no_permission"}, 1),
        fires(rules, "PerseusGpuReadErrors", 3, {"node": "n2", "reason": "read_gpu_lost"}, 2),
        quiet("PerseusPlanApplyErrors", 15),  # an error older than the window is forgotten
    )


def locked_cases(rules: Mapping[str, Any]) -> dict[str, Any]:
    """n2: the agent disappears while GPU 0 follows a plan. n3: the plan ends and the agent
    resets the clock (no alert). n4: the plan ends and the agent's reset fails. n5: the plan
    goes on."""

    def gpu(node: str, managed: bool) -> dict[str, str]:
        labels = {"node": node, "gpu": "0", "uuid": f"GPU-{node}-0"}
        if managed:
            labels |= {
                "job_namespace": "ml",
                "job_name": "gpt3",
                "pod_name": "w-0",
                "dp_rank": "0",
                "pp_rank": "0",
            }
        return labels

    gone = " ".join(["_"] * 25)
    inputs = [
        # n2: every series of the agent stops at 5m.
        series("perseus_gpu_target_sm_clock_hertz", gpu("n2", True), "1.2e9x5 stale"),
        series("perseus_gpu_power_watts", gpu("n2", True), "300x5 stale"),
        # n3: the managed series end at 5m, the same GPU is exported unmanaged from then on.
        series("perseus_gpu_target_sm_clock_hertz", gpu("n3", True), "1.2e9x5 stale"),
        series("perseus_gpu_power_watts", gpu("n3", True), "300x5 stale"),
        series("perseus_gpu_power_watts", gpu("n3", False), "_ _ _ _ _ _ 80x25"),
        series(
            "perseus_agent_apply_errors_total", {"node": "n3", "reason": "no_permission"}, "0x30"
        ),
        # n4: as n3, but the reset at 6m fails.
        series("perseus_gpu_target_sm_clock_hertz", gpu("n4", True), "1.2e9x5 stale"),
        series("perseus_gpu_power_watts", gpu("n4", True), "300x5 stale"),
        series("perseus_gpu_power_watts", gpu("n4", False), "_ _ _ _ _ _ 80x25"),
        series(
            "perseus_agent_apply_errors_total",
            {"node": "n4", "reason": "no_permission"},
            "0x5 1x25",
        ),
        # n5: still following its plan.
        series("perseus_gpu_target_sm_clock_hertz", gpu("n5", True), "1.2e9x50"),
        series("perseus_gpu_power_watts", gpu("n5", True), "300x50"),
        series("perseus_gpu_power_watts", {"node": "n9", "gpu": "0", "uuid": "GPU-n9-0"}, gone),
    ]
    alert = "PerseusGpuLockedWithoutPlan"
    n2 = expected(rules, alert, {"node": "n2", "gpu": "0", "uuid": "GPU-n2-0"}, 1.2e9)
    n4 = expected(rules, alert, {"node": "n4", "gpu": "0", "uuid": "GPU-n4-0"}, 1.2e9)
    return case(
        inputs,
        quiet(alert, 10),
        {"eval_time": "12m", "alertname": alert, "exp_alerts": [n2, n4]},
        quiet(alert, 45),  # past the lookback the GPU no longer counts as having had a plan
    )


def power_budget_cases(rules: Mapping[str, Any]) -> dict[str, Any]:
    """rack-a: its averaged draw goes over the budget at 3m and stays (fires after ``for``);
    rack-b: over for one minute only, then under (quiet); rack-c: infeasible from 1m."""

    def budget(name: str, metric: str, values: str) -> dict[str, str]:
        operator = {"job": OPERATOR_JOB, "instance": "10.0.0.9:8080", "namespace": NAMESPACE}
        return series(f"perseus_power_budget_{metric}", {**operator, "budget": name}, values)

    return case(
        [
            budget("rack-a", "watts", "40000x20"),
            budget("rack-a", "measured_watts", "38000 39000 39500 41000x17"),
            budget("rack-a", "missing_watts", "0x20"),
            budget("rack-b", "watts", "40000x20"),
            budget("rack-b", "measured_watts", "39000 41000 39000x18"),
            budget("rack-b", "missing_watts", "0x20"),
            budget("rack-c", "watts", "1000x20"),
            budget("rack-c", "missing_watts", "0 2500x19"),
        ],
        quiet("PerseusPowerBudgetExceeded", 4),
        fires(rules, "PerseusPowerBudgetExceeded", 5, {"budget": "rack-a"}, 41000),
        quiet("PerseusPowerBudgetInfeasible", 2),
        fires(rules, "PerseusPowerBudgetInfeasible", 3, {"budget": "rack-c"}, 2500),
    )


# -- tests ---------------------------------------------------------------------------------------


DEFAULT_CASES = [
    operator_absent_cases,
    no_leader_cases,
    lambda rules: straggler_cases(rules, slowdown_for_m=10),
    agent_down_cases,
    operator_down_cases,
    agent_unavailable_cases,
    apply_error_cases,
    locked_cases,
    power_budget_cases,
]


def test_the_default_alerts() -> None:
    assert set(rules_by_alert(rules_of({}))) == {
        "PerseusStragglerPersistent",
        "PerseusAgentDown",
        "PerseusAgentUnavailable",
        "PerseusPlanApplyErrors",
        "PerseusGpuReadErrors",
        "PerseusGpuLockedWithoutPlan",
        "PerseusOperatorDown",
        "PerseusOperatorAbsent",
        "PerseusOperatorNoLeader",
        "PerseusPowerBudgetExceeded",
        "PerseusPowerBudgetInfeasible",
    }


@pytest.mark.parametrize(
    "cases",
    DEFAULT_CASES,
    ids=[
        "operator-absent",
        "no-leader",
        "straggler",
        "agent-down",
        "operator-down",
        "agent-unavailable",
        "apply-errors",
        "locked",
        "power-budget",
    ],
)
def test_default_alerts_pass_promtool_check_and_unit_tests(
    cases: Callable[[Mapping[str, Any]], dict[str, Any]], tmp_path: Path
) -> None:
    rules = rules_of({})
    run_rule_tests(rules, [cases(rules)], tmp_path)


def test_alert_settings_from_values_change_what_fires(tmp_path: Path) -> None:
    rules = rules_of(
        {
            "prometheusRule": {
                "straggler": {"slowdown": 1.6, "for": "3m", "window": "2m"},
                "alertLabels": {"team": "ml-infra"},
                "kubeStateMetrics": False,
            }
        }
    )
    alerts = rules_by_alert(rules)
    assert "PerseusAgentUnavailable" not in alerts
    assert all(a["labels"]["team"] == "ml-infra" for a in alerts.values())
    assert "[2m]" in alerts["PerseusStragglerPersistent"]["expr"]
    quiet = straggler_cases(rules, slowdown_for_m=3)  # 1.5x is under the 1.6x threshold now
    for case in quiet["alert_rule_test"]:
        case["exp_alerts"] = []
    run_rule_tests(rules, [quiet, agent_down_cases(rules)], tmp_path)


def test_a_broken_rule_fails_promtool_check(tmp_path: Path) -> None:
    """The harness itself: promtool does reject a rule that does not parse."""
    rules = rules_of({})
    rules["groups"][0]["rules"][0]["expr"] = "max by (job( perseus_iteration_seconds_sum"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    assert promtool("check", "rules", "rules.yaml", cwd=tmp_path).returncode != 0


def test_alerts_use_the_scrape_job_names_of_the_monitors() -> None:
    values = {
        "metrics": {
            "agentJob": "gpu-agents",
            "operatorJob": "perseus-ctl",
            "podMonitor": {"enabled": True},
        }
    }
    rendered = render({**values, "prometheusRule": {"enabled": True}})
    alerts = rules_by_alert(rendered.one("PrometheusRule")["spec"])
    assert alerts["PerseusAgentDown"]["expr"] == 'up{job="gpu-agents"} == 0'
    assert alerts["PerseusOperatorDown"]["expr"] == 'up{job="perseus-ctl"} == 0'
    jobs = {
        m["metadata"]["name"]: [
            r["replacement"]
            for r in m["spec"]["podMetricsEndpoints"][0]["relabelings"]
            if r["targetLabel"] == "job"
        ]
        for m in rendered.of_kind("PodMonitor")
    }
    assert jobs == {"perseus-node-agent": ["gpu-agents"], "perseus-operator": ["perseus-ctl"]}
