"""Builders of valid test documents, for tests to modify into invalid ones."""

from __future__ import annotations

from typing import Any

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
