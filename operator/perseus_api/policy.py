"""The ``PerseusPolicy`` custom resource: opt whole namespaces in, without a PerseusJob per job.

A ``PerseusPolicy`` is cluster-scoped. It selects namespaces by label and, in them, training
workloads by kind (and optionally by label); the operator then creates one ``PerseusJob`` per
selected workload, owned by the workload (so it goes when the workload goes), with the
parallelism read from the workload and the energy policy of the ``PerseusPolicy``::

    apiVersion: perseus.energy/v1alpha1
    kind: PerseusPolicy
    metadata:
      name: research-observe
    spec:
      namespaceSelector:              # required, and never empty: {} would select every
        matchLabels:                  # namespace of the cluster
          perseus.energy/enabled: "true"
      workloads:
        - kind: PyTorchJob            # every PyTorchJob of those namespaces
        - kind: Pods                  # and labelled pods (grouped by their controller)
          labelSelector:
            matchLabels: {app: trainer}
      priority: 0                     # breaks ties between equally specific policies
      policy: {mode: Observe}         # as spec.policy of a PerseusJob
      profiling: {}                   # as spec.profiling of a PerseusJob
      stragglers: {}                  # ...
      rankMapping: {}

The template fields (``policy``, ``profiling``, ``stragglers``, ``rankMapping``) are those of
:class:`~perseus_api.job.PerseusJobSpec`, with the same defaults: a generated PerseusJob holds
only the fields the PerseusPolicy sets, so what it leaves unset comes from where it comes from
for a hand-written PerseusJob (the operator's default policy, then the CRD's defaults).

How a workload states what cannot be read from its spec (the pipeline-parallel layout) is
given here as well, for users and the operator alike: the ``*_ANNOTATION`` constants on the
workload object (for kind Pods: on the pods), else the ``*_ENV`` variables of the training
container. :mod:`perseus_operator.policies.selection` reads them; which policy wins when several
select one workload is documented there.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from perseus_api.errors import ApiError, validation_summary
from perseus_api.job import LabelSelector, Policy, RankMapping, Stragglers, WorkloadKind
from perseus_api.job_profiling import Profiling
from perseus_api.job_status import _Status
from perseus_api.plan import API_VERSION
from perseus_api.resources import GROUP, object_key
from perseus_api.spec_model import _SECTION, _rules, _Spec

__all__ = [
    "DATA_PARALLEL_ANNOTATION",
    "DATA_PARALLEL_ENV",
    "MANAGED_BY_POLICY_LABEL",
    "MICROBATCHES_ANNOTATION",
    "MICROBATCHES_ENV",
    "NAMESPACE_SELECTOR_RULES",
    "OPT_OUT_ANNOTATION",
    "OPT_OUT_VALUE",
    "PIPELINE_STAGES_ANNOTATION",
    "PIPELINE_STAGES_ENV",
    "POLICY_KIND",
    "POLICY_PLURAL",
    "POLICY_SHORT_NAMES",
    "POLICY_SINGULAR",
    "POLICY_WORKLOAD_RULES",
    "PRINTER_COLUMNS",
    "SCHEDULE_ANNOTATION",
    "SCHEDULE_ENV",
    "TENSOR_PARALLEL_ANNOTATION",
    "TENSOR_PARALLEL_ENV",
    "WORKLOAD_SELECTOR_RULES",
    "NamespaceSelector",
    "PerseusPolicy",
    "PerseusPolicySpec",
    "PerseusPolicyStatus",
    "PolicyCondition",
    "PolicyConditionType",
    "PolicyError",
    "PolicyWorkload",
    "WorkloadSelector",
    "parse_policy",
]

POLICY_KIND: Final = "PerseusPolicy"
POLICY_PLURAL: Final = "perseuspolicies"
POLICY_SINGULAR: Final = "perseuspolicy"
POLICY_SHORT_NAMES: Final = ("ppol",)

# -- what workloads say about themselves -----------------------------------------------------------

OPT_OUT_ANNOTATION: Final = f"{GROUP}/opt-out"
"""On a workload (for kind Pods: on any of its pods), with value :data:`OPT_OUT_VALUE`: no
policy creates a PerseusJob for it."""
OPT_OUT_VALUE: Final = "true"

PIPELINE_STAGES_ANNOTATION: Final = f"{GROUP}/pipeline-stages"
"""Pipeline-parallel degree of the workload. Never guessed: without it (or
:data:`PIPELINE_STAGES_ENV`) no policy creates a PerseusJob for the workload."""
MICROBATCHES_ANNOTATION: Final = f"{GROUP}/microbatches"
"""Microbatches per iteration and data-parallel replica. Never guessed either."""
DATA_PARALLEL_ANNOTATION: Final = f"{GROUP}/data-parallel"
"""Data-parallel degree; default: the workload's GPUs / (pipeline stages x tensor parallel)."""
TENSOR_PARALLEL_ANNOTATION: Final = f"{GROUP}/tensor-parallel"
"""Tensor-parallel degree; default 1."""
SCHEDULE_ANNOTATION: Final = f"{GROUP}/schedule"
"""Pipeline schedule, ``1F1B`` (default) or ``GPipe``."""

