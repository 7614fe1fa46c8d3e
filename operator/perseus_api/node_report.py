"""The status of a ``PerseusNodePlan``: what the node agent reports, and the operator reads.

The node agent builds a :class:`NodePlanStatus` (its :class:`NodeReport` of the plan, plus the
revision it acted on, when, and the ``Applied`` condition) and writes
:func:`status_document` of it; the operator reads it back once per object with
:func:`parse_node_plan_status`; the CRD's status schema is generated from it
(:mod:`perseus_api.crd`). One model, so that the two programs cannot drift apart.

On the wire the keys are camelCase with units spelled out, as in the rest of the API
(``dp_rank`` is ``dpRank``, ``mean_iteration_s`` ``meanIterationSeconds``, ``applied_mhz``
``appliedMHz``: :func:`wire_name`); in Python they are snake_case.

Rolling upgrades: agents before this model wrote the report's keys in snake_case (and
``observedRevision``, ``reportedAt`` and the conditions in camelCase, as now). Both spellings
parse (``populate_by_name``), so an operator reads old and new agents alike. An agent patches
its status with a JSON merge patch, which keeps every key the patch does not name; so
:func:`status_document` also writes null for each top-level key's old spelling, and a status
never carries both. (Lists are replaced whole by a merge patch: the keys inside ``gpus``,
``ranks`` and ``profiling`` need no such care.) Unknown keys are ignored, so an operator also
reads an agent newer than itself. An operator older than this model reads none of a new agent's
camelCase report keys (it sees no ranks and no profiling results until it is upgraded): upgrade
the operator first, or both at once (one ``helm upgrade`` does).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from perseus_api.plan import Granularity

__all__ = [
    "GpuProfilingReport",
    "GpuReport",
    "GpuStatus",
    "InstructionName",
    "NodePlanStatus",
    "NodeReport",
    "ProfileRow",
    "RankReport",
    "StatusCondition",
    "legacy_keys",
    "status_document",
    "wire_name",
]

ITERATION_WINDOW: Final = 20
"""Iterations per rank the agent keeps for the report's mean iteration time."""

_UNITS: Final = (("_mhz", "MHz"), ("_s", "Seconds"), ("_w", "Watts"), ("_j", "Joules"))

InstructionName = Literal["forward", "backward", "backward_input", "backward_weight"]


def wire_name(field: str) -> str:
    """The camelCase key of a snake_case field, its unit spelled out as in the rest of the API
    (``mean_iteration_s`` -> ``meanIterationSeconds``, ``target_mhz`` -> ``targetMHz``)."""
    for suffix, unit in _UNITS:
        if field.endswith(suffix) and len(field) > len(suffix):
            return to_camel(field.removesuffix(suffix)) + unit
    return to_camel(field)


class _Wire(BaseModel):
    """camelCase on the wire; snake_case (an older agent's keys) is read too; unknown keys
    (a newer agent's) are ignored. Every nullable field defaults to null: the API server drops
    null fields of the objects in a merge patch's lists, so a null is stored as absent."""

    model_config = ConfigDict(
        alias_generator=wire_name,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
        # A field's docstring is its description in the CRD (kubectl explain).
        use_attribute_docstrings=True,
    )


class GpuStatus(StrEnum):
    APPLIED = "Applied"
    """The clock the plan asks for is in effect."""
    CLAMPED = "Clamped"
    """The GPU does not support the planned clock; the nearest supported one is in effect."""
    FAILED = "Failed"
    """The plan could not be applied to this GPU (see the message)."""
    WAITING = "Waiting"
    """Instruction granularity: waiting for the training process to call in."""


class GpuReport(_Wire):
    """What was applied to one GPU of the plan."""

    uuid: str | None = Field(
        default=None, description="The GPU's UUID; null if the GPU was not found."
    )
    index: int | None = Field(
        default=None, description="The GPU's index; null if the GPU was not found."
    )
    plan: str
    """The plan (key of spec.plans) the GPU follows."""
    stage: int
    """The pipeline stage the GPU runs."""
    dp_rank: int = 0
    """Data-parallel rank (pipeline replica) of the process on the GPU."""
    rank: int | None = None
    """Global rank of the training process on the GPU, if the plan names it."""
    target_mhz: int | None = Field(
        default=None, description="Clock the plan asks for (now, for Instruction)."
    )
    applied_mhz: int | None = Field(default=None, description="Clock locked by the agent, if any.")
    status: GpuStatus
    """Applied, Clamped (nearest supported clock), Failed (see message) or Waiting (for the
    training process to call in)."""
    message: str = ""
    """Why the plan could not be applied as written; empty when it was."""
    energy_j: float | None = Field(
        default=None,
        ge=0,
        description="The GPU's energy counter (NVML total energy since the driver loaded), "
        "read when the report was written; the operator derives each power domain's draw from "
        "two reports' counters and times. Null from agents that do not read it.",
    )
    power_limit_w: float | None = Field(
        default=None,
        description="The power limit the agent set on the GPU (the plan's, clamped to what the "
        "GPU accepts), in watts; null when it set none.",
    )
    power_limit_message: str = ""
    """Why the plan's power limit was not set as written (clamped, another owner's limit, a GPU
    error); empty when it was or the plan sets none."""


