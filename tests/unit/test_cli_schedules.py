"""``perseus plan`` with the new schedules and ``--export-dag``: schema, round trip, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perseus_api import PipelinePlan
from perseus_api.schedule import gpu_computation_order
from perseus_cli.main import main
from perseus_planner import compute_frontier
from perseus_planner.dag_json import DAG_FORMAT, load_dag
from perseus_planner.solver import build_problem

M = 8  # a multiple of the bundled profiles' 8 stages, as interleaved 1F1B needs

SCHEDULES = [
    pytest.param(("1f1b",), 1, ("forward", "backward"), id="1f1b"),
    pytest.param(("gpipe",), 1, ("forward", "backward"), id="gpipe"),
    pytest.param(
        ("interleaved-1f1b", "--virtual-stages", "2"), 2, ("forward", "backward"), id="interleaved"
    ),
    pytest.param(("zb-h1",), 1, ("forward", "backward_input", "backward_weight"), id="zb-h1"),
]


def _plan(out: Path, *extra: str) -> int:
    return main(["plan", "--microbatches", str(M), "--out", str(out), "--no-plot", *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run per schedule (bundled profile, T_min), each with --export-dag."""
    done = {}
    for param in SCHEDULES:
        args = param.values[0]
        assert isinstance(args, tuple)
        out = tmp_path_factory.mktemp(args[0]) / "out"
        assert (
            _plan(out, "--quiet", "--schedule", *args, "--export-dag", str(out / "dag.json")) == 0
        )
        done[args[0]] = out
    return done


def _doc(runs: dict[str, Path], schedule: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((runs[schedule] / "dag.json").read_text())
    return doc


@pytest.mark.parametrize(("args", "virtual", "instructions"), SCHEDULES)
def test_export_dag_schema(
    runs: dict[str, Path], args: tuple[str, ...], virtual: int, instructions: tuple[str, ...]
) -> None:
    doc = _doc(runs, args[0])
    assert doc["format"] == DAG_FORMAT
    assert {"unit_time_s", "blocking_power_w", "num_gpus", "nodes", "edges"} <= set(doc)
    assert (doc["unit_time_s"], doc["blocking_power_w"], doc["num_gpus"]) == (0.001, 83.64, 8)
    assert doc["virtual_stages"] == virtual
    nodes = doc["nodes"]
    assert len(nodes) == 8 * virtual * len(instructions) * M
    assert [n["id"] for n in sorted(nodes, key=lambda n: n["id"])] == list(range(len(nodes)))
    for node in nodes:
        assert set(node) == {"id", "stage", "virtual_stage", "instruction", "microbatch", "options"}
        assert node["instruction"] in instructions
        assert node["virtual_stage"] % 8 == node["stage"]
        # Every profiled clock, as measured (the bundled A100 profiles sweep 1410..900 MHz).
        freqs = [o["frequency_mhz"] for o in node["options"]]
        assert freqs[0] == 1410 and len(freqs) == len(set(freqs)) > 20
        assert all(set(o) == {"frequency_mhz", "time_s", "energy_j"} for o in node["options"])
    # Nodes are listed GPU by GPU, each in the schedule's order.
    for gpu in range(8):
        listed = [
            (n["instruction"], n["microbatch"], n["virtual_stage"])
            for n in nodes
            if n["stage"] == gpu
        ]
        assert listed == [tuple(s) for s in gpu_computation_order(args[0], 8, M, gpu, virtual)]
    ids = {n["id"] for n in nodes}
    assert all(len(e) == 2 and e[0] in ids and e[1] in ids for e in doc["edges"])


@pytest.mark.parametrize(("args", "virtual", "instructions"), SCHEDULES)
def test_export_dag_round_trips(
    runs: dict[str, Path], args: tuple[str, ...], virtual: int, instructions: tuple[str, ...]
) -> None:
    out = runs[args[0]]
    loaded = load_dag(_doc(runs, args[0]), "dag.json")
    assert loaded.dag.virtual_stages == virtual
    problem = build_problem(loaded.profile, loaded.dag, loaded.unit_time_s, loaded.blocking_power_w)
    frontier = compute_frontier(problem)
    rows = (out / "frontier.csv").read_text().splitlines()[1:]
    written = np.array([[float(x) for x in row.split(",")] for row in rows])
    assert np.array_equal(frontier.times_s, written[:, 0])
    assert np.array_equal(frontier.energies_j, written[:, 1])


@pytest.mark.parametrize(("args", "virtual", "instructions"), SCHEDULES)
def test_plan_json_lists_each_gpus_computations_in_schedule_order(
    runs: dict[str, Path], args: tuple[str, ...], virtual: int, instructions: tuple[str, ...]
) -> None:
    text = (runs[args[0]] / "plan.json").read_text()
    plan = PipelinePlan.model_validate_json(text)
    assert (plan.schedule, plan.virtual_stages) == (args[0], virtual)
    for stage in plan.stages:
        steps = gpu_computation_order(args[0], 8, M, stage.stage, virtual)
        assert [i.instruction for i in stage.instructions] == [s.instruction for s in steps]
        assert [i.microbatch for i in stage.instructions] == [s.microbatch for s in steps]
        expected = [s.virtual_stage for s in steps] if virtual > 1 else [None] * len(steps)
        assert [i.virtual_stage for i in stage.instructions] == expected
    # Without virtual stages the field is left out, so such plans read as before.
    assert ('"virtual_stage"' in text) == (virtual > 1)


def test_plan_without_virtual_stage_is_refused_with_virtual_stages(runs: dict[str, Path]) -> None:
    doc = json.loads((runs["interleaved-1f1b"] / "plan.json").read_text())
    del doc["stages"][0]["instructions"][0]["virtual_stage"]
    with pytest.raises(ValueError, match="computation 0 is forward of microbatch 0 without a"):
        PipelinePlan.model_validate(doc)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--schedule", "1f1b", "--virtual-stages", "2"),
            "--virtual-stages applies to interleaved-1f1b only, not 1f1b",
        ),
        (
            ("--schedule", "interleaved-1f1b"),
            "Interleaved1F1B needs virtualStages >= 2 and microbatches a multiple of "
            "pipelineStages (got 8 microbatches for 8 stages, virtualStages 1)",
        ),
        (
            ("--schedule", "gpipe", "--derive-profile"),
            "--derive-profile applies to interleaved-1f1b and zb-h1, not gpipe",
        ),
        (
            ("--schedule", "interleaved-1f1b", "--backward-input-fraction", "0.4"),
            "--backward-input-fraction applies to zb-h1 only",
        ),
        (
            ("--schedule", "zb-h1", "--backward-input-fraction", "1.5"),
            "the backward-input fraction must be in (0, 1), got 1.5",
        ),
    ],
)
def test_bad_schedule_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    assert _plan(tmp_path / "out", *args) == 2
    assert message in capsys.readouterr().err