# The same, as literal environment variables of the training container (the ``pytorch``
# container of a PyTorchJob, else the first container), for workloads whose annotations the
# user does not control; an annotation wins over the variable.
PIPELINE_STAGES_ENV: Final = "PERSEUS_PIPELINE_STAGES"
MICROBATCHES_ENV: Final = "PERSEUS_MICROBATCHES"
DATA_PARALLEL_ENV: Final = "PERSEUS_DATA_PARALLEL"
TENSOR_PARALLEL_ENV: Final = "PERSEUS_TENSOR_PARALLEL"
SCHEDULE_ENV: Final = "PERSEUS_SCHEDULE"

MANAGED_BY_POLICY_LABEL: Final = f"{GROUP}/policy"
"""Label of a PerseusJob created by a policy: the policy's name (as a label value). A
PerseusJob without it is the user's own, and a policy never touches it."""


class PolicyError(ApiError):
    """A PerseusPolicy object is malformed; the message names it and every problem."""


# -- spec ------------------------------------------------------------------------------------------

NAMESPACE_SELECTOR_RULES: Final = (
    (
        "(has(self.matchLabels) && size(self.matchLabels) > 0) || "
        "(has(self.matchExpressions) && size(self.matchExpressions) > 0)",
        "namespaceSelector must have matchLabels or matchExpressions: an empty selector "
        "would select every namespace (to mean that, match an expression such as "
        "kubernetes.io/metadata.name Exists)",
    ),
)
WORKLOAD_SELECTOR_RULES: Final = (
    (
        "(has(self.matchLabels) && size(self.matchLabels) > 0) || "
        "(has(self.matchExpressions) && size(self.matchExpressions) > 0)",
        "labelSelector must have matchLabels or matchExpressions (leave it out to select "
        "every workload of the kind)",
    ),
)
POLICY_WORKLOAD_RULES: Final = (
    (
        "self.kind != 'Pods' || has(self.labelSelector)",
        "kind Pods needs labelSelector: which pods are training pods",
    ),
)


class NamespaceSelector(LabelSelector):
    """The namespaces whose workloads the policy manages, by the namespaces' labels. Every
    namespace has the label ``kubernetes.io/metadata.name`` (its name) to select it by."""

    model_config = ConfigDict(json_schema_extra=_rules(*NAMESPACE_SELECTOR_RULES))

    @model_validator(mode="after")
    def _not_empty(self) -> NamespaceSelector:  # replaces LabelSelector's, with this message
        if not self.match_labels and not self.match_expressions:
            raise ValueError(NAMESPACE_SELECTOR_RULES[0][1])
        return self


class WorkloadSelector(LabelSelector):
    """Labels of the workload objects (for kind Pods: of the pods) the policy manages."""

    model_config = ConfigDict(json_schema_extra=_rules(*WORKLOAD_SELECTOR_RULES))

    @model_validator(mode="after")
    def _not_empty(self) -> WorkloadSelector:
        if not self.match_labels and not self.match_expressions:
            raise ValueError(WORKLOAD_SELECTOR_RULES[0][1])
        return self


class PolicyWorkload(_Spec):
    """One kind of training workload the policy manages."""

    model_config = ConfigDict(json_schema_extra=_rules(*POLICY_WORKLOAD_RULES))

    kind: WorkloadKind = Field(
        description="PyTorchJob, JobSet, TrainJob, or Pods (labelled pods, one workload per "
        "controller such as an indexed Job)."
    )
    label_selector: WorkloadSelector | None = Field(
        default=None,
        description="Only workloads with these labels (for kind Pods, required: the labels "
        "all pods of a workload share). Default: every workload of the kind.",
    )

    @model_validator(mode="after")
    def _pods_selected(self) -> PolicyWorkload:
        if self.kind == WorkloadKind.PODS and self.label_selector is None:
            raise ValueError(POLICY_WORKLOAD_RULES[0][1])
        return self


