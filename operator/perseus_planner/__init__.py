"""Perseus planner: iteration time–energy frontier and per-GPU frequency plans.

Pure computation (no Kubernetes): load a profile, build the pipeline DAG, solve
the frontier, choose a point and turn it into a plan::

    profile = load_profile("profile.csv")
    dag = build_pipeline_dag("1f1b", num_stages=8, num_microbatches=24)
    problem = build_problem(profile, dag, unit_time_s=0.001, blocking_power_w=83.64)
    frontier = compute_frontier(problem)
    plan = build_plan(frontier, max_frequency_baseline(problem), choose_point(frontier),
                      Granularity.INSTRUCTION)
"""

from perseus_api.profile import Measurements, Profile, load_profile, parse_profile
from perseus_planner.bundled import BUNDLED_PROFILES, DEFAULT_PROFILE, bundled_profile
from perseus_planner.dag import PipelineDAG, Schedule, build_pipeline_dag
from perseus_planner.errors import (
    CostModelError,
    LimitError,
    PlannerError,
    ProfileError,
    ScheduleError,
    SolverError,
)
from perseus_planner.frontier import Baseline, Frontier, compute_frontier, max_frequency_baseline
from perseus_planner.limits import PlannerLimits, check_target, prepare_problem
from perseus_planner.model_stages import derive_profile, split_backward, split_virtual_stages
from perseus_planner.plan import Choice, build_plan, choose_point, stage_clocks
from perseus_planner.solver import FrontierPoint, FrontierProblem, build_problem, iterate_frontier

__all__ = [
    "BUNDLED_PROFILES",
    "DEFAULT_PROFILE",
    "Baseline",
    "Choice",
    "CostModelError",
    "Frontier",
    "FrontierPoint",
    "FrontierProblem",
    "LimitError",
    "Measurements",
    "PipelineDAG",
    "PlannerError",
    "PlannerLimits",
    "Profile",
    "ProfileError",
    "Schedule",
    "ScheduleError",
    "SolverError",
    "build_pipeline_dag",
    "build_plan",
    "build_problem",
    "bundled_profile",
    "check_target",
    "choose_point",
    "compute_frontier",
    "derive_profile",
    "iterate_frontier",
    "load_profile",
    "max_frequency_baseline",
    "parse_profile",
    "prepare_problem",
    "split_backward",
    "split_virtual_stages",
    "stage_clocks",
]
