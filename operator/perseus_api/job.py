"""The ``PerseusJob`` custom resource: the spec users write.

These pydantic models are the single definition of the resource: the CRD in ``crds/`` is
generated from them (:mod:`perseus_api.crd`), the operator parses every object it sees with
them, and the samples in ``crds/samples/`` are tested against both. Field names are the
Kubernetes camelCase ones on the wire (``pipelineStages``); in Python they are snake_case.
What the operator reports back, and the whole object, are in :mod:`perseus_api.job_status`
(which imports this module, never the reverse); the ``profiling`` section is in
:mod:`perseus_api.job_profiling`, the base all spec models share in :mod:`perseus_api.spec_model`.

Rules that span several fields are written twice on purpose: as CEL rules (the ``*_RULES``
constants, enforced by the API server, so ``kubectl apply`` fails at once) and as
pydantic validators (so the operator, tests and tools reject the same objects with the same
message when no API server checks them).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from perseus_api.job_profiling import Profiling
from perseus_api.plan import Granularity
from perseus_api.spec_model import _SECTION, _rules, _Spec

JOB_KIND: Final = "PerseusJob"
JOB_PLURAL: Final = "perseusjobs"
JOB_SINGULAR: Final = "perseusjob"
JOB_SHORT_NAMES: Final = ("pj",)


# -- spec ------------------------------------------------------------------------------------------


class WorkloadKind(StrEnum):
    PYTORCH_JOB = "PyTorchJob"
    JOB_SET = "JobSet"
    TRAIN_JOB = "TrainJob"
    PODS = "Pods"


REQUIREMENT_RULES: Final = (
    (
        "self.operator in ['In', 'NotIn'] ? has(self.values) && size(self.values) > 0 "
        ": !has(self.values) || size(self.values) == 0",
        "operators In and NotIn need values; Exists and DoesNotExist take none",
    ),
)
SELECTOR_RULES: Final = (
    (
        "(has(self.matchLabels) && size(self.matchLabels) > 0) || "
        "(has(self.matchExpressions) && size(self.matchExpressions) > 0)",
        "a pod selector must have matchLabels or matchExpressions",
    ),
)


class LabelSelectorRequirement(_Spec):
    """One requirement on an object's labels."""

    model_config = ConfigDict(json_schema_extra=_rules(*REQUIREMENT_RULES))

    key: str = Field(min_length=1, max_length=317)
    """The label key the requirement is about."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """In or NotIn: the label's value is (is not) one of values. Exists or DoesNotExist: the label
    is (is not) present."""
    values: list[str] = Field(default_factory=list)
    """The values for In and NotIn; empty for Exists and DoesNotExist."""

    @model_validator(mode="after")
    def _values_fit_operator(self) -> LabelSelectorRequirement:
        needs_values = self.operator in ("In", "NotIn")
        if needs_values != bool(self.values):
            raise ValueError(
                f"{REQUIREMENT_RULES[0][1]} (got {self.operator} with {len(self.values)} values)"
            )
        return self


class LabelSelector(_Spec):
    """A Kubernetes label selector (``matchLabels`` and ``matchExpressions``)."""

    model_config = ConfigDict(json_schema_extra=_rules(*SELECTOR_RULES))

    match_labels: dict[str, str] = Field(default_factory=dict)
    """Labels an object must carry, each with this value."""
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)
    """Requirements an object's labels must all meet."""

    @model_validator(mode="after")
    def _not_empty(self) -> LabelSelector:
        if not self.match_labels and not self.match_expressions:
            raise ValueError(SELECTOR_RULES[0][1])
        return self


WORKLOAD_RULES: Final = (
    (
        "self.kind == 'Pods' ? has(self.podSelector) && !has(self.name) "
        ": has(self.name) && !has(self.podSelector)",
        "kind Pods needs podSelector (and no name); other kinds need name (and no podSelector)",
    ),
)


