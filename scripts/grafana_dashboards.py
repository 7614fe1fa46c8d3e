"""The chart's Grafana dashboards, as code: ``python scripts/sync_chart.py`` writes them to
``helm/perseus/dashboards/*.json`` and ``tests/integration/test_helm_chart.py`` fails when the
files and this module differ.

Every query is PromQL over the metrics of the node agents (``perseus_gpu_*``,
``perseus_agent_*``, ``perseus_iteration_seconds``) and the operator (``perseus_job*``,
``perseus_straggler_events_total``, ``perseus_planner_seconds``). Queries that read
dcgm-exporter (``DCGM_FI_*``) join its series on the GPU UUID (dcgm-exporter's ``UUID`` label,
Perseus's ``uuid``); every panel also shows data without dcgm-exporter, except the ones whose
title says "(dcgm-exporter)". ``tests/e2e/test_dashboards.py`` runs every query against a real
Prometheus scraping real agents.

On a managed GPU the labels ``job_namespace``, ``job_name`` (the PerseusJob) and ``pod_name``
name the training job (never ``namespace``, ``job`` and ``pod``: Prometheus's target labels);
a GPU without a plan has no ``dp_rank`` label.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39
"""Grafana 10.3 and later (Grafana migrates older schema versions on load, not newer ones)."""

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24

# Label matchers of the template variables.
JOB = 'job_namespace="$namespace", job_name="$job"'
GPUS = 'node=~"$node", gpu=~"$gpu"'
MANAGED = 'dp_rank!=""'
UNMANAGED = 'dp_rank=""'


def dcgm(metric: str) -> str:
    """A dcgm-exporter metric with its ``UUID`` copied to Perseus's ``uuid`` label."""
    return f'label_replace({metric}, "uuid", "$1", "UUID", "(.+)")'


# Energy as kWh, cost and CO2e. The price and the carbon intensity are hidden constant variables
# of the dashboards, set from the chart's values by templates/dashboards.yaml (these defaults are
# values.yaml's, so the files here equal a default rendering).
JOULES_PER_KWH = "3.6e6"
ELECTRICITY_VALUES = "dashboards.electricity"


@dataclass(frozen=True)
class Constant:
    """A hidden Grafana constant variable fed from ``dashboards.electricity.<value>``."""

    name: str
    label: str
    value: str  # the default, as Helm's ``toString`` writes values.yaml's
    chart_value: str


PRICE = Constant("price_per_kwh", "Electricity price per kWh", "0.15", "pricePerKWh")
CURRENCY = Constant("currency", "Currency of the price", "USD", "currency")
CARBON = Constant(
    "carbon_g_per_kwh", "Carbon intensity (gCO2e per kWh)", "400", "carbonIntensityGramsPerKWh"
)
ENERGY_CONSTANTS = (PRICE, CURRENCY, CARBON)


def kwh(joules: str) -> str:
    """A PromQL expression in joules, in kWh."""
    return f"({joules}) / {JOULES_PER_KWH}"


def cost(joules: str) -> str:
    """The cost of ``joules`` at the chart's electricity price (in its currency)."""
    return f"{kwh(joules)} * ${PRICE.name}"


def co2e_kg(joules: str) -> str:
    """The kg CO2e of ``joules`` at the chart's carbon intensity (grams per kWh)."""
    return f"{kwh(joules)} * ${CARBON.name} / 1000"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False


@dataclass
class Panel:
    kind: str  # timeseries | stat | bargauge | table
    title: str
    targets: Sequence[Target]
    width: int
    height: int = 8
    unit: str = "short"
    description: str = ""
    decimals: int | None = None
    bars: bool = False
    min_value: float | None = None
    overrides: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Row:
    title: str


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str  # Grafana's label_values(metric{...}, label)
    multi: bool = False


def stat(title: str, expr: str, unit: str, width: int, description: str, **kw: Any) -> Panel:
    return Panel("stat", title, [Target(expr, instant=True)], width, 4, unit, description, **kw)


