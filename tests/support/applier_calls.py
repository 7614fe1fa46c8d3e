"""Node plans for the plan applier (two stages, two microbatches, a clock per computation) and
the calls a training process makes on it."""

from __future__ import annotations

from typing import Any

from perseus_agent.control.applier import PlanApplier
from perseus_agent.serving.client_dispatch import ClientSession
from perseus_api.node_plan import NodePlan
from support.factories import pipeline_plan_fields

NODE = "node-1"

# 1F1B order of stage 0 of a 2-stage, 2-microbatch pipeline, each with its own clock.
STAGE0_SCHEDULE = [
    ("forward", 0, 1200),
    ("forward", 1, 1110),
    ("backward", 0, 1410),
    ("backward", 1, 1305),
]
STAGE1_SCHEDULE = [
    ("forward", 0, 1005),
    ("backward", 0, 1095),
    ("forward", 1, 1005),
    ("backward", 1, 1097),  # not a supported clock: clamped to 1095
]


def pipeline_fields(stage_mhz: tuple[int, int] = (1200, 1005)) -> dict[str, Any]:
    fields = pipeline_plan_fields(num_stages=2, num_microbatches=2)
    for stage, schedule in zip(fields["stages"], (STAGE0_SCHEDULE, STAGE1_SCHEDULE), strict=True):
        stage["frequency_mhz"] = stage_mhz[stage["stage"]]
        stage["instructions"] = [
            {"instruction": kind, "microbatch": mb, "frequency_mhz": mhz}
            for kind, mb, mhz in schedule
        ]
    return fields


def node_plan(
    assignments: list[dict[str, Any]],
    *,
    granularity: str = "Stage",
    revision: int = 1,
    stage_mhz: tuple[int, int] = (1200, 1005),
    node: str = NODE,
) -> NodePlan:
    return NodePlan.model_validate(
        {
            "node": node,
            "namespace": "ml",
            "job": "gpt3",
            "revision": revision,
            "granularity": granularity,
            "plans": {"tmin": pipeline_fields(stage_mhz)},
            "assignments": assignments,
        }
    )


def gpu(index: int, stage: int, *, by_uuid: bool = True, **extra: Any) -> dict[str, Any]:
    key = {"gpu_uuid": f"GPU-{index}"} if by_uuid else {"gpu_index": index}
    return {**key, "plan": "tmin", "stage": stage, **extra}


def session(connection_id: int = 1) -> ClientSession:
    return ClientSession(connection_id, None, None, None, 0)


def hello(
    applier: PlanApplier, s: ClientSession, *, uuids: list[str], rank: int | None = None
) -> dict[str, Any]:
    return applier.hello(
        s,
        {
            "op": "hello",
            "version": 1,
            "rank": rank,
            "local_rank": None,
            "gpu_uuids": uuids,
            "pid": 42,
            "job": "gpt3",
            "namespace": "ml",
            "pod": "gpt3-worker-0",
        },
        0,
    )


def begin(applier: PlanApplier, s: ClientSession, name: str, mb: int | None) -> int | None:
    reply = applier.instruction_begin(
        s,
        {"op": "instruction_begin", "name": name, "microbatch": mb},  # type: ignore[typeddict-item]
        0,
    )
    assert reply["ok"] is True
    clock: int | None = reply["sm_clock_mhz"]
    return clock


def step_begin(applier: PlanApplier, s: ClientSession, t_ns: int = 0) -> None:
    applier.step_begin(s, {"op": "step_begin", "step": 1}, t_ns)
