"""The solved DAG as a JSON document (``perseus plan --export-dag``), and back.

The document holds everything needed to re-solve the same problem with another solver::

    {
      "format": "perseus-dag/v1",
      "schedule": "interleaved-1f1b",     # as built; informative once exported
      "num_microbatches": 8,
      "virtual_stages": 2,
      "unit_time_s": 0.001,               # the solver's time quantum
      "blocking_power_w": 83.64,          # power of one GPU while it waits
      "num_gpus": 4,                      # GPUs drawing blocking power (pipeline stages)
      "nodes": [                          # GPU by GPU, each in its execution order
        {"id": 0, "stage": 0, "virtual_stage": 0, "instruction": "forward", "microbatch": 0,
         "options": [{"frequency_mhz": 1410, "time_s": 0.0123, "energy_j": 4.56}, ...]},
        ...
      ],
      "edges": [[0, 1], ...]              # from_id must finish before to_id starts
    }

``stage`` is the GPU (pipeline stage) running the node and ``virtual_stage`` the model
stage whose measurements it uses (``v * num_gpus + stage``; equal to ``stage`` without
virtual stages). ``options`` are the profile's measurements of that model stage and
instruction as they were given to the solver (after any ``--derive-profile`` split), before
the solver's own Pareto filter and quantization (:mod:`perseus_planner.options`). Edges
are every dependency the solver saw: each GPU's order (consecutive nodes) and the data
dependencies across GPUs. An iteration's energy is the nodes' energy plus
``blocking_power_w`` for every GPU over the time it does not compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from perseus_api.errors import ScheduleError
from perseus_api.profile import Measurements, Profile
from perseus_api.schedule import Schedule
from perseus_planner.dag import Computation, PipelineDAG, validate_dag
from perseus_planner.solver import FrontierProblem

__all__ = ["DAG_FORMAT", "LoadedDAG", "export_dag", "load_dag"]

DAG_FORMAT: Final = "perseus-dag/v1"


def export_dag(problem: FrontierProblem) -> dict[str, Any]:
    """The document of ``problem``'s DAG and measured options (see the module docstring)."""
    dag = problem.dag
    options: dict[tuple[int, str], list[dict[str, Any]]] = {}
    nodes = []
    for gpu_order in dag.stage_order:
        for i in gpu_order:
            comp = dag.computations[i]
            key = (comp.stage, comp.instruction)
            if key not in options:
                m = problem.profile.get(*key)
                options[key] = [
                    {"frequency_mhz": f, "time_s": t, "energy_j": e}
                    for f, t, e in zip(
                        m.frequencies_mhz.tolist(),
                        m.times_s.tolist(),
                        m.energies_j.tolist(),
                        strict=True,
                    )
                ]
            nodes.append(
                {
                    "id": i,
                    "stage": comp.gpu,
                    "virtual_stage": comp.stage,
                    "instruction": comp.instruction,
                    "microbatch": comp.microbatch,
                    "options": options[key],
                }
            )
    return {
        "format": DAG_FORMAT,
        "schedule": dag.schedule.value,
        "num_microbatches": dag.num_microbatches,
        "virtual_stages": dag.virtual_stages,
        "unit_time_s": problem.unit_time_s,
        "blocking_power_w": problem.blocking_power_w,
        "num_gpus": dag.num_stages,
        "nodes": nodes,
        "edges": dag.edges.tolist(),
    }


@dataclass(frozen=True)
class LoadedDAG:
    """A document read back: the DAG, a profile the solver takes for it, and its settings."""

    dag: PipelineDAG
    profile: Profile
    unit_time_s: float
    blocking_power_w: float


def load_dag(doc: dict[str, Any], source: str = "DAG document") -> LoadedDAG:
    """Rebuild the DAG and options of a document written by :func:`export_dag`.

    Raises:
        ScheduleError: The document is not one, or its DAG is invalid (a cycle, a node
            missing from the orders, two option lists for one model stage and instruction).
    """
    try:
        if doc.get("format") != DAG_FORMAT:
            raise ScheduleError(
                f"{source}: format must be {DAG_FORMAT!r}, got {doc.get('format')!r}"
            )
        num_gpus = int(doc["num_gpus"])
        nodes = sorted(doc["nodes"], key=lambda node: int(node["id"]))
        if [int(node["id"]) for node in nodes] != list(range(len(nodes))):
            raise ScheduleError(f"{source}: node ids must be 0..{len(nodes) - 1}")
        computations = {
            int(node["id"]): Computation(
                int(node["virtual_stage"]),
                int(node["microbatch"]),
                str(node["instruction"]),
                int(node["stage"]),
            )
            for node in nodes
        }
        orders: list[list[int]] = [[] for _ in range(num_gpus)]
        measured: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
        for node in doc["nodes"]:  # listed GPU by GPU, each in its execution order
            comp = computations[int(node["id"])]
            orders[comp.gpu].append(int(node["id"]))
            rows = [
                (int(o["frequency_mhz"]), float(o["time_s"]), float(o["energy_j"]))
                for o in node["options"]
            ]
            known = measured.setdefault((comp.stage, comp.instruction), rows)
            if known != rows:
                raise ScheduleError(
                    f"{source}: node {node['id']} has other options than another node of "
                    f"virtual stage {comp.stage} {comp.instruction}"
                )
        edges = np.asarray(doc["edges"], dtype=np.int64).reshape(-1, 2)
        if edges.size and not (edges.min() >= 0 and edges.max() < len(nodes)):
            raise ScheduleError(f"{source}: edges must join node ids 0..{len(nodes) - 1}")
        dag = PipelineDAG(
            schedule=Schedule.parse(doc["schedule"]),
            num_stages=num_gpus,
            num_microbatches=int(doc["num_microbatches"]),
            computations=tuple(computations[i] for i in range(len(nodes))),
            edges=edges,
            stage_order=tuple(tuple(order) for order in orders),
            virtual_stages=int(doc.get("virtual_stages", 1)),
        )
        unit_time_s = float(doc["unit_time_s"])
        blocking_power_w = float(doc["blocking_power_w"])
    except ScheduleError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ScheduleError(f"{source}: not a {DAG_FORMAT} document ({exc!r})") from exc
    validate_dag(dag)
    measurements = {
        key: Measurements(
            frequencies_mhz=np.array([r[0] for r in rows], dtype=np.int64),
            times_s=np.array([r[1] for r in rows], dtype=np.float64),
            energies_j=np.array([r[2] for r in rows], dtype=np.float64),
        )
        for key, rows in measured.items()
    }
    # As :func:`perseus_planner.model_stages.solver_profile` gives it: keyed by model stage,
    # counted in GPUs (what the solver checks and charges blocking power for).
    return LoadedDAG(dag, Profile(source, num_gpus, measurements), unit_time_s, blocking_power_w)
