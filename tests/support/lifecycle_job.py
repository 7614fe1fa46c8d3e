"""The PerseusJob the operator's lifecycle tests run: a ``Pods`` workload of two pods, one per
node, each a pipeline replica of four GPUs; its pods, its body and the profile its GPUs
measure."""

from __future__ import annotations

from typing import Any

from perseus_api.profile import parse_profile
from support.operator_harness import cut_profile

NS, JOB = "ml", "gpt3"
STAGES, DP, MICROBATCHES, GPUS_PER_POD = 4, 2, 8, 4
NODES = ("node-0", "node-1")

PROFILE = parse_profile(cut_profile(STAGES), "cut")


def pod(index: int, *, node: str | None = "auto", phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": f"{JOB}-{index}", "namespace": NS, "labels": {"app": JOB}},
        "spec": {
            "nodeName": f"node-{index}" if node == "auto" else node,
            "containers": [
                {
                    "name": "trainer",
                    "env": [{"name": "JOB_COMPLETION_INDEX", "value": str(index)}],
                    "resources": {"limits": {"nvidia.com/gpu": str(GPUS_PER_POD)}},
                }
            ],
        },
        "status": {"phase": phase},
    }


def job_body(**policy: Any) -> dict[str, Any]:
    return {
        "apiVersion": "perseus.energy/v1alpha1",
        "kind": "PerseusJob",
        "metadata": {"name": JOB, "namespace": NS, "uid": "uid-1", "generation": 1},
        "spec": {
            "workload": {"kind": "Pods", "podSelector": {"matchLabels": {"app": JOB}}},
            "parallelism": {
                "pipelineStages": STAGES,
                "dataParallel": DP,
                "microbatches": MICROBATCHES,
            },
            "policy": {"blockingPowerWatts": 83.64, **policy},
            "profiling": {"iterationsPerFrequency": 2, "warmupIterations": 1},
            "stragglers": {"persistenceReports": 2, "warmupIterations": 0},
        },
    }
