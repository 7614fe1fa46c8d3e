"""The ``PerseusPowerBudget`` custom resource: a GPU power budget for one power domain.

Cluster-scoped, one per power domain (a rack, a row, a PDU): the nodes it covers, by label, and
the watts their GPUs may draw on average. The operator chooses each managed job's point on its
stored frontier so that the domain stays within the budget at the least weighted slowdown
(:mod:`perseus_planner.power`), and re-targets the jobs as it does around stragglers::

    apiVersion: perseus.energy/v1alpha1
    kind: PerseusPowerBudget
    metadata:
      name: rack-a12
    spec:
      budgetWatts: 42000              # the domain's GPUs, on average over the window
      nodeSelector:                   # required, and never empty
        matchLabels:
          topology.example.com/rack: a12
      averagingWindowSeconds: 60
      safetyMarginRatio: 0.05         # plan for 95 % of the budget
      enforcement: Plans              # or PlansAndPowerLimits: per-GPU limits as a backstop

A job's share of the slowdown is weighted by ``spec.policy.powerWeight`` of its PerseusJob
(or of the PerseusPolicy that created it). GPUs of workloads no PerseusJob manages count at
their measured draw. Status: the measured draw, the budget, the headroom, each job's watts and
slowdown, and the conditions ``Met``, ``Infeasible`` (with the watts missing) and
``Overlapping`` (a node selected by two budgets: neither is enforced on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from perseus_api.errors import ApiError, validation_summary
from perseus_api.job import LabelSelector
from perseus_api.job_status import _Status
from perseus_api.plan import API_VERSION
from perseus_api.resources import object_key
from perseus_api.spec_model import _rules, _Spec

__all__ = [
    "BUDGET_KIND",
    "BUDGET_PLURAL",
    "BUDGET_SHORT_NAMES",
    "BUDGET_SINGULAR",
    "MARGIN_RULES",
    "NODE_SELECTOR_RULES",
    "PRINTER_COLUMNS",
    "BudgetCondition",
    "BudgetConditionType",
    "Enforcement",
    "JobAllocation",
    "NodeSelector",
    "PerseusPowerBudget",
    "PerseusPowerBudgetSpec",
    "PerseusPowerBudgetStatus",
    "PowerBudgetSpecError",
    "parse_power_budget",
]

BUDGET_KIND: Final = "PerseusPowerBudget"
BUDGET_PLURAL: Final = "perseuspowerbudgets"
BUDGET_SINGULAR: Final = "perseuspowerbudget"
BUDGET_SHORT_NAMES: Final = ("ppb",)

MAX_JOBS_REPORTED: Final = 500
"""Jobs listed in the status (the largest allocations first); the rest are counted only."""


class PowerBudgetSpecError(ApiError):
    """A PerseusPowerBudget object is malformed; the message names it and every problem."""


NODE_SELECTOR_RULES: Final = (
    (
        "(has(self.matchLabels) && size(self.matchLabels) > 0) || "
        "(has(self.matchExpressions) && size(self.matchExpressions) > 0)",
        "nodeSelector must have matchLabels or matchExpressions: an empty selector would "
        "put every node of the cluster in this domain (to mean that, match an expression "
        "such as kubernetes.io/os Exists)",
    ),
)
MARGIN_RULES: Final = (
    (
        "!has(self.safetyMarginRatio) || self.budgetWatts * (1.0 - self.safetyMarginRatio) >= 1.0",
        "budgetWatts less the safety margin must leave at least 1 W to plan for",
    ),
)


class NodeSelector(LabelSelector):
    """The nodes of the power domain, by the nodes' labels (a rack, row or PDU label)."""

    model_config = ConfigDict(json_schema_extra=_rules(*NODE_SELECTOR_RULES))

    @model_validator(mode="after")
    def _not_empty(self) -> NodeSelector:  # replaces LabelSelector's, with this message
        if not self.match_labels and not self.match_expressions:
            raise ValueError(NODE_SELECTOR_RULES[0][1])
        return self


class Enforcement(StrEnum):
    PLANS = "Plans"  # clock plans only: the draw follows the chosen frontier points
    PLANS_AND_POWER_LIMITS = "PlansAndPowerLimits"  # plus per-GPU NVML limits as a backstop


class PerseusPowerBudgetSpec(_Spec):
    """The power domain (its nodes), its budget, and how the budget is met."""

    model_config = ConfigDict(json_schema_extra=_rules(*MARGIN_RULES))

    budget_watts: float = Field(
        gt=0,
        le=1e9,
        description="Watts the domain's GPUs may draw, on average over averagingWindowSeconds "
        "(GPUs of unmanaged workloads included, at their measured draw).",
    )
    node_selector: NodeSelector = Field(
        description="The nodes of the power domain, by label (never empty). A node selected "
        "by two budgets is in neither: both report Overlapping."
    )
    averaging_window_seconds: int = Field(
        default=60,
        ge=10,
        le=3600,
        description="Window over which the measured draw is averaged, and how long it may stay "
        "over the budget before the PerseusPowerBudgetExceeded alert fires.",
    )
    safety_margin_ratio: float = Field(
        default=0.05,
        ge=0.0,
        lt=1.0,
        description="Fraction of the budget kept free: jobs are planned for budgetWatts x (1 - "
        "safetyMarginRatio), to absorb what the frontier's estimates miss.",
    )
    enforcement: Enforcement = Field(
        default=Enforcement.PLANS,
        description="Plans (default): meet the budget with the jobs' clock plans only. "
        "PlansAndPowerLimits: also set each managed GPU's power limit to its share plus the "
        "margin, as a hard backstop (reset like clocks when the budget goes).",
    )
    rebalance_band_ratio: float = Field(
        default=0.02,
        ge=0.0,
        le=0.5,
        description="Hysteresis: the allocation is solved again when the unmanaged GPUs' draw "
        "moves by more than this fraction of the budget (and whenever a job starts or ends, a "
        "straggler appears or recovers, or the spec changes), and a job's plan is rewritten "
        "only when its allocated watts move by more than this fraction of its own.",
    )

    @property
    def planned_watts(self) -> float:
        """The watts the allocation plans for: the budget less the safety margin."""
        return self.budget_watts * (1.0 - self.safety_margin_ratio)

    @model_validator(mode="after")
    def _margin_leaves_watts(self) -> PerseusPowerBudgetSpec:
        if self.planned_watts < 1.0:
            raise ValueError(MARGIN_RULES[0][1])
        return self


