"""``perseus plan --gpus/--ranks`` and ``perseus profile-plan``: node plans for standalone
agents, checked as the agent reads them (``perseus_api.node_plan.NodePlan``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from perseus_api.node_plan import NodePlan
from perseus_cli.main import main

M = 8


def _node_plan(path: Path) -> NodePlan:
    return NodePlan.model_validate_json(path.read_text())


def _places(plan: NodePlan) -> list[tuple[int | None, str, int, int]]:
    return [(a.rank, a.gpu_uuid or str(a.gpu_index), a.stage, a.dp_rank) for a in plan.assignments]


def test_gpus_of_one_node_get_the_ranks_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 8 stages (the bundled profile) on GPUs 7..0 by index, then by UUID for a second replica.
    gpus = [str(i) for i in range(7, -1, -1)] + [f"GPU-{i}" for i in range(8)]
    args = ["plan", "--microbatches", str(M), "--out", str(tmp_path), "--no-plot"]
    assert main([*args, "--gpus", ",".join(gpus), "--node", "gpu-7", "--job", "llm"]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "node-plan-gpu-7.json"
    assert (
        f"Standalone     on gpu-7: perseus-node-agent --standalone --node-name gpu-7 "
        f"--plan-file {path}"
    ) in out
    plan = _node_plan(path)
    assert (plan.node, plan.job, plan.namespace, plan.granularity.value) == (
        "gpu-7", "llm", "default", "Instruction",
    )  # fmt: skip
    pipeline = (tmp_path / "plan.json").read_text()
    assert plan.plans["main"].model_dump_json(indent=2) + "\n" == pipeline
    assert _places(plan) == [(r, gpus[r], r % 8, r // 8) for r in range(16)]


def test_node_defaults_to_node_name_then_host_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NODE_NAME", "from-env")
    args = ["plan", "--microbatches", str(M), "--out", str(tmp_path), "--no-plot"]
    assert main([*args, "--gpus", "0,1,2,3,4,5,6,7"]) == 0
    assert _node_plan(tmp_path / "node-plan-from-env.json").node == "from-env"


def test_a_ranks_file_spreads_the_pipeline_over_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two nodes of 4 GPUs: stages 0-3 on a, 4-7 on b; tensor-parallel columns optional.
    ranks = tmp_path / "ranks.csv"
    ranks.write_text("rank,node,gpu\n" + "".join(f"{r},{'ab'[r // 4]},{r % 4}\n" for r in range(8)))
    args = ["plan", "--microbatches", str(M), "--out", str(tmp_path / "o"), "--no-plot"]
    assert main([*args, "--ranks", str(ranks)]) == 0
    assert "(and likewise on b)" in capsys.readouterr().out
    a, b = (_node_plan(tmp_path / "o" / f"node-plan-{n}.json") for n in "ab")
    assert _places(a) == [(r, str(r), r, 0) for r in range(4)]
    assert _places(b) == [(r, str(r - 4), r, 0) for r in range(4, 8)]

    # Explicit stage and data-parallel rank columns win over the rank order.
    ranks.write_text(
        "rank,node,gpu,stage,dp_rank\n" + "".join(f"{r},a,{r},{7 - r},0\n" for r in range(8))
    )
    assert main([*args, "--force", "--ranks", str(ranks)]) == 0
    assert [x.stage for x in _node_plan(tmp_path / "o" / "node-plan-a.json").assignments] == list(
        range(7, -1, -1)
    )


@pytest.mark.parametrize(
    ("args", "ranks", "message"),
    [
        (["--gpus", "0,1,2"], None, "replica 0 has no rank for stage(s) 3, 4, 5, 6, 7: list 8"),
        (["--gpus", "0,,1"], None, "--gpus: a comma-separated list of GPU indices or UUIDs"),
        (["--node", "n1"], None, "--node goes with --gpus"),
        ([], "rank,host,gpu\n0,a,0\n", "the header must name rank,node,gpu"),
        ([], "rank,node,gpu\n0,a,0\n0,a,1\n", "rank 0 is given twice"),
        ([], "rank,node,gpu,stage\n0,a,0,9\n", "rank 0: stage 9, but the plan has 8 stages"),
        ([], "rank,node,gpu\nx,a,0\n", "line 2: rank must be an integer >= 0, got 'x'"),
        (
            [],
            "rank,node,gpu\n" + "".join(f"{r},a,{r % 4}\n" for r in range(8)),
            "ranks 0 and 4 are both on GPU 0 of node a: one GPU runs one rank",
        ),
    ],
)
def test_bad_mappings_are_refused_before_solving(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    ranks: str | None,
    message: str,
) -> None:
    if ranks is not None:
        (tmp_path / "r.csv").write_text(ranks)
        args = [*args, "--ranks", str(tmp_path / "r.csv")]
    out = tmp_path / "o"
    assert main(["plan", "--microbatches", str(M), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists()  # refused before the solve


def test_profile_plan_writes_a_profiling_node_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["profile-plan", "--stages", "2", "--microbatches", "4", "--schedule", "gpipe"]
    assert main([*args, "--gpus", "0,1", "--node", "n1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Sweep          71 clocks, 2100 to 1050 MHz, 7 iterations each (497 in all;" in out
    plan = _node_plan(tmp_path / "node-plan-n1.json")
    assert plan.profiling is not None
    assert plan.profiling.frequencies_mhz[:3] == [2100, 2085, 2070]
    assert (plan.profiling.iterations_per_frequency, plan.profiling.warmup_iterations) == (5, 2)
    pipeline = plan.plans["main"]
    assert (pipeline.schedule, pipeline.num_stages, pipeline.num_microbatches) == ("gpipe", 2, 4)
    # GPipe: every forward, then every backward, on each stage.
    names = [i.instruction for i in pipeline.stages[1].instructions]
    assert names == ["forward"] * 4 + ["backward"] * 4
    assert _places(plan) == [(0, "0", 0, 0), (1, "1", 1, 0)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clocks", "1005,1410"], "--clocks: frequencies must be in descending order"),
        (["--clocks", "fast"], "--clocks: integers in MHz, got 'fast'"),
        (["--min-mhz", "1500", "--max-mhz", "1400"], "--min-mhz 1500 is above --max-mhz 1400"),
        (["--node", "n1"], "--node goes with --gpus"),
    ],
)
def test_profile_plan_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    gpus = [] if "--node" in args else ["--gpus", "0,1"]
    base = ["profile-plan", "--stages", "2", "--microbatches", "4", "--out", str(tmp_path / "o")]
    assert main([*base, *gpus, *args]) == 2
    assert message in capsys.readouterr().err


def test_profile_plan_needs_a_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["profile-plan", "--stages", "2", "--microbatches", "4", "--out", str(tmp_path)]
    assert main(base) == 2
    assert "say which GPUs run the ranks: --gpus I,J,... (with --node) or --ranks" in (
        capsys.readouterr().err
    )