class Workload(_Spec):
    """The training workload whose GPUs Perseus manages (in the PerseusJob's namespace)."""

    model_config = ConfigDict(json_schema_extra=_rules(*WORKLOAD_RULES))

    kind: WorkloadKind = Field(description="PyTorchJob, JobSet, TrainJob, or Pods by selector.")
    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="Name of the PyTorchJob, JobSet or TrainJob.",
    )
    pod_selector: LabelSelector | None = Field(
        default=None, description="For kind Pods: the training pods."
    )

    @model_validator(mode="after")
    def _identified(self) -> Workload:
        if self.kind == WorkloadKind.PODS:
            if self.pod_selector is None or self.name is not None:
                raise ValueError(WORKLOAD_RULES[0][1])
        elif self.name is None or self.pod_selector is not None:
            raise ValueError(WORKLOAD_RULES[0][1])
        return self


class ScheduleName(StrEnum):
    ONE_F_ONE_B = "1F1B"
    GPIPE = "GPipe"
    INTERLEAVED_1F1B = "Interleaved1F1B"  # Megatron-LM's, with virtualStages per GPU
    ZBH1 = "ZBH1"  # zero bubble (Qi et al. 2024): backward split into input and weight


PARALLELISM_RULES: Final = (
    (
        "self.schedule != '1F1B' || self.microbatches >= self.pipelineStages",
        "1F1B needs at least as many microbatches as pipeline stages",
    ),
    (
        "self.schedule != 'Interleaved1F1B' || (self.virtualStages >= 2 && "
        "self.microbatches % self.pipelineStages == 0)",
        "Interleaved1F1B needs virtualStages >= 2 and microbatches a multiple of pipelineStages",
    ),
    (
        "self.schedule == 'Interleaved1F1B' || self.virtualStages == 1",
        "virtualStages above 1 need schedule Interleaved1F1B",
    ),
)


def check_schedulable(
    schedule: str, pipeline_stages: int, microbatches: int, virtual_stages: int = 1
) -> None:
    """The rules of :data:`PARALLELISM_RULES` in Python, for the CRD models and for
    ``perseus plan``/``simulate``, so that a pipeline the CLI plans is one the cluster takes.

    ``schedule`` in any spelling (``1F1B``, ``1f1b``, ``Interleaved1F1B``,
    ``interleaved-1f1b``, ``ZBH1``, ``zb-h1``).

    Raises:
        ValueError: 1F1B with fewer microbatches than stages; interleaved 1F1B with fewer
            than 2 virtual stages or microbatches not a multiple of the stages; virtual
            stages with another schedule.
    """
    name = schedule.lower().replace("-", "").replace("_", "")
    got = f"(got {microbatches} microbatches for {pipeline_stages} stages"
    if name == ScheduleName.ONE_F_ONE_B.lower() and microbatches < pipeline_stages:
        raise ValueError(f"{PARALLELISM_RULES[0][1]} {got})")
    if name == ScheduleName.INTERLEAVED_1F1B.lower():
        if virtual_stages < 2 or microbatches % pipeline_stages:
            raise ValueError(f"{PARALLELISM_RULES[1][1]} {got}, virtualStages {virtual_stages})")
    elif virtual_stages != 1:
        raise ValueError(f"{PARALLELISM_RULES[2][1]} (got {virtual_stages} with {schedule})")


