"""What one node agent applies: the plans of one job for the GPUs of one node.

The operator writes one ``NodePlan`` per (job, node); a standalone agent reads
the same document from a file. The operator names each GPU by the process that runs on it:
``pod`` (with ``pod_uid``), ``container`` and ``local_rank``, never by a node GPU index it
would have to guess. The agent asks the kubelet which GPUs it allocated to that container
(PodResources API, :mod:`perseus_agent.ownership.gpu_ownership`) and takes the ``local_rank``-th of
them in the node's GPU order, the order CUDA enumerates them in inside the container. A
hand-written file for a bare-metal node (standalone agent) names GPUs by UUID or index.
Each GPU follows one pipeline plan at one stage. Several plans can coexist because a
straggler's own replica keeps running at ``T_min`` while the others slow down.

With ``profiling`` set the agent measures instead of applying: every assigned GPU runs the
clocks of :class:`ProfilingSpec` in turn while its training process calls in, and the agent
reports the time and energy of each (stage, instruction, clock), the profile the planner reads.
The plans and assignments still say which GPU runs which stage.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Final, Literal

from pydantic import Field, field_validator, model_validator

from perseus_api.plan import API_VERSION, Granularity, PipelinePlan, _Model

MIN_POWER_LIMIT_W: Final = 1.0
MAX_POWER_LIMIT_W: Final = 5000.0
"""Bounds of a plan's per-GPU power limit: beyond what any GPU accepts on either side (the agent
clamps to the GPU's own range), tight enough to catch a unit mistake (milliwatts)."""


class GpuAssignment(_Model):
    """One GPU of the node and the plan (and stage) it follows."""

    gpu_uuid: str | None = Field(default=None, min_length=1)
    """UUID of the GPU (GPU-...), for a plan written by hand; the operator names the pod and
    local rank instead."""
    gpu_index: int | None = Field(default=None, ge=0)
    """Index of the GPU on the node (as nvidia-smi lists it), for a plan written by hand."""
    plan: str = Field(min_length=1, description="Key of the plan in NodePlan.plans.")
    stage: int = Field(ge=0, description="Pipeline stage (pp rank) this GPU runs.")
    dp_rank: int = Field(default=0, ge=0)
    """Data-parallel rank (pipeline replica) of the process on this GPU."""
    tp_rank: int = Field(default=0, ge=0)
    """Tensor-parallel rank of the process on this GPU."""
    rank: int | None = Field(
        default=None, ge=0, description="Global rank of the training process on this GPU."
    )
    pod: str | None = None
    """Name of the pod whose process runs on this GPU (in the plan's namespace)."""
    pod_uid: str | None = Field(
        default=None,
        min_length=1,
        description="The pod's metadata.uid: how the agent recognises the pod's processes "
        "(their cgroup) on its socket.",
    )
    container: str | None = Field(
        default=None,
        min_length=1,
        description="The container of the pod that holds the GPU; null: any of the pod's.",
    )
    local_rank: int | None = Field(
        default=None,
        ge=0,
        description="Local rank of the process in its pod: it runs on the local_rank-th GPU "
        "the kubelet allocated to the container, in the node's GPU order.",
    )
    power_limit_w: float | None = Field(
        default=None,
        ge=MIN_POWER_LIMIT_W,
        le=MAX_POWER_LIMIT_W,
        description="Power limit to set on this GPU, in watts, as a hard backstop under a "
        "power budget (the operator writes its share of the job's allocated watts plus the "
        "budget's safety margin). The agent clamps it to what the GPU accepts, records the limit "
        "it replaces and puts that back when the GPU leaves the plan, the plan goes or the "
        "agent stops. Null: the GPU's power limit is left as it is.",
    )

    @model_validator(mode="after")
    def _identified(self) -> GpuAssignment:
        by_process = self.pod is not None and self.local_rank is not None
        if self.gpu_uuid is None and self.gpu_index is None and not by_process:
            raise ValueError("an assignment needs gpu_uuid, gpu_index, or pod and local_rank")
        return self

    @property
    def gpu_label(self) -> str:
        if self.gpu_uuid is not None:
            return self.gpu_uuid
        if self.gpu_index is not None:
            return f"index {self.gpu_index}"
        return f"pod {self.pod} local rank {self.local_rank}"