def energy_cost_co2(used: str, saved: str, whose: str) -> list[Panel]:
    """Six stats over the time range: the energy ``used`` and ``saved`` (PromQL in joules) in
    kWh, at the chart's electricity price, and in CO2e at its carbon intensity."""
    price = f"${PRICE.name} ${CURRENCY.name} per kWh (chart value {ELECTRICITY_VALUES}.pricePerKWh)"
    carbon = (
        f"${CARBON.name} gCO2e per kWh (chart value "
        f"{ELECTRICITY_VALUES}.carbonIntensityGramsPerKWh)"
    )
    saved_words = "estimated energy saved against every GPU at its maximum clock"
    return [
        stat(
            "Energy used",
            kwh(used),
            "kwatth",
            4,
            f"Energy {whose} used over the time range, from the GPUs' own energy counters.",
            decimals=2,
        ),
        stat(
            "Energy saved (estimated)",
            kwh(saved),
            "kwatth",
            4,
            f"The {saved_words} over the time range (the operator's estimate from the plans "
            "and the iterations the agents counted).",
            decimals=2,
        ),
        stat(
            f"Cost of the energy used (${CURRENCY.name})",
            cost(used),
            "none",
            4,
            f"Energy used over the time range, in kWh, times {price}.",
            decimals=2,
        ),
        stat(
            f"Cost saved (${CURRENCY.name})",
            cost(saved),
            "none",
            4,
            f"The {saved_words}, in kWh, times {price}.",
            decimals=2,
        ),
        stat(
            "CO2e emitted",
            co2e_kg(used),
            "masskg",
            4,
            f"Energy used over the time range, in kWh, times {carbon}.",
            decimals=2,
        ),
        stat(
            "CO2e avoided (estimated)",
            co2e_kg(saved),
            "masskg",
            4,
            f"The {saved_words}, in kWh, times {carbon}.",
            decimals=2,
        ),
    ]


# -- Cluster overview --------------------------------------------------------------------------

SAVED_RANGE = "sum(increase(perseus_job_energy_saved_joules_total[$__range]))"
MANAGED_ENERGY_RANGE = f"sum(increase(perseus_gpu_energy_joules_total{{{MANAGED}}}[$__range]))"
ALL_ENERGY_RANGE = "sum(increase(perseus_gpu_energy_joules_total[$__range]))"