class Parallelism(_Spec):
    """How the training job is split across GPUs: ``dataParallel x pipelineStages x
    tensorParallel`` ranks, one GPU each."""

    model_config = ConfigDict(json_schema_extra=_rules(*PARALLELISM_RULES))

    pipeline_stages: int = Field(ge=2, le=256, description="Pipeline-parallel degree.")
    data_parallel: int = Field(default=1, ge=1, le=65536, description="Data-parallel replicas.")
    tensor_parallel: int = Field(default=1, ge=1, le=64, description="Tensor-parallel degree.")
    microbatches: int = Field(ge=1, le=4096, description="Microbatches per iteration.")
    schedule: ScheduleName = Field(default=ScheduleName.ONE_F_ONE_B)
    """Pipeline schedule: 1F1B (default), GPipe, Interleaved1F1B (Megatron-LM's, with virtualStages)
    or ZBH1 (zero bubble: the backward split into its input and weight halves)."""
    virtual_stages: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Model chunks per GPU (Interleaved1F1B: 2 or more; virtual stage "
        "v * pipelineStages + p runs on pipeline stage p). 1 for the other schedules.",
    )

    @model_serializer(mode="wrap")
    def _omit_one_virtual_stage(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Specs without virtual stages serialize as before the field existed, so the spec
        # hashes of jobs a PerseusPolicy created do not change (and trigger no update).
        data: dict[str, Any] = handler(self)
        for key in ("virtualStages", "virtual_stages"):
            if data.get(key) == 1:
                del data[key]
        return data

    @model_validator(mode="after")
    def _schedulable(self) -> Parallelism:
        check_schedulable(
            self.schedule, self.pipeline_stages, self.microbatches, self.virtual_stages
        )
        return self

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.pipeline_stages * self.tensor_parallel


class RankOrder(StrEnum):
    """Which parallel dimension varies fastest with the global rank, fastest first."""

    TP_DP_PP = "tp-dp-pp"  # Megatron-LM and DeepSpeed default: rank = (pp*DP + dp)*TP + tp
    TP_PP_DP = "tp-pp-dp"  # rank = (dp*PP + pp)*TP + tp


class RankMapping(_Spec):
    """Where to read each training process's global rank.

    A pod runs one process per GPU it requests (``nvidia.com/gpu``); process ``local`` of
    the pod with node rank ``n`` has global rank ``n * gpusPerPod + local`` and runs on the
    node's GPU ``local`` (pods own whole GPUs in device order, as the NVIDIA device plugin
    exposes them). The node rank comes from the workload's own convention (PyTorchJob
    replica index, JobSet/TrainJob completion index), or for kind Pods from ``nodeRankLabel``
    or the ``nodeRankEnv`` variable of the first container.
    """

    order: RankOrder = Field(default=RankOrder.TP_DP_PP)
    """Which parallel dimension varies fastest with the global rank: tp-dp-pp (default:
    Megatron-LM's and DeepSpeed's, rank = (pp * dataParallel + dp) * tensorParallel + tp) or
    tp-pp-dp (rank = (dp * pipelineStages + pp) * tensorParallel + tp)."""
    node_rank_label: str | None = Field(
        default=None,
        min_length=1,
        max_length=317,
        description="Pod label holding the pod's node rank (kind Pods).",
    )
    node_rank_env: str = Field(
        default="JOB_COMPLETION_INDEX",
        min_length=1,
        max_length=253,
        description="Container environment variable holding the node rank (kind Pods), "
        "when nodeRankLabel is not set.",
    )
    gpus_per_pod: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Training processes (GPUs) per pod; default: the pod's nvidia.com/gpu.",
    )


class Mode(StrEnum):
    OBSERVE = "Observe"  # plan and report the expected savings; change no clock
    INTRINSIC = "Intrinsic"  # run the T_min plan: no slowdown, intrinsic bloat removed
    STRAGGLER_AWARE = "StragglerAware"  # T_min plan, re-targeted around stragglers


FREQUENCY_RULES: Final = (("self.minMHz <= self.maxMHz", "minMHz must not exceed maxMHz"),)


class FrequencyRange(_Spec):
    """SM clocks Perseus may use (profiled and planned), in MHz."""

    model_config = ConfigDict(
        alias_generator=None, json_schema_extra=_rules(*FREQUENCY_RULES), populate_by_name=True
    )

    min_mhz: int = Field(alias="minMHz", ge=100, le=5000)
    """Lowest SM clock to profile and plan, in MHz."""
    max_mhz: int = Field(alias="maxMHz", ge=100, le=5000)
    """Highest SM clock to profile and plan, in MHz."""

    @model_validator(mode="after")
    def _ordered(self) -> FrequencyRange:
        if self.min_mhz > self.max_mhz:
            raise ValueError(f"{FREQUENCY_RULES[0][1]} (got {self.min_mhz} > {self.max_mhz})")
        return self


def _operator_fills_defaults(schema: dict[str, Any]) -> None:
    # No defaults in the CRD: the API server must leave unset fields unset, so the operator
    # can fill them from its default policy (PERSEUS_OPERATOR_DEFAULT_POLICY) first.
    for prop in schema.get("properties", {}).values():
        prop.pop("default", None)


