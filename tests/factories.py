"""Builders of valid test documents, for tests to modify into invalid ones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from perseus_api.node_report import GpuProfilingReport, ProfileRow
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