class RankReport(_Wire):
    """Iteration times of one training rank on this node, measured by the agent."""

    rank: int
    """Global rank of the training process."""
    dp_rank: int | None = None
    """Its data-parallel rank (pipeline replica), if known."""
    pp_rank: int | None = None
    """Its pipeline stage, if known."""
    iterations: int = Field(description="Iterations measured since the rank called in.")
    last_iteration_s: float
    """Time of its last iteration (seconds)."""
    mean_iteration_s: float = Field(
        description=f"Over the last {ITERATION_WINDOW} iterations under ``revision``."
    )
    revision: int | None = Field(
        default=None,
        description="Node plan revision every iteration of the mean ran under (None: no plan). "
        "The mean restarts with each revision, so it reflects the plan now in effect only.",
    )


class ProfileRow(_Wire):
    """Median time and energy of one computation of a stage at one SM clock."""

    stage: int = Field(
        ge=0,
        description="Model stage: the GPU's pipeline stage, plus chunk x stages when the "
        "GPU runs several (virtual) stages.",
    )
    instruction: InstructionName
    """The computation: forward, backward, backward_input or backward_weight."""
    frequency_mhz: int = Field(gt=0, description="The SM clock in effect while measured.")
    time_s: float = Field(description="Median time of one computation.")
    energy_j: float = Field(description="Median energy of one computation.")
    samples: int = Field(ge=1, description="Computations measured.")


class GpuProfilingReport(_Wire):
    """Progress and, once done, results of profiling one GPU (one stage)."""

    uuid: str
    """The GPU's UUID."""
    index: int
    """The GPU's index on the node."""
    stage: int
    """The pipeline stage the GPU runs."""
    rank: int | None = Field(
        default=None, description="Global rank of the training process the plan put here."
    )
    frequencies_mhz: list[int] = Field(description="The scheduled clocks, in order.")
    applied_mhz: list[int | None] = Field(
        description="The clock each scheduled one was measured at (another one when clamped); "
        "null until reached."
    )
    frequency_index: int = Field(
        description="Index of the clock being measured in frequencies_mhz; its length once "
        "every clock is measured."
    )
    measured_iterations: int = Field(description="Measured iterations in the results so far.")
    dropped_iterations: int = Field(
        description="Iterations to measure that were incomplete or not covered by energy samples."
    )
    done: bool = Field(description="Every clock measured and every energy computed.")
    rows: list[ProfileRow] = Field(
        default_factory=list,
        description="Once done: mean time and energy per (instruction, clock), the rows of "
        "the profile CSV the planner reads.",
    )
    blocking_power_w: float | None = Field(
        default=None,
        description="Once done: power outside computations in measured iterations; null when "
        "they spent too little time there to measure it.",
    )
    blocking_s: float = Field(
        default=0.0,
        description="Time outside computations over the measured iterations (the weight of "
        "blocking_power_w when combining GPUs).",
    )

    @model_validator(mode="before")
    @classmethod
    def _older_rows(cls, data: Any) -> Any:
        """Rows of an agent older than virtual stages name no stage (they are the report's)
        and no sample count (one computation each)."""
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            return data
        stage = data.get("stage")
        rows = [
            {"stage": stage, "samples": 1, **row} if isinstance(row, dict) else row
            for row in data["rows"]
        ]
        return {**data, "rows": rows}


