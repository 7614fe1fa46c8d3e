"""Builders of valid test documents, for tests to modify into invalid ones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from perseus_api.node_report import (
    GpuProfilingReport,
    GpuReport,
    GpuStatus,
    NodeReport,
    ProfileRow,
    RankReport,
)
from perseus_api.plan import Granularity
from perseus_api.schedule import stage_instruction_order


def pipeline_plan_fields(num_stages: int = 2, num_microbatches: int = 2) -> dict[str, Any]:
    """Fields of a valid ``PipelinePlan`` with every clock set."""
    estimate = {"iteration_time_s": 1.0, "energy_j": 100.0, "savings_ratio": 0.1}
    return {
        "schedule": "1f1b",
        "num_stages": num_stages,
        "num_microbatches": num_microbatches,
        "granularity": "Instruction",
        "objective": "MinTime",
        "unit_time_s": 0.001,
        "blocking_power_w": 80.0,
        "t_min_s": 1.0,
        "t_star_s": 1.2,
        "baseline_iteration_time_s": 1.01,
        "instruction_estimate": estimate,
        "stage_estimate": estimate,
        "stages": [
            {
                "stage": s,
                "frequency_mhz": 1410,
                "instructions": [
                    {"instruction": kind, "microbatch": m, "frequency_mhz": 1200}
                    for kind, m in stage_instruction_order("1f1b", num_stages, num_microbatches, s)
                ],
            }
            for s in range(num_stages)
        ],
    }


def profiling_report(
    stage: int,
    rows: Sequence[Mapping[str, Any]] = (),
    *,
    done: bool = True,
    blocking_power_w: float | None = None,
    blocking_s: float = 0.0,
) -> GpuProfilingReport:
    """An agent's profiling report of the GPU of pipeline ``stage`` (``rows``: ProfileRow
    fields, by name), as it appears in a node plan's ``status.profiling``."""
    clocks = sorted({int(r["frequency_mhz"]) for r in rows}, reverse=True) or [1410]
    return GpuProfilingReport(
        uuid=f"GPU-{stage}",
        index=stage,
        stage=stage,
        frequencies_mhz=clocks,
        applied_mhz=list(clocks) if done else [None] * len(clocks),
        frequency_index=len(clocks) if done else 0,
        measured_iterations=1 if done else 0,
        dropped_iterations=0,
        done=done,
        rows=[ProfileRow.model_validate(r) for r in rows],
        blocking_power_w=blocking_power_w,
        blocking_s=blocking_s,
    )


# A node plan status as an agent before perseus_api.node_report wrote it (its report_status:
# the NodeReport dumped by field name, plus the camelCase keys it always had), kept literally
# so that it cannot follow the model.
OLD_AGENT_STATUS: dict[str, Any] = {
    "node": "n1",
    "job": "gpt3",
    "namespace": "ml",
    "revision": 4,
    "granularity": "Instruction",
    "gpus": [
        {
            "uuid": "GPU-0",
            "index": 0,
            "plan": "tmin",
            "stage": 1,
            "dp_rank": 2,
            "rank": 5,
            "target_mhz": 1410,
            "applied_mhz": 1395,
            "status": "Clamped",
            "message": "nearest supported clock",
        },
        {
            "uuid": None,
            "index": None,
            "plan": "tmin",
            "stage": 0,
            "dp_rank": 2,
            "rank": 4,
            "target_mhz": 1410,
            "applied_mhz": None,
            "status": "Failed",
            "message": "no GPU of this node is allocated to pod p0/c, local rank 1",
        },
    ],
    "ranks": [
        {
            "rank": 5,
            "dp_rank": 2,
            "pp_rank": 1,
            "iterations": 12,
            "last_iteration_s": 0.52,
            "mean_iteration_s": 0.5,
            "revision": 4,
        }
    ],
    "profiling": [
        {
            "uuid": "GPU-0",
            "index": 0,
            "stage": 1,
            "rank": 5,
            "frequencies_mhz": [1410, 1200],
            "applied_mhz": [1395, 1200],
            "frequency_index": 2,
            "measured_iterations": 6,
            "dropped_iterations": 1,
            "done": True,
            "rows": [
                {
                    "stage": 1,
                    "instruction": "forward",
                    "frequency_mhz": 1395,
                    "time_s": 0.01,
                    "energy_j": 3.0,
                    "samples": 3,
                }
            ],
            "blocking_power_w": 80.0,
            "blocking_s": 1.5,
        }
    ],
    "observedRevision": 4,
    "reportedAt": "2026-12-02T06:00:00.000+00:00",
    "conditions": [
        {
            "type": "Applied",
            "status": "True",
            "reason": "Applied",
            "message": "1 Clamped, 1 Failed: GPU pod p0: no GPU of this node ...",
            "lastTransitionTime": "2026-12-02T05:59:00Z",
        }
    ],
}


def node_report() -> NodeReport:
    """The report OLD_AGENT_STATUS carries, built from the models as the agent does."""
    return NodeReport(
        node="n1",
        job="gpt3",
        namespace="ml",
        revision=4,
        granularity=Granularity.INSTRUCTION,
        gpus=[
            GpuReport(
                uuid="GPU-0",
                index=0,
                plan="tmin",
                stage=1,
                dp_rank=2,
                rank=5,
                target_mhz=1410,
                applied_mhz=1395,
                status=GpuStatus.CLAMPED,
                message="nearest supported clock",
            ),
            GpuReport(
                plan="tmin",
                stage=0,
                dp_rank=2,
                rank=4,
                target_mhz=1410,
                status=GpuStatus.FAILED,
                message="no GPU of this node is allocated to pod p0/c, local rank 1",
            ),
        ],
        ranks=[
            RankReport(
                rank=5,
                dp_rank=2,
                pp_rank=1,
                iterations=12,
                last_iteration_s=0.52,
                mean_iteration_s=0.5,
                revision=4,
            )
        ],
        profiling=[
            GpuProfilingReport(
                uuid="GPU-0",
                index=0,
                stage=1,
                rank=5,
                frequencies_mhz=[1410, 1200],
                applied_mhz=[1395, 1200],
                frequency_index=2,
                measured_iterations=6,
                dropped_iterations=1,
                done=True,
                rows=[
                    ProfileRow(
                        stage=1,
                        instruction="forward",
                        frequency_mhz=1395,
                        time_s=0.01,
                        energy_j=3.0,
                        samples=3,
                    )
                ],
                blocking_power_w=80.0,
                blocking_s=1.5,
            )
        ],
    )


def merge_patch(target: Any, patch: Any) -> Any:
    """What the API server stores for a JSON merge patch (RFC 7386) of ``target``: as the RFC
    says, and with the null fields of objects inside lists dropped too, as Kubernetes' merge
    patch library does (null elements of a list are kept)."""
    if not isinstance(patch, Mapping):
        return _pruned(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pruned(value: Any) -> Any:
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    return value
