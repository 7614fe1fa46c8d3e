"""Malformed PerseusJob specs and the message each must get (operator tests share them).

The API server rejects most of these with the CRD's schema and CEL rules; the operator must
also reject them itself, precisely and without disturbing other jobs, because a spec can reach
it unchecked (an API server without the CRD's validation, or a test's in-memory API).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    def mutate(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = spec
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = value

    return mutate


def _delete(path: str) -> Mutation:
    def mutate(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = spec
        for name in parents:
            node = node[name]
        del node[last]

    return mutate


# (case id, mutation of a valid spec, phase, the message's text)
MALFORMED: list[tuple[str, Mutation, str, str]] = [
    ("no-workload", _delete("workload"), "Failed", "invalid spec: workload: Field required"),
    (
        "unknown-workload-kind",
        _set("workload.kind", "MPIJob"),
        "Failed",
        "invalid spec: workload.kind: Input should be 'PyTorchJob', 'JobSet', 'TrainJob' or 'Pods'",
    ),
    (
        "pods-with-a-name",
        _set("workload.name", "gpt3"),
        "Failed",
        "invalid spec: workload: Value error, kind Pods needs podSelector (and no name)",
    ),
    (
        "empty-pod-selector",
        _set("workload.podSelector", {}),
        "Failed",
        "invalid spec: workload.podSelector: Value error, a pod selector must have matchLabels "
        "or matchExpressions",
    ),
    (
        "in-without-values",
        _set("workload.podSelector.matchExpressions", [{"key": "app", "operator": "In"}]),
        "Failed",
        "invalid spec: workload.podSelector.matchExpressions.0: Value error, operators In and "
        "NotIn need values",
    ),
    (
        "no-parallelism",
        _delete("parallelism"),
        "Failed",
        "invalid spec: parallelism: Field required",
    ),
    (
        "stages-not-a-number",
        _set("parallelism.pipelineStages", "eight"),
        "Failed",
        "invalid spec: parallelism.pipelineStages: Input should be a valid integer",
    ),
    (
        "one-stage",
        _set("parallelism.pipelineStages", 1),
        "Failed",
        "invalid spec: parallelism.pipelineStages: Input should be greater than or equal to 2",
    ),
    (
        "zero-replicas",
        _set("parallelism.dataParallel", 0),
        "Failed",
        "invalid spec: parallelism.dataParallel: Input should be greater than or equal to 1",
    ),
    (
        "too-few-microbatches",
        _set("parallelism.microbatches", 2),
        "Failed",
        "invalid spec: parallelism: Value error, 1F1B needs at least as many microbatches as "
        "pipeline stages (got 2 microbatches for 4 stages)",
    ),
    (
        "unknown-schedule",
        _set("parallelism.schedule", "ZBV"),
        "Failed",
        "invalid spec: parallelism.schedule: Input should be '1F1B', 'GPipe', 'Interleaved1F1B' "
        "or 'ZBH1'",
    ),
    (
        "unknown-rank-order",
        _set("rankMapping.order", "pp-dp-tp"),
        "Failed",
        "invalid spec: rankMapping.order: Input should be 'tp-dp-pp' or 'tp-pp-dp'",
    ),
    (
        "unknown-mode",
        _set("policy.mode", "Turbo"),
        "Failed",
        "invalid spec: policy.mode: Input should be 'Observe', 'Intrinsic' or 'StragglerAware'",
    ),
    (
        "unknown-granularity",
        _set("policy.granularity", "Kernel"),
        "Failed",
        "invalid spec: policy.granularity: Input should be 'Stage' or 'Instruction'",
    ),
    (
        "negative-slowdown",
        _set("policy.maxSlowdown", -0.1),
        "Failed",
        "invalid spec: policy.maxSlowdown: Input should be greater than or equal to 0",
    ),
    (
        "slowdown-too-large",
        _set("policy.maxSlowdown", 0.9),
        "Failed",
        "invalid spec: policy.maxSlowdown: Input should be less than or equal to 0.5",
    ),
    (
        "clock-range-inverted",
        _set("policy.frequencyMHz", {"minMHz": 1410, "maxMHz": 900}),
        "Failed",
        "invalid spec: policy.frequencyMHz: Value error, minMHz must not exceed maxMHz "
        "(got 1410 > 900)",
    ),
    (
        "zero-blocking-power",
        _set("policy.blockingPowerWatts", 0),
        "Failed",
        "invalid spec: policy.blockingPowerWatts: Input should be greater than 0",
    ),
    (
        "zero-iterations-per-clock",
        _set("profiling.iterationsPerFrequency", 0),
        "Failed",
        "invalid spec: profiling.iterationsPerFrequency: Input should be greater than or equal "
        "to 1",
    ),
    (
        "no-hysteresis",
        _set("stragglers.recoveryThreshold", 1.05),
        "Failed",
        "invalid spec: stragglers: Value error, recoveryThreshold must be below "
        "slowdownThreshold (hysteresis)",
    ),
    (
        "unknown-field",
        _set("policy.turbo", True),
        "Failed",
        "invalid spec: policy.turbo: Extra inputs are not permitted",
    ),
    (
        "missing-workload-object",
        _set("workload", {"kind": "PyTorchJob", "name": "nope"}),
        "Pending",
        "PyTorchJob ml/nope does not exist (yet); waiting for it",
    ),
    (
        "parallelism-does-not-fit-the-pods",
        _set("parallelism.dataParallel", 1),
        "Failed",
        "parallelism asks for dp 1 x pp 4 x tp 1 = 4",
    ),
    (
        "missing-stored-profile",
        _set("profiling.profileRef", {"configMapName": "missing"}),
        "Failed",
        "profileRef: ConfigMap missing does not exist",
    ),
]


def malformed(spec: dict[str, Any], mutation: Mutation) -> dict[str, Any]:
    """A deep copy of ``spec`` with ``mutation`` applied."""
    copied = copy.deepcopy(spec)
    mutation(copied)
    return copied