CLUSTER: list[Panel | Row] = [
    Row("Energy and power"),
    stat(
        "GPUs following a plan",
        f"count(perseus_gpu_power_watts{{{MANAGED}}}) or vector(0)",  # 0, not "No data"
        "short",
        4,
        "GPUs whose node agent applies a Perseus plan now.",
    ),
    stat(
        "GPUs without a plan",
        f"count(perseus_gpu_power_watts{{{UNMANAGED}}}) or vector(0)",
        "short",
        4,
        "GPUs on nodes with a Perseus agent that follow no plan (idle, or jobs without a "
        "PerseusJob).",
    ),
    stat(
        "Saved vs. all-max-clock baseline",
        f"{SAVED_RANGE} / ({SAVED_RANGE} + {MANAGED_ENERGY_RANGE})",
        "percentunit",
        6,
        "Estimated energy saved over the time range, as a fraction of the energy the managed "
        "GPUs would have used at maximum clocks (measured energy + saved energy).",
        decimals=1,
    ),
    stat(
        "Straggler events",
        "sum(increase(perseus_straggler_events_total[$__range]))",
        "short",
        5,
        "Data-parallel replicas the operator detected as stragglers over the time range.",
        decimals=0,
    ),
    stat(
        "Planner time p95",
        "histogram_quantile(0.95, sum by (le) "
        "(increase(perseus_planner_seconds_bucket[$__range])))",
        "s",
        5,
        "95th percentile of the time to solve one iteration time-energy frontier, over the "
        "time range.",
    ),
    Panel(
        "timeseries",
        "GPU power: with and without a plan",
        [
            Target(f"sum(perseus_gpu_power_watts{{{MANAGED}}})", "following a plan"),
            Target(f"sum(perseus_gpu_power_watts{{{UNMANAGED}}}) or vector(0)", "without a plan"),
            Target(
                f"sum({dcgm('DCGM_FI_DEV_POWER_USAGE')} unless on (uuid) perseus_gpu_power_watts)",
                "without a Perseus agent (dcgm-exporter)",
            ),
        ],
        12,
        unit="watt",
        description="Power of the GPUs Perseus manages and of the others. With dcgm-exporter, "
        "also the GPUs on nodes without a Perseus agent (joined on the GPU UUID).",
        min_value=0,
    ),
    Panel(
        "bargauge",
        "Energy over the time range",
        [
            Target(kwh(MANAGED_ENERGY_RANGE), "following a plan", instant=True),
            Target(
                kwh(f"sum(increase(perseus_gpu_energy_joules_total{{{UNMANAGED}}}[$__range]))"),
                "without a plan",
                instant=True,
            ),
            Target(kwh(SAVED_RANGE), "saved (estimated)", instant=True),
        ],
        6,
        unit="kwatth",
        description="GPU energy over the time range, from the GPUs' own energy counters, and "
        "the estimated savings.",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Power saved (estimated), by job",
        [
            Target(
                "sum by (job_namespace, job_name) "
                "(rate(perseus_job_energy_saved_joules_total[$__rate_interval]))",
                "{{job_namespace}}/{{job_name}}",
            )
        ],
        6,
        unit="watt",
        description="Energy saved per second against every GPU at its maximum clock "
        "(estimated by the operator).",
        min_value=0,
    ),
    Row("Energy, cost and CO2e over the time range"),
    *energy_cost_co2(ALL_ENERGY_RANGE, SAVED_RANGE, "every GPU with a Perseus agent"),
    Row("Jobs"),
    Panel(
        "bargauge",
        "PerseusJobs by phase",
        [Target("sum by (phase) (perseus_jobs)", "{{phase}}", instant=True)],
        6,
        description="PerseusJobs the operator manages, by phase.",
        decimals=0,
        min_value=0,
    ),
    Panel(
        "timeseries",
        "PerseusJobs by phase",
        [Target("sum by (phase) (perseus_jobs)", "{{phase}}")],
        9,
        decimals=0,
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Expected savings of the current plans",
        [Target("perseus_job_expected_savings_ratio", "{{job_namespace}}/{{job_name}}")],
        9,
        unit="percentunit",
        description="Energy each job's current plan is expected to save against every GPU at "
        "its maximum clock.",
        min_value=0,
    ),
    Row("Power budgets"),
    Panel(
        "timeseries",
        "Power domain draw vs. budget",
        [
            Target("max by (budget) (perseus_power_budget_measured_watts)", "{{budget}} measured"),
            Target("max by (budget) (perseus_power_budget_watts)", "{{budget}} budget"),
        ],
        12,
        unit="watt",
        description="Each PerseusPowerBudget's GPU draw, averaged over its window from the "
        "agents' energy counters, and its budget. The PerseusPowerBudgetExceeded alert fires "
        "when the draw stays above the budget.",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Allocated watts per job",
        [
            Target(
                "max by (budget, job_namespace, job_name) "
                "(perseus_power_budget_job_allocated_watts)",
                "{{budget}}: {{job_namespace}}/{{job_name}}",
            )
        ],
        6,
        unit="watt",
        description="Average draw of the frontier point each budget chose for each job.",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Slowdown per job",
        [
            Target(
                "max by (budget, job_namespace, job_name) "
                "(perseus_power_budget_job_slowdown_ratio)",
                "{{budget}}: {{job_namespace}}/{{job_name}}",
            )
        ],
        6,
        unit="percentunit",
        description="Each job's iteration time at its chosen point over its T_min, less 1: "
        "what meeting the budget costs it (0: none).",
        min_value=0,
    ),
]

# -- Job ---------------------------------------------------------------------------------------

# Iteration time of a data-parallel replica: its slowest rank's mean (the slowest stage gates
# the pipeline), as the operator's straggler detector counts it.
REPLICA_ITERATION = (
    "max by (dp_rank) ("
    f"rate(perseus_iteration_seconds_sum{{{JOB}}}[$__rate_interval]) / "
    f"rate(perseus_iteration_seconds_count{{{JOB}}}[$__rate_interval]))"
)
JOB_SAVED_RATE = f"sum(rate(perseus_job_energy_saved_joules_total{{{JOB}}}[$__rate_interval]))"
JOB_ENERGY_RATE = f"sum(rate(perseus_gpu_energy_joules_total{{{JOB}}}[$__rate_interval]))"
JOB_SAVED_RANGE = f"sum(increase(perseus_job_energy_saved_joules_total{{{JOB}}}[$__range]))"
JOB_ENERGY_RANGE = f"sum(increase(perseus_gpu_energy_joules_total{{{JOB}}}[$__range]))"
GPU_LEGEND = "dp {{dp_rank}} pp {{pp_rank}} ({{node}} GPU {{gpu}})"

