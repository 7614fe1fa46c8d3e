"""Simulated data-parallel x pipeline-parallel training under different clock assignments.

Pure and fast: one iteration of one pipeline is a longest-path pass over the planner's DAG
with the profile's measured times (see :mod:`perseus_planner.sim.engine`); replicas are
combined with numpy, and only the few distinct clock assignments of a run are simulated
(:mod:`perseus_planner.sim.emulation` has the paper's 1,024-8,192-GPU settings)::

    setup = sim_setup(frontier, max_frequency_baseline(frontier.problem))
    run = run_method(setup, "perseus-instruction", Scenario(4, 100, 1.2, 50))
    print(summarize(setup, run))
"""

from perseus_planner.sim.engine import (
    Assignment,
    ClockTable,
    PipelineGraph,
    RunResult,
    clock_table,
    makespans_s,
    measure_assignments,
    pipeline_graph,
    simulate_run,
)
from perseus_planner.sim.methods import METHODS, STRAGGLER_BLIND, SimSetup, sim_setup
from perseus_planner.sim.run import (
    STRAGGLER_CLOCKS,
    MethodRun,
    PlanCache,
    Scenario,
    StragglerClocks,
    Summary,
    run_method,
    straggler_sweep,
    summarize,
)

__all__ = [
    "METHODS",
    "STRAGGLER_BLIND",
    "STRAGGLER_CLOCKS",
    "Assignment",
    "ClockTable",
    "MethodRun",
    "PipelineGraph",
    "PlanCache",
    "RunResult",
    "Scenario",
    "SimSetup",
    "StragglerClocks",
    "Summary",
    "clock_table",
    "makespans_s",
    "measure_assignments",
    "pipeline_graph",
    "run_method",
    "sim_setup",
    "simulate_run",
    "straggler_sweep",
    "summarize",
]