class Policy(_Spec):
    """The energy policy of the job. Unset fields come from the operator's default policy (the
    Helm chart's defaultPolicy), else from the defaults named in each field."""

    model_config = ConfigDict(json_schema_extra=_operator_fills_defaults)

    mode: Mode = Field(
        default=Mode.STRAGGLER_AWARE,
        description="Observe: report the expected savings only, from a stored profile; no "
        "clock is changed, ever (see profiling.profileInObserve). Intrinsic: T_min plans. "
        "StragglerAware (default): T_min plans, re-targeted around stragglers.",
    )
    granularity: Granularity = Field(
        default=Granularity.INSTRUCTION,
        description="Stage: one locked clock per GPU, no code change, once a profile exists "
        "(profiling needs the perseus_client hooks: without them, set profiling.profileRef "
        "or profiling.model). Instruction (default): the clock switches at every "
        "forward/backward; the training loop calls perseus_client.",
    )
    max_slowdown: float = Field(
        default=0.0,
        ge=0.0,
        le=0.5,
        description="Fraction of T_min the job may slow down to save more energy (default 0).",
    )
    frequency_mhz: FrequencyRange | None = Field(
        default=None, alias="frequencyMHz", description="Clamp of the SM clocks used."
    )
    blocking_power_watts: float | None = Field(
        default=None,
        gt=0,
        le=2000,
        description="GPU power while blocked on communication; measured when unset.",
    )
    power_weight: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="How much this job's slowdown counts when a PerseusPowerBudget slows jobs "
        "to meet its budget (default 1; 2: slowed half as readily).",
    )


STRAGGLER_RULES: Final = (
    (
        # The API server also checks the rule against the section's default ({}), before
        # the nested defaults fill it in: fields that are absent there pass.
        "!has(self.recoveryThreshold) || !has(self.slowdownThreshold) || "
        "self.recoveryThreshold < self.slowdownThreshold",
        "recoveryThreshold must be below slowdownThreshold (hysteresis)",
    ),
)


class Stragglers(_Spec):
    """When a data-parallel replica counts as a straggler, and when it has recovered.

    A replica straggles when its iteration time, over ``windowIterations`` iterations, is at
    least ``slowdownThreshold`` times the others' for ``persistenceReports`` reports in a row;
    it has recovered when it is below ``recoveryThreshold`` times for as long.
    """

    model_config = ConfigDict(json_schema_extra=_rules(*STRAGGLER_RULES))

    slowdown_threshold: float = Field(default=1.05, gt=1.0, le=10.0)
    """A replica whose iteration time is at least this many times the others' straggles (default
    1.05)."""
    recovery_threshold: float = Field(default=1.02, ge=1.0, le=10.0)
    """A straggler whose iteration time is below this many times the others' has recovered (default
    1.02; below slowdownThreshold)."""
    window_iterations: int = Field(default=10, ge=1, le=10000)
    """Iterations averaged into each rank's iteration time (default 10)."""
    persistence_reports: int = Field(default=3, ge=1, le=100)
    """Reports in a row a replica must be over slowdownThreshold (or under recoveryThreshold) before
    it straggles (or has recovered) (default 3)."""
    warmup_iterations: int = Field(
        default=5, ge=0, le=100000, description="Iterations ignored after a rank (re)starts."
    )
    stale_after_seconds: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="Telemetry older than this marks its node Degraded, not a straggler.",
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> Stragglers:
        if not self.recovery_threshold < self.slowdown_threshold:
            raise ValueError(
                f"{STRAGGLER_RULES[0][1]} (got {self.recovery_threshold} >= "
                f"{self.slowdown_threshold})"
            )
        return self


class PerseusJobSpec(_Spec):
    """What Perseus manages and how: the training workload, its parallelism and the energy
    policy."""

    workload: Workload
    """The training workload whose GPUs Perseus manages."""
    parallelism: Parallelism
    """How the training job is split across GPUs."""
    rank_mapping: RankMapping = Field(default_factory=RankMapping, json_schema_extra=_SECTION)
    policy: Policy = Field(default_factory=Policy, json_schema_extra=_SECTION)
    profiling: Profiling = Field(default_factory=Profiling, json_schema_extra=_SECTION)
    stragglers: Stragglers = Field(default_factory=Stragglers, json_schema_extra=_SECTION)


def with_default_policy(
    spec: Mapping[str, Any], default_policy: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``spec`` (the API's camelCase form) with the policy fields it leaves unset taken from
    ``default_policy``; a field the job sets wins as a whole (a ``frequencyMHz`` is not merged
    key by key)."""
    merged = dict(spec)
    if default_policy:
        own = spec.get("policy")
        merged["policy"] = {**default_policy, **(own if isinstance(own, Mapping) else {})}
    return merged