JOB_PANELS: list[Panel | Row] = [
    Row("Savings"),
    stat(
        "Expected savings (plan)",
        f"max(perseus_job_expected_savings_ratio{{{JOB}}})",
        "percentunit",
        9,
        "Energy the current plan is expected to save against every GPU at its maximum clock.",
        decimals=1,
    ),
    stat(
        "Realized savings",
        f"{JOB_SAVED_RANGE} / ({JOB_SAVED_RANGE} + {JOB_ENERGY_RANGE})",
        "percentunit",
        9,
        "Over the time range: estimated energy saved / (energy the job's GPUs used, measured, "
        "+ energy saved).",
        decimals=1,
    ),
    stat(
        "Straggler events",
        f"sum(increase(perseus_straggler_events_total{{{JOB}}}[$__range]))",
        "short",
        6,
        "Data-parallel replicas detected as stragglers over the time range.",
        decimals=0,
    ),
    Panel(
        "timeseries",
        "Expected vs. realized savings",
        [
            Target(f"max(perseus_job_expected_savings_ratio{{{JOB}}})", "expected (plan)"),
            Target(
                f"{JOB_SAVED_RATE} / ({JOB_SAVED_RATE} + {JOB_ENERGY_RATE})",
                "realized (measured energy + estimated savings)",
            ),
        ],
        12,
        unit="percentunit",
        description="What the plan promises, and what the measured energy of the job's GPUs "
        "and the operator's estimate of the energy saved add up to.",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Energy per iteration, per data-parallel replica",
        [
            Target(
                f"sum by (dp_rank) (rate(perseus_gpu_energy_joules_total{{{JOB}}}"
                "[$__rate_interval])) / max by (dp_rank) "
                f"(rate(perseus_iteration_seconds_count{{{JOB}}}[$__rate_interval]))",
                "dp {{dp_rank}}",
            )
        ],
        12,
        unit="joule",
        description="Energy of the replica's GPUs per training iteration (needs the "
        "perseus_client step hooks in the training loop).",
        min_value=0,
    ),
    Row("Energy, cost and CO2e over the time range"),
    *energy_cost_co2(JOB_ENERGY_RANGE, JOB_SAVED_RANGE, "the job's GPUs"),
    Row("Stragglers"),
    Panel(
        "timeseries",
        "Iteration time per data-parallel replica",
        [Target(REPLICA_ITERATION, "dp {{dp_rank}}")],
        12,
        unit="s",
        description="Mean iteration time of each data-parallel replica: its slowest rank's "
        "(needs the perseus_client step hooks).",
    ),
    Panel(
        "timeseries",
        "Slowdown vs. the fastest replica",
        [
            Target(
                f"{REPLICA_ITERATION} / ignoring (dp_rank) group_left () min({REPLICA_ITERATION})",
                "dp {{dp_rank}}",
            )
        ],
        6,
        description="Each replica's iteration time over the fastest one's; the operator flags "
        "a straggler above the job's spec.stragglers.slowdownThreshold (default 1.05).",
        decimals=3,
    ),
    Panel(
        "timeseries",
        "Straggler events",
        [
            Target(
                f"sum(increase(perseus_straggler_events_total{{{JOB}}}[$__rate_interval]))",
                "stragglers detected",
            )
        ],
        6,
        bars=True,
        decimals=0,
        min_value=0,
    ),
    Row("Clocks and power"),
    Panel(
        "timeseries",
        "SM clock: target vs. applied",
        [
            Target(f"perseus_gpu_target_sm_clock_hertz{{{JOB}}}", f"target {GPU_LEGEND}"),
            Target(f"perseus_gpu_sm_clock_hertz{{{JOB}}}", f"applied {GPU_LEGEND}"),
        ],
        12,
        unit="hertz",
        description="The SM clock each GPU's plan asks for, and the clock the GPU runs at.",
    ),
    Panel(
        "timeseries",
        "Power per GPU",
        [Target(f"perseus_gpu_power_watts{{{JOB}}}", GPU_LEGEND)],
        12,
        unit="watt",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Clock changes per second",
        [Target(f"rate(perseus_gpu_clock_changes_total{{{JOB}}}[$__rate_interval])", GPU_LEGEND)],
        12,
        unit="ops",
        description="SM clock changes the agents make (many with granularity Instruction).",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "GPU utilization (dcgm-exporter)",
        [
            Target(
                f"{dcgm('DCGM_FI_DEV_GPU_UTIL')} * on (uuid) group_left (dp_rank, pp_rank) "
                f"group by (uuid, dp_rank, pp_rank) (perseus_gpu_power_watts{{{JOB}}})",
                "dp {{dp_rank}} pp {{pp_rank}} ({{uuid}})",
            )
        ],
        12,
        unit="percent",
        description="dcgm-exporter's DCGM_FI_DEV_GPU_UTIL of the job's GPUs, joined on the GPU "
        "UUID: empty without dcgm-exporter.",
        min_value=0,
    ),
]

