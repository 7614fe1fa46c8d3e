"""The user guide's "Pipeline schedules" savings table is the one the benchmark computes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_readme_table_is_computed() -> None:
    spec = importlib.util.spec_from_file_location(
        "schedules_bench", REPO / "benchmarks" / "schedules.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    table = bench.savings_table()
    assert table.count("\n") == 7  # header, rule, 2 profiles x 3 schedules
    guide = (REPO / "docs" / "user-guide" / "planning.md").read_text()
    assert table in guide, (
        "docs/user-guide/planning.md: schedule table stale: run make bench-schedules"
    )
