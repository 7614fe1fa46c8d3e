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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--straggler-factor", "0.5"], "must be a number >= 1"),
        (["--straggler-factor", "nan"], "must be a number"),
        (["--replicas", "0"], "must be an integer >= 1"),
        (["--iterations", "x"], "must be an integer >= 1"),
        (["--straggler-onset", "-1"], "must be an integer >= 0"),
        (["--methods", "zeus,max"], "unknown or empty zeus"),
        (["--methods", ","], "unknown or empty"),
        (["--bundled", "nope"], "no bundled profile 'nope'"),
        (["--profile", "p.csv"], "--blocking-power is required"),
    ],
)
def test_bad_options_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["simulate", *SMALL, "--out", str(tmp_path / "o"), *extra]) == 2
    assert message in capsys.readouterr().err