# -- Node & GPU --------------------------------------------------------------------------------

NODE_PANELS: list[Panel | Row] = [
    Panel(
        "table",
        "GPUs",
        [
            Target(
                "max by (node, gpu, uuid, modelName, job_namespace, job_name, dp_rank, pp_rank) ("
                f"perseus_gpu_power_watts{{{GPUS}}} * on (uuid) group_left (modelName) "
                f"group by (uuid, modelName) ({dcgm('DCGM_FI_DEV_POWER_USAGE')})"
                ") or on (uuid) "
                "max by (node, gpu, uuid, job_namespace, job_name, dp_rank, pp_rank) "
                f"(perseus_gpu_power_watts{{{GPUS}}})",
                instant=True,
                table=True,
            )
        ],
        24,
        6,
        unit="watt",
        description="GPUs and what they run now (namespace, job and ranks when they follow a "
        "plan), with their power. The model name comes from dcgm-exporter, where it runs.",
    ),
    Panel(
        "timeseries",
        "SM clock: applied and target",
        [
            Target(f"perseus_gpu_sm_clock_hertz{{{GPUS}}}", "{{node}} GPU {{gpu}}"),
            Target(f"perseus_gpu_target_sm_clock_hertz{{{GPUS}}}", "{{node}} GPU {{gpu}} target"),
        ],
        12,
        unit="hertz",
    ),
    Panel(
        "timeseries",
        "Power",
        [
            Target(f"perseus_gpu_power_watts{{{GPUS}}}", "{{node}} GPU {{gpu}}"),
            Target(
                f"{dcgm('DCGM_FI_DEV_POWER_USAGE')} * on (uuid) group_left (node) "
                f"group by (uuid, node) (perseus_gpu_power_watts{{{GPUS}}})",
                "{{node}} GPU {{gpu}} (dcgm-exporter)",
            ),
        ],
        12,
        unit="watt",
        description="Power as the Perseus agent reads it (NVML), and as dcgm-exporter reports "
        "it where it runs.",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Clock event reasons: who holds the clock",
        [
            Target(
                f"max by (node, gpu, reason) (perseus_gpu_clock_event_reasons{{{GPUS}}}) > 0",
                "{{node}} GPU {{gpu}}: {{reason}}",
            ),
            Target(
                f"max by (node, gpu, kind) (perseus_gpu_foreign_clocks{{{GPUS}}})",
                "{{node}} GPU {{gpu}}: clocks set by another owner {{kind}}",
            ),
        ],
        24,
        unit="short",
        description="NVML's clock event (throttle) reasons while they hold: "
        "user_defined_clocks is a locked clock, Perseus's where the GPU has a target clock "
        "above, an administrator's (nvidia-smi -lgc/-ac, left alone by Perseus unless "
        "agent.foreignClocks=override) where 'clocks set by another owner' shows; "
        "sw_power_cap, hw_slowdown and the thermal reasons mean power or heat hold the "
        "clock down, not Perseus.",
        bars=True,
        decimals=0,
        min_value=0,
    ),
    Panel(
        "bargauge",
        "Energy over the time range",
        [
            Target(
                kwh(f"increase(perseus_gpu_energy_joules_total{{{GPUS}}}[$__range])"),
                "{{node}} GPU {{gpu}}",
                instant=True,
            )
        ],
        8,
        unit="kwatth",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Clock changes per second",
        [
            Target(
                f"rate(perseus_gpu_clock_changes_total{{{GPUS}}}[$__rate_interval])",
                "{{node}} GPU {{gpu}}",
            )
        ],
        8,
        unit="ops",
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Apply errors by reason",
        [
            Target(
                "sum by (node, reason) (increase("
                'perseus_agent_apply_errors_total{node=~"$node"}[$__rate_interval]))',
                "{{node}} {{reason}}",
            )
        ],
        8,
        description="Errors of the node agents applying plans or reading GPUs, by reason "
        "(read_* are readings); the PerseusNodePlan status says more.",
        bars=True,
        decimals=0,
        min_value=0,
    ),
    Panel(
        "timeseries",
        "Iteration time per rank (median)",
        [
            Target(
                "histogram_quantile(0.5, sum by (le, node, gpu, rank) ("
                f"rate(perseus_iteration_seconds_bucket{{{GPUS}}}[$__rate_interval])))",
                "{{node}} GPU {{gpu}} rank {{rank}}",
            )
        ],
        12,
        unit="s",
        description="Training iteration time of the ranks on these GPUs (needs the "
        "perseus_client step hooks).",
    ),
    Panel(
        "timeseries",
        "GPU utilization (dcgm-exporter)",
        [
            Target(
                f"{dcgm('DCGM_FI_DEV_GPU_UTIL')} * on (uuid) group_left (node) "
                f"group by (uuid, node) (perseus_gpu_power_watts{{{GPUS}}})",
                "{{node}} GPU {{gpu}}",
            )
        ],
        12,
        unit="percent",
        description="dcgm-exporter's DCGM_FI_DEV_GPU_UTIL, joined on the GPU UUID: empty "
        "without dcgm-exporter.",
        min_value=0,
    ),
]