def test_user_profile_in_the_wrong_form_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from perseus_planner import bundled_profile

    path = str(bundled_profile("gpt3-175b+a100_sxm").path)
    common = ("--profile", path, "--blocking-power", "83.64")
    assert _plan(tmp_path / "zb", *common, "--schedule", "zb-h1") == 2
    assert "stage 0 has no backward_input rows; split each backward" in capsys.readouterr().err
    # Taken as given, 8 profiled stages are 4 GPUs x 2 virtual stages (v*4+p on GPU p).
    interleaved = (*common, "--schedule", "interleaved-1f1b", "--virtual-stages", "2")
    assert _plan(tmp_path / "il", *interleaved, "--quiet") == 0
    assert (
        PipelinePlan.model_validate_json((tmp_path / "il" / "plan.json").read_text()).num_stages
        == 4
    )
    assert _plan(tmp_path / "il8", *interleaved, "--stages", "8") == 2
    err = capsys.readouterr().err
    assert "--stages 8 x 2 virtual stages does not match the profile" in err
    assert "which has 8 stages" in err
    assert (
        _plan(tmp_path / "ok", *common, "--quiet", "--schedule", "zb-h1", "--derive-profile") == 0
    )


def test_zb_h1_backward_input_fraction_changes_the_split(tmp_path: Path) -> None:
    out = tmp_path / "out"
    dag_path = tmp_path / "dag.json"
    args = ("--quiet", "--schedule", "zb-h1", "--backward-input-fraction", "0.25")
    assert _plan(out, *args, "--export-dag", str(dag_path)) == 0
    nodes = json.loads(dag_path.read_text())["nodes"]
    first = {
        n["instruction"]: n["options"][0] for n in nodes if (n["stage"], n["microbatch"]) == (0, 0)
    }
    ratio = first["backward_input"]["time_s"] / first["backward_weight"]["time_s"]
    assert ratio == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "args", [("interleaved-1f1b", "--virtual-stages", "2"), ("zb-h1",)], ids=["interleaved", "zb"]
)
def test_simulate_takes_the_new_schedules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...]
) -> None:
    out = tmp_path / "sim"
    common = ["simulate", "--microbatches", str(M), "--iterations", "4", "--replicas", "2"]
    methods = ["--methods", "max,perseus-instruction,perseus-stage,zeus-per-stage"]
    assert main([*common, *methods, "--schedule", *args, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert f"{args[0]}, 8 stages" in stdout
    rows = (out / "simulate.csv").read_text().splitlines()[1:]
    saved = {}
    for row in rows:
        method, _, _, energy_j, baseline_j = row.split(",")
        saved.setdefault(method, []).append(1 - float(energy_j) / float(baseline_j))
    assert set(saved) == {"max", "perseus-instruction", "perseus-stage", "zeus-per-stage"}
    assert max(saved["max"]) == pytest.approx(0.0, abs=1e-9)
    assert min(saved["perseus-instruction"]) > 0.05


def test_load_dag_refuses_what_is_not_a_solvable_dag(runs: dict[str, Path]) -> None:
    from perseus_api.errors import ScheduleError

    good = _doc(runs, "zb-h1")
    with pytest.raises(ScheduleError, match="format must be 'perseus-dag/v1'"):
        load_dag({**good, "format": "other"})
    with pytest.raises(ScheduleError, match="edges must join node ids"):
        load_dag({**good, "edges": [*good["edges"], [0, len(good["nodes"])]]})
    with pytest.raises(ScheduleError, match="the dependency graph has a cycle"):
        load_dag({**good, "edges": [*good["edges"], list(reversed(good["edges"][0]))]})
    nodes = json.loads(json.dumps(good["nodes"]))
    nodes[1]["options"] = nodes[1]["options"][:-1]
    with pytest.raises(ScheduleError, match="has other options than another node"):
        load_dag({**good, "nodes": nodes})
    with pytest.raises(ScheduleError, match="not a perseus-dag/v1 document"):
        load_dag({k: v for k, v in good.items() if k != "num_gpus"})
