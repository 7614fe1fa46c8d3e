"""``perseus simulate`` end to end on a small configuration, and its option errors."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from perseus_cli.main import main
from perseus_planner.sim import METHODS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--microbatches", "8", "--replicas", "2", "--iterations", "6"]


def test_small_run_writes_table_csv_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", *SMALL, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["simulate.csv", "simulate.png"]
    assert (out / "simulate.png").read_bytes().startswith(PNG_MAGIC)
    for method in METHODS:
        assert method in stdout
    assert "straggler x1.2 from iteration 3" in stdout

    with (out / "simulate.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(METHODS) * 6
    by_method: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_method.setdefault(row["method"], []).append(row)
    base = by_method["max"]
    assert all(float(r["energy_j"]) == pytest.approx(float(r["baseline_energy_j"])) for r in base)
    # The straggler from iteration 3 stretches every iteration by 1.2.
    assert float(base[3]["time_s"]) == pytest.approx(1.2 * float(base[0]["time_s"]))
    perseus = by_method["perseus-instruction"]
    assert float(perseus[5]["energy_j"]) < float(perseus[5]["baseline_energy_j"])


def test_methods_subset_and_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    args = ["simulate", *SMALL, "--methods", "max,EnvPipe", "--out", str(out)]
    assert main(args) == 0
    assert main(args) == 2  # not empty without --force
    assert "not empty" in capsys.readouterr().err
    assert main([*args, "--force", "--straggler-factor", "1"]) == 0
    lines = (out / "simulate.csv").read_text().splitlines()
    assert {line.split(",")[0] for line in lines[1:]} == {"max", "envpipe"}


def test_a_kind_of_method_names_all_of_its_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", *SMALL, "--methods", "max,perseus", "--out", str(out)]) == 0
    lines = (out / "simulate.csv").read_text().splitlines()
    assert {line.split(",")[0] for line in lines[1:]} == {
        "max", "perseus-instruction", "perseus-stage",
    }  # fmt: skip


def test_the_figure7_command_prints_the_tables_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The README's command for its Figure 7 table (Bloom on A100: 29.86 %), with the run cut
    # short: the straggler is there from the first iteration, so every iteration counts.
    command = ["simulate", "--scale", "1024", "--bundled", "bloom+a100_sxm", "--iterations", "2"]
    methods = ["--methods", "max,perseus-instruction"]
    assert main([*command, *methods, "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    assert "Perseus saves 29.86%" in stdout
    simulated = next(line for line in stdout.splitlines() if line.startswith("perseus-instruction"))
    assert float(simulated.split()[3].rstrip("%")) == pytest.approx(29.86, abs=0.5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--straggler-factor", "0.5"], "must be a number >= 1"),
        (["--straggler-factor", "nan"], "must be a number"),
        (["--replicas", "0"], "must be an integer >= 1"),
        (["--iterations", "x"], "must be an integer >= 1"),
        (["--straggler-onset", "-1"], "must be an integer >= 0"),
        (["--methods", "zeu,max"], "--methods: unknown method 'zeu'; choose from max, "),
        (["--methods", ","], "--methods: no method in ','"),
        (["--bundled", "nope"], "no bundled profile 'nope'"),
        (["--profile", "p.csv"], "--blocking-power is required"),
    ],
)
def test_bad_options_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["simulate", *SMALL, "--out", str(tmp_path / "o"), *extra]) == 2
    assert message in capsys.readouterr().err


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_scale_emulates_the_papers_layout_with_tp8_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 8,192 GPUs: 128 pipelines of 12 microbatches, the straggler at max clock; reported times
    # x10 and energies x80 of the same simulation run without --scale.
    common = ["--bundled", "bloom+a100_sxm", "--iterations", "4", "--methods", "max,envpipe"]
    scaled, plain = tmp_path / "scaled", tmp_path / "plain"
    assert main(["simulate", *common, "--scale", "8192", "--out", str(scaled)]) == 0
    stdout = capsys.readouterr().out
    assert "8,192 GPUs = 128 pipelines x 8 stages x TP 8 (times x10, energies x80), M=12" in stdout
    # The straggler is there from the start, as in Figure 7, whose accounting is printed too.
    assert "straggler x1.2 from iteration 0 at max clock under every method" in stdout
    assert "Figure 7 accounting (planner's frontier, the README table's): Perseus saves " in stdout
    layout = ["--microbatches", "12", "--replicas", "128", "--straggler-clocks", "max"]
    layout += ["--straggler-onset", "0"]
    assert main(["simulate", *common, *layout, "--out", str(plain)]) == 0
    for big, small in zip(
        _csv_rows(scaled / "simulate.csv"), _csv_rows(plain / "simulate.csv"), strict=True
    ):
        assert (big["method"], big["iteration"]) == (small["method"], small["iteration"])
        assert float(big["time_s"]) == pytest.approx(10 * float(small["time_s"]), rel=1e-12)
        for column in ("energy_j", "baseline_energy_j"):
            assert float(big[column]) == pytest.approx(80 * float(small[column]), rel=1e-12)
    assert (scaled / "simulate.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scale", "1000"], "cannot emulate 1000 GPUs; supported GPU counts: 1024, 2048, 4096"),
        (["--scale", "1024", "--microbatches", "8"], "drop --microbatches"),
        (["--scale", "1024", "--replicas", "2", "--schedule", "1f1b"], "drop --replicas, --sched"),
        (["--scale", "1024", "--profile", "p.csv", "--blocking-power", "80"], "drop --profile"),
        (["--scale", "2048", "--bundled", "nope"], "--bundled must be one of gpt3-175b+a100_sxm"),
        (["--scale", "0"], "must be an integer >= 1"),
        (["--straggler-clocks", "min"], "invalid choice: 'min'"),
    ],
)
def test_bad_scale_options_exit_2_before_solving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "o"
    assert main(["simulate", *args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