# -- status ----------------------------------------------------------------------------------------


class BudgetConditionType(StrEnum):
    MET = "Met"  # True: the measured draw is within the budget over the window
    INFEASIBLE = "Infeasible"  # True: even every job's least-power point does not fit
    OVERLAPPING = "Overlapping"  # True: some nodes are selected by another budget too


class BudgetCondition(_Status):
    """One aspect of the budget's state, as Kubernetes conditions say it."""

    type: BudgetConditionType
    """Met (the measured draw is within the budget), Infeasible (even every job's least-power
    point does not fit: the message says by how many watts) or Overlapping (some nodes are
    selected by another budget too)."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str = Field(min_length=1)
    """Why, in one CamelCase word (for example OverBudget)."""
    message: str = ""
    """Why, in words: what happened and what to do about it."""
    last_transition_time: str | None = None
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The spec generation the condition describes."""


class JobAllocation(_Status):
    """What the allocation gave one job."""

    namespace: str
    """The PerseusJob's namespace."""
    name: str
    """The PerseusJob's name."""
    allocated_watts: float = Field(description="Average draw of the job's point (all its GPUs).")
    slowdown_ratio: float = Field(description="Its iteration time / T_min - 1 at that point.")
    weight: float = Field(default=1.0, description="Its spec.policy.powerWeight.")
    gpus: int = Field(default=0, description="GPUs of the job in the domain.")


class PerseusPowerBudgetStatus(_Status):
    """What the operator measured and allocated in the domain. Written by the operator only."""

    observed_generation: int | None = None
    """The spec generation this status describes."""
    budget_watts: float | None = Field(default=None, description="The budget in force.")
    measured_watts: float | None = Field(
        default=None, description="The domain's GPU draw, averaged over the window."
    )
    headroom_watts: float | None = Field(
        default=None, description="budgetWatts - measuredWatts (negative: over the budget)."
    )
    allocated_watts: float | None = Field(
        default=None, description="Watts of the managed jobs' chosen points."
    )
    unmanaged_watts: float | None = Field(
        default=None, description="Measured draw of the domain's GPUs no PerseusJob manages."
    )
    missing_watts: float | None = Field(
        default=None,
        description="With Infeasible: watts above the budget even at every job's least power.",
    )
    nodes: int = Field(default=0, description="Nodes in the domain.")
    managed_jobs: int = Field(default=0, description="PerseusJobs running in the domain.")
    jobs: list[JobAllocation] = Field(
        default_factory=list,
        max_length=MAX_JOBS_REPORTED,
        description="Each managed job's allocation, the largest first.",
    )
    message: str = ""
    """What the operator last did or found, in words."""
    conditions: list[BudgetCondition] = Field(default_factory=list)
    """Met, Infeasible and Overlapping."""


PRINTER_COLUMNS: Final = (
    {"name": "Budget W", "type": "number", "jsonPath": ".spec.budgetWatts"},
    {
        "name": "Measured W",
        "type": "number",
        "jsonPath": ".status.measuredWatts",
        "description": "The domain's GPU draw, averaged over the window.",
    },
    {"name": "Headroom W", "type": "number", "jsonPath": ".status.headroomWatts"},
    {"name": "Jobs", "type": "integer", "jsonPath": ".status.managedJobs"},
    {
        "name": "Met",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Met")].status',
        "description": "Whether the measured draw is within the budget.",
    },
    {"name": "Enforcement", "type": "string", "jsonPath": ".spec.enforcement"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


class PerseusPowerBudget(_Spec):
    """A whole ``PerseusPowerBudget`` object as the API server returns it."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["perseus.energy/v1alpha1"] = API_VERSION
    kind: Literal["PerseusPowerBudget"] = BUDGET_KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: PerseusPowerBudgetSpec
    status: PerseusPowerBudgetStatus = Field(default_factory=PerseusPowerBudgetStatus)


def parse_power_budget(body: Mapping[str, Any]) -> PerseusPowerBudgetSpec:
    """The spec of a PerseusPowerBudget object.

    Raises:
        PowerBudgetSpecError: The object has no name or its spec is invalid; the message names
            the budget and every problem as ``spec.field.path: problem``, on one line.
    """
    _, name = object_key(body)
    where = f"{BUDGET_KIND} {name or '?'}"
    if not name:
        raise PowerBudgetSpecError(f"{where}: metadata.name is missing")
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise PowerBudgetSpecError(f"{where}: spec is missing or not an object")
    try:
        return PerseusPowerBudgetSpec.model_validate(spec)
    except ValidationError as exc:
        raise PowerBudgetSpecError(f"{where}: invalid spec: {validation_summary(exc)}") from None
