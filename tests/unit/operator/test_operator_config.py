"""Operator settings from PERSEUS_OPERATOR_* variables: parsed once, bad values named."""

from __future__ import annotations

import pytest

from perseus_operator.config import ConfigError, OperatorConfig


def test_defaults_and_overrides() -> None:
    assert OperatorConfig.from_env({}) == OperatorConfig()
    config = OperatorConfig.from_env(
        {
            "PERSEUS_OPERATOR_RECONCILE_INTERVAL_S": "0.5",
            "PERSEUS_OPERATOR_PLANNER_WORKERS": "2",
            "PERSEUS_OPERATOR_METRICS_PORT": "0",
            "PERSEUS_OPERATOR_KUBECONFIG": "/tmp/kubeconfig",
            "PERSEUS_OPERATOR_PROMETHEUS_URL": "http://prometheus-operated.monitoring:9090",
            "PERSEUS_OPERATOR_DEFAULT_POLICY": '{"mode": "Observe", "maxSlowdown": 0.02}',
            "UNRELATED": "x",
        }
    )
    assert (config.reconcile_interval_s, config.planner_workers) == (0.5, 2)
    assert (config.metrics_port, config.kubeconfig) == (0, "/tmp/kubeconfig")
    assert config.default_policy_fields() == {"mode": "Observe", "maxSlowdown": 0.02}
    assert config.prometheus_url == "http://prometheus-operated.monitoring:9090"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PERSEUS_OPERATOR_PLANNER_WORKERS": "two"}, "PLANNER_WORKERS='two' is not a valid int"),
        ({"PERSEUS_OPERATOR_PLANNER_WORKERS": "0"}, "PLANNER_WORKERS must be >= 1"),
        ({"PERSEUS_OPERATOR_RECONCILE_INTERVAL_S": "-1"}, "RECONCILE_INTERVAL_S must be > 0"),
        ({"PERSEUS_OPERATOR_METRICS_PORT": "70000"}, "METRICS_PORT must be 0..65535"),
        (
            {"PERSEUS_OPERATOR_PROMETHEUS_URL": "prometheus:9090"},
            "PROMETHEUS_URL must be an http",
        ),
        ({"PERSEUS_OPERATOR_PROMETHEUS_TIMEOUT_S": "0"}, "PROMETHEUS_TIMEOUT_S must be > 0"),
        ({"PERSEUS_OPERATOR_DEFAULT_POLICY": "{mode: Observe"}, "DEFAULT_POLICY is not JSON"),
        ({"PERSEUS_OPERATOR_DEFAULT_POLICY": "[1]"}, "must be a JSON object"),
        (
            {"PERSEUS_OPERATOR_DEFAULT_POLICY": '{"mode": "Turbo"}'},
            "DEFAULT_POLICY is not a valid policy: mode: Input should be 'Observe'",
        ),
    ],
)
def test_bad_values_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        OperatorConfig.from_env(env)
