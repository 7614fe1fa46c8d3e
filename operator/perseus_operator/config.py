"""Operator settings: ``PERSEUS_OPERATOR_*`` environment variables, read once at start-up."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from pydantic import ValidationError

from perseus_api.errors import validation_summary
from perseus_api.job import Policy
from perseus_operator.cluster.leader_election import Timings

PREFIX: Final = "PERSEUS_OPERATOR_"


class ConfigError(ValueError):
    """A setting has a value the operator cannot use; the message names the variable."""


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of the operator process. Each field is ``PERSEUS_OPERATOR_<FIELD>``."""

    reconcile_interval_s: float = 5.0
    """How often each job's progress (profiling, telemetry, stragglers) is checked."""
    planner_timeout_s: float = 600.0
    """Longest a frontier may take to solve before the job fails with a clear message."""
    planner_workers: int = 1
    """Worker processes that solve frontiers (each solve uses one core)."""
    release_timeout_s: float = 60.0
    """On deletion, how long to wait for the agents to reset the job's GPUs."""
    policy_interval_s: float = 15.0
    """Longest time before a new workload gets its PerseusJob from a PerseusPolicy (a change
    of a policy itself is acted on at once)."""
    budget_interval_s: float = 10.0
    """Between two rounds of the PerseusPowerBudgets (measure the draw, re-solve when needed;
    a change of a budget itself is acted on at once)."""
    prometheus_url: str = ""
    """Base URL of the Prometheus that scrapes the node agents (e.g.
    ``http://prometheus-operated.monitoring:9090``): the power budgets read each domain's draw,
    unmanaged GPUs included, from it; empty: from the node plans' reports (managed GPUs only)."""
    prometheus_timeout_s: float = 5.0
    """Longest one query of that Prometheus may take."""
    metrics_port: int = 8080
    """Port of ``/metrics``; 0 disables it."""
    metrics_address: str = "0.0.0.0"
    kubeconfig: str = ""
    """Path of a kubeconfig; empty: the pod's service account (in-cluster)."""
    default_policy: str = ""
    """JSON of a ``spec.policy``: the values of the fields a PerseusJob leaves unset."""
    leader_election_namespace: str = ""
    """Namespace of the leader election Lease; empty: no leader election (run one replica)."""
    leader_election_lease: str = "perseus-operator"
    """Name of the Lease."""
    leader_election_identity: str = ""
    """This replica's holder identity; empty: ``<hostname>_<pid>`` (the pod's name in a pod)."""
    lease_duration_s: float = 15.0
    """A standby takes the Lease over after seeing it unrenewed for this long."""
    renew_deadline_s: float = 10.0
    """The leader exits if it could not renew the Lease for this long."""
    retry_period_s: float = 2.0
    """Between two renewals (and two attempts of a standby)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Read the settings; unset ones keep their defaults.

        Raises:
            ConfigError: a value does not parse or is out of range.
        """
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            key = PREFIX + f.name.upper()
            raw = env.get(key)
            if raw is None or raw == "":
                continue
            kind = type(getattr(cls, f.name))
            try:
                values[f.name] = kind(raw)
            except ValueError:
                raise ConfigError(f"{key}={raw!r} is not a valid {kind.__name__}") from None
        config = cls(**values)  # type: ignore[arg-type]
        config.check()
        return config

    def check(self) -> None:
        positive = (
            "reconcile_interval_s",
            "planner_timeout_s",
            "release_timeout_s",
            "policy_interval_s",
            "budget_interval_s",
            "prometheus_timeout_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{PREFIX}{name.upper()} must be > 0, got {getattr(self, name)}")
        url = self.prometheus_url
        if url and not (url.startswith(("http://", "https://")) and len(url.split("/")[2]) > 0):
            raise ConfigError(f"{PREFIX}PROMETHEUS_URL must be an http(s) URL, got {url!r}")
        if self.planner_workers < 1:
            raise ConfigError(f"{PREFIX}PLANNER_WORKERS must be >= 1, got {self.planner_workers}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"{PREFIX}METRICS_PORT must be 0..65535, got {self.metrics_port}")
        self.default_policy_fields()
        try:
            self.leader_election_timings().check()
        except ValueError as exc:
            raise ConfigError(
                f"{PREFIX}RETRY_PERIOD_S, {PREFIX}RENEW_DEADLINE_S, {PREFIX}LEASE_DURATION_S: {exc}"
            ) from None

    def leader_election_timings(self) -> Timings:
        return Timings(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)

    def default_policy_fields(self) -> dict[str, Any]:
        """The default policy's fields as set (camelCase), validated.

        Raises:
            ConfigError: not a JSON object, or not a valid policy.
        """
        if not self.default_policy.strip():
            return {}
        key = f"{PREFIX}DEFAULT_POLICY"
        try:
            fields = json.loads(self.default_policy)
        except ValueError as exc:
            raise ConfigError(f"{key} is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ConfigError(f"{key} must be a JSON object (a spec.policy)")
        try:
            Policy.model_validate(fields)
        except ValidationError as exc:
            raise ConfigError(f"{key} is not a valid policy: {validation_summary(exc)}") from None
        return fields