class ProfilingSpec(_Model):
    """A profiling run: which SM clocks to measure, and for how many iterations each.

    The agent locks ``frequencies_mhz`` one after the other, in the order given, which must be
    strictly descending (highest clock first: the job starts close to its default clock and
    slows down step by step). A clock the GPU does not support is measured at the nearest
    supported one, and reported so; a clock whose nearest supported one is that of an earlier
    scheduled clock is skipped, so a sweep may be wider than the GPU's range.

    After every clock change the first ``warmup_iterations`` iterations are dropped; the next
    ``iterations_per_frequency`` are measured.
    """

    frequencies_mhz: list[Annotated[int, Field(gt=0)]] = Field(
        min_length=1, description="SM clocks to profile, strictly descending (MHz)."
    )
    iterations_per_frequency: int = Field(ge=1, description="Measured iterations per clock.")
    warmup_iterations: int = Field(
        ge=0, description="Iterations dropped after every clock change, before measuring."
    )

    @field_validator("frequencies_mhz")
    @classmethod
    def _descending(cls, clocks: list[int]) -> list[int]:
        seen: set[int] = set()
        for clock in clocks:
            if clock in seen:
                raise ValueError(f"{clock} MHz is listed more than once")
            seen.add(clock)
        for higher, lower in itertools.pairwise(clocks):
            if lower > higher:
                raise ValueError(
                    f"frequencies must be in descending order (highest first); "
                    f"{lower} MHz comes after {higher} MHz"
                )
        return clocks


MAX_ASSIGNMENTS: Final = 256
"""GPUs one node plan may assign: far more than any node has (8 or 16), few enough that a
plan written by hand cannot make an agent bind, apply and report thousands of entries."""
MAX_PLANS: Final = 16
"""Pipeline plans one node plan may carry (a job uses one, two with a straggler)."""


class NodePlan(_Model):
    """Frequency plans of one job for the GPUs of one node.

    In a PerseusNodePlan object ``namespace`` must be the object's own namespace (the node agent
    refuses the object otherwise): a plan manages pods of its own namespace only.
    """

    api_version: Literal["perseus.energy/v1alpha1"] = API_VERSION
    """Version of the plan format: perseus.energy/v1alpha1."""
    kind: Literal["NodePlan"] = "NodePlan"
    """Always NodePlan."""
    node: str = Field(min_length=1)
    """Name of the node whose agent applies this plan."""
    namespace: str = Field(
        default="default",
        min_length=1,
        description="The namespace of the job's pods: in a PerseusNodePlan, the object's own "
        "(the node agent refuses a plan naming another).",
    )
    job: str = Field(min_length=1)
    """Name of the PerseusJob this plan belongs to."""
    revision: int = Field(ge=0, description="Increases with every change; agents report it.")
    granularity: Granularity
    """How finely the agent controls clocks: Stage (one locked clock per GPU) or Instruction
    (the clock changes at every forward and backward)."""
    plans: dict[str, PipelinePlan] = Field(max_length=MAX_PLANS)
    """The pipeline plans, by name (usually one; a straggler's replica keeps its own)."""
    assignments: list[GpuAssignment] = Field(max_length=MAX_ASSIGNMENTS)
    """The GPUs of the node this plan controls, each with its plan and stage."""
    profiling: ProfilingSpec | None = Field(
        default=None,
        description="Profile the assigned GPUs instead of applying the plans (see ProfilingSpec).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> NodePlan:
        seen: set[str] = set()
        if self.profiling is not None and any(a.power_limit_w for a in self.assignments):
            raise ValueError(
                "a profiling plan cannot set power limits: they would distort the measurements"
            )
        for a in self.assignments:
            if a.plan not in self.plans:
                known = ", ".join(sorted(self.plans)) or "none"
                raise ValueError(f"GPU {a.gpu_label} refers to unknown plan {a.plan!r} ({known})")
            stages = self.plans[a.plan].num_stages
            if a.stage >= stages:
                raise ValueError(
                    f"GPU {a.gpu_label} is at stage {a.stage} but plan {a.plan!r} has "
                    f"{stages} stages"
                )
            process = None if a.local_rank is None else f"{a.pod}/{a.container}#{a.local_rank}"
            for key in (f"uuid:{a.gpu_uuid}", f"index:{a.gpu_index}", f"process:{process}"):
                if not key.endswith(":None"):
                    if key in seen:
                        raise ValueError(f"GPU {a.gpu_label} is assigned twice")
                    seen.add(key)
        return self