DATASOURCE_VARIABLE: dict[str, Any] = {
    "name": "datasource",
    "label": "Data source",
    "type": "datasource",
    "query": "prometheus",
    "current": {},
    "hide": 0,
    "includeAll": False,
    "multi": False,
    "options": [],
    "refresh": 1,
    "regex": "",
    "skipUrlSync": False,
}

JOB_VARIABLES = [
    Variable(
        "namespace",
        "Namespace",
        f"label_values(perseus_gpu_sm_clock_hertz{{{MANAGED}}}, job_namespace)",
    ),
    Variable(
        "job",
        "PerseusJob",
        "label_values(perseus_gpu_sm_clock_hertz"
        f'{{{MANAGED}, job_namespace="$namespace"}}, job_name)',
    ),
]
NODE_VARIABLES = [
    Variable("node", "Node", "label_values(perseus_gpu_power_watts, node)", multi=True),
    Variable("gpu", "GPU", 'label_values(perseus_gpu_power_watts{node=~"$node"}, gpu)', multi=True),
]

DASHBOARDS: dict[str, tuple[str, str, list[Variable | Constant], list[Panel | Row]]] = {
    "perseus-cluster": ("Perseus / Cluster overview", "1h", [*ENERGY_CONSTANTS], CLUSTER),
    "perseus-job": ("Perseus / Job", "1h", [*JOB_VARIABLES, *ENERGY_CONSTANTS], JOB_PANELS),
    "perseus-node": ("Perseus / Node & GPU", "1h", NODE_VARIABLES, NODE_PANELS),
}


# -- JSON --------------------------------------------------------------------------------------