class NodeReport(_Wire):
    """The state of one node plan on this node, for the operator."""

    node: str
    """The node the agent runs on."""
    job: str
    """The PerseusJob of the plan."""
    namespace: str
    """The namespace of the job's pods."""
    revision: int
    """The spec.revision applied."""
    granularity: Granularity
    """The granularity applied: Stage or Instruction."""
    gpus: list[GpuReport]
    """What was applied to each GPU of the plan."""
    ranks: list[RankReport] = Field(default_factory=list)
    """Iteration times of the training ranks on this node."""
    profiling: list[GpuProfilingReport] = Field(
        default_factory=list, description="Per profiled GPU, when the plan profiles."
    )


class StatusCondition(_Wire):
    """A condition of the node plan: the agent writes one, of type ``Applied``."""

    type: str = Field(description="Condition type: Applied.")
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str = Field(
        default="",
        description="One of Applied, Failed, InvalidSpec, AgentStopped, DriverUpgrade.",
    )
    message: str = ""
    """Human-readable details of the reason."""
    last_transition_time: str | None = Field(default=None, description="RFC 3339.")


_LISTS: Final = frozenset(("conditions", "gpus", "ranks", "profiling"))
"""The status's lists (one word each: spelled alike in both spellings)."""


class NodePlanStatus(_Wire):
    """The whole ``status`` of a PerseusNodePlan, written by its node agent only.

    The :class:`NodeReport` fields are absent (null) when nothing is applied: the spec is
    invalid, the agent stopped, or the node's driver is being upgraded (the condition says).
    """

    observed_revision: int | None = Field(
        default=None, description="The spec.revision the agent last acted on."
    )
    reported_at: str | None = Field(
        default=None,
        description="When the agent wrote this report (RFC 3339); rewritten every report "
        "interval while the agent lives, so a stale one means a dead or cut-off agent.",
    )
    report_interval_s: float | None = Field(
        default=None,
        description="The agent's report interval. An agent that says it writes only reports "
        "that say something new (iteration times out of its dead-band, anything else changed) "
        "plus a heartbeat: a report not rewritten for this long is one more report of the "
        "same times. Null: every report is written.",
    )
    heartbeat_s: float | None = Field(
        default=None,
        description="Longest time between two writes of a live agent's report (null: the "
        "report interval). The operator takes telemetry for stale only when it is older than "
        "twice this, or staleAfterSeconds if longer.",
    )
    conditions: list[StatusCondition] = Field(default_factory=list)
    """The agent's Applied condition."""
    node: str | None = None
    """The node the agent runs on."""
    job: str | None = None
    """The PerseusJob of the plan."""
    namespace: str | None = None
    """The namespace of the job's pods."""
    revision: int | None = None
    """The spec.revision applied."""
    granularity: Granularity | None = None
    """The granularity applied: Stage or Instruction."""
    gpus: list[GpuReport] = Field(default_factory=list)
    """What was applied to each GPU of the plan."""
    ranks: list[RankReport] = Field(default_factory=list)
    """Iteration times of the training ranks on this node, measured by the agent."""
    profiling: list[GpuProfilingReport] = Field(
        default_factory=list, description="Per profiled GPU, when the plan profiles."
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_empty(cls, data: Any) -> Any:
        """A list written null is removed by the merge patch; read one that is not (a status
        built by hand, or not yet merged) as empty too."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _LISTS}
        return data

    @classmethod
    def of_report(
        cls, report: NodeReport, *, reported_at: str, conditions: list[StatusCondition]
    ) -> NodePlanStatus:
        """The status of a node plan applied as ``report`` says."""
        return cls(
            observed_revision=report.revision,
            reported_at=reported_at,
            conditions=conditions,
            **{name: getattr(report, name) for name in NodeReport.model_fields},
        )


def legacy_keys() -> tuple[str, ...]:
    """The top-level keys an older agent wrote (the report's fields in snake_case) that differ
    from their wire name: none today, as every report field is one word; kept so that a new
    field cannot leave an old agent's key behind."""
    return tuple(name for name in NodeReport.model_fields if wire_name(name) != name)


def status_document(status: NodePlanStatus) -> dict[str, Any]:
    """``status`` as the agent writes it (a JSON merge patch of the ``status`` subresource):
    camelCase; every report field named, null where unset (which removes a previous
    report's); the other fields only where set (an unset ``reportedAt`` keeps the last one);
    and null for each old spelling of a key (see the module's docstring)."""
    document = status.model_dump(mode="json", by_alias=True)
    for name in NodePlanStatus.model_fields:
        if name in status.model_fields_set:
            continue
        if name in NodeReport.model_fields:
            document[wire_name(name)] = None
        else:
            del document[wire_name(name)]
    return {**dict.fromkeys(legacy_keys()), **document}