class PerseusPolicySpec(_Spec):
    """Which workloads the policy manages, and the PerseusJob fields it gives them."""

    namespace_selector: NamespaceSelector = Field(
        description="Namespaces whose workloads the policy manages, by the namespaces' labels "
        "(never empty; every namespace has the label kubernetes.io/metadata.name)."
    )
    workloads: list[PolicyWorkload] = Field(
        min_length=1,
        max_length=16,
        description="Kinds (and labels) of the training workloads the policy manages.",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="When several policies select a workload, the most specific one manages "
        "it; among equally specific ones the highest priority, then the first by name.",
    )
    rank_mapping: RankMapping = Field(default_factory=RankMapping, json_schema_extra=_SECTION)
    policy: Policy = Field(default_factory=Policy, json_schema_extra=_SECTION)
    profiling: Profiling = Field(default_factory=Profiling, json_schema_extra=_SECTION)
    stragglers: Stragglers = Field(default_factory=Stragglers, json_schema_extra=_SECTION)


# -- status ----------------------------------------------------------------------------------------


class PolicyConditionType(StrEnum):
    ACCEPTED = "Accepted"  # False (reason InvalidSpec): the spec is invalid; nothing is managed
    OVERLAPPING = "Overlapping"  # True: another policy manages some workloads this one selects


class PolicyCondition(_Status):
    """One aspect of the policy's state, as Kubernetes conditions say it."""

    type: PolicyConditionType
    """Accepted (False when the spec is invalid) or Overlapping (another policy selects some of
    the same workloads)."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str = Field(min_length=1)
    """Why, in one CamelCase word (for example ProfileRequired)."""
    message: str = ""
    """Why, in words: what happened and what to do about it."""
    last_transition_time: str | None = None
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The spec generation the condition was set for."""


class PerseusPolicyStatus(_Status):
    """What the operator observed and did for the policy. Written by the operator only."""

    observed_generation: int | None = None
    """The spec generation this status describes."""
    matched_workloads: int = Field(
        default=0, description="Workloads the policy selects and manages (not opted out)."
    )
    managed_jobs: int = Field(default=0, description="PerseusJobs the policy created.")
    expected_savings_ratio: float | None = Field(
        default=None,
        description="Expected energy saved over the managed jobs that have a plan, weighted "
        "by their GPUs (fraction).",
    )
    expected_savings: str | None = None
    """expectedSavingsRatio as a percent (14.5%), for kubectl get."""
    message: str = ""
    """What the policy does now, in words."""
    conditions: list[PolicyCondition] = Field(default_factory=list)
    """The policy's conditions, each with a reason and a message."""


PRINTER_COLUMNS: Final = (
    {"name": "Priority", "type": "integer", "jsonPath": ".spec.priority"},
    {"name": "Mode", "type": "string", "jsonPath": ".spec.policy.mode"},
    {
        "name": "Workloads",
        "type": "integer",
        "jsonPath": ".status.matchedWorkloads",
        "description": "Workloads the policy selects and manages.",
    },
    {"name": "Jobs", "type": "integer", "jsonPath": ".status.managedJobs"},
    {
        "name": "Expected savings",
        "type": "string",
        "jsonPath": ".status.expectedSavings",
        "description": "Expected energy saved over the managed jobs.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


class PerseusPolicy(_Spec):
    """A whole ``PerseusPolicy`` object as the API server returns it."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["perseus.energy/v1alpha1"] = API_VERSION
    kind: Literal["PerseusPolicy"] = POLICY_KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: PerseusPolicySpec
    status: PerseusPolicyStatus = Field(default_factory=PerseusPolicyStatus)


def parse_policy(body: Mapping[str, Any]) -> PerseusPolicySpec:
    """The spec of a PerseusPolicy object.

    Raises:
        PolicyError: The object has no name or its spec is invalid; the message names the
            policy and says what is wrong, every problem as ``spec.field.path: problem``, on
            one line (as a PerseusJob's invalid spec is reported).
    """
    _, name = object_key(body)
    where = f"{POLICY_KIND} {name or '?'}"
    if not name:
        raise PolicyError(f"{where}: metadata.name is missing")
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise PolicyError(f"{where}: spec is missing or not an object")
    try:
        return PerseusPolicySpec.model_validate(spec)
    except ValidationError as exc:
        raise PolicyError(f"{where}: invalid spec: {validation_summary(exc)}") from None