def _variable(v: Variable | Constant) -> dict[str, Any]:
    if isinstance(v, Constant):
        # Grafana 10 reads a constant's current value, scenes (11) its query: both are set.
        return {
            "name": v.name,
            "label": v.label,
            "description": f"Chart value {ELECTRICITY_VALUES}.{v.chart_value}",
            "type": "constant",
            "query": v.value,
            "current": {"selected": False, "text": v.value, "value": v.value},
            "hide": 2,
            "options": [],
            "skipUrlSync": False,
        }
    return {
        "name": v.name,
        "label": v.label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": v.query,
        "query": {"query": v.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if v.multi else {},
        "hide": 0,
        "multi": v.multi,
        "includeAll": v.multi,
        "allValue": ".*" if v.multi else None,
        "options": [],
        "refresh": 2,  # on time range change
        "regex": "",
        "sort": 1,
        "skipUrlSync": False,
    }


def _target(t: Target, ref: str) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": t.expr,
        "legendFormat": t.legend or "__auto",
        "range": not t.instant,
        "instant": t.instant,
        "format": "table" if t.table else "time_series",
        "refId": ref,
    }


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "color": {"mode": "palette-classic" if p.kind == "timeseries" else "thresholds"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
    }
    if p.decimals is not None:
        defaults["decimals"] = p.decimals
    if p.min_value is not None:
        defaults["min"] = p.min_value
    options: dict[str, Any]
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "bars" if p.bars else "line",
            "lineWidth": 1,
            "fillOpacity": 80 if p.bars else 10,
            "showPoints": "never",
            "spanNulls": False,
            "axisPlacement": "auto",
            "axisLabel": "",
            "stacking": {"mode": "none", "group": "A"},
        }
        options = {
            "legend": {
                "showLegend": True,
                "displayMode": "list",
                "placement": "bottom",
                "calcs": [],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif p.kind == "stat":
        defaults["color"] = {"mode": "fixed", "fixedColor": "green"}
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
            "wideLayout": True,
            "showPercentChange": False,
        }
    elif p.kind == "bargauge":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "displayMode": "gradient",
            "orientation": "horizontal",
            "showUnfilled": True,
            "valueMode": "color",
            "namePlacement": "auto",
            "sizing": "auto",
            "minVizHeight": 16,
            "minVizWidth": 8,
            "maxVizHeight": 300,
        }
    elif p.kind == "table":
        defaults["custom"] = {"align": "auto", "cellOptions": {"type": "auto"}}
        options = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    else:
        raise ValueError(f"unknown panel kind {p.kind!r}")
    panel: dict[str, Any] = {
        "id": panel_id,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": p.overrides},
        "options": options,
        "targets": [_target(t, chr(ord("A") + i)) for i, t in enumerate(p.targets)],
    }
    if p.kind == "table":
        panel["transformations"] = [
            {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": {}}}
        ]
    return panel


def dashboard(uid: str) -> dict[str, Any]:
    """The dashboard ``uid`` as Grafana's JSON model."""
    title, time_from, variables, items = DASHBOARDS[uid]
    panels: list[dict[str, Any]] = []
    x = y = row_height = 0
    for number, item in enumerate(items, start=1):
        if isinstance(item, Row):
            if x:
                y, x = y + row_height, 0
            panels.append(
                {
                    "id": number,
                    "type": "row",
                    "title": item.title,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                    "panels": [],
                }
            )
            y, row_height = y + 1, 0
            continue
        if x + item.width > GRID_WIDTH:
            y, x, row_height = y + row_height, 0, 0
        panels.append(_panel(item, number, x, y))
        x += item.width
        row_height = max(row_height, item.height)
    return {
        "uid": uid,
        "title": title,
        "description": "Perseus for Kubernetes: GPU energy of pipeline-parallel training.",
        "tags": ["perseus", "gpu", "energy"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "time": {"from": f"now-{time_from}", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "weekStart": "",
        "links": [
            {
                "type": "dashboards",
                "tags": ["perseus"],
                "asDropdown": True,
                "title": "Perseus",
                "includeVars": False,
                "keepTime": True,
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": [DATASOURCE_VARIABLE, *(_variable(v) for v in variables)]},
        "panels": panels,
    }


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard, as written to the chart."""
    return {
        f"{uid}.json": json.dumps(dashboard(uid), indent=2, sort_keys=False) + "\n"
        for uid in DASHBOARDS
    }
