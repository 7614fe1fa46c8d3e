"""The e2e training's measurement windows (``tests/support/emulated_training.py``), on the
iteration records of a real e2e run: the T_min plan steady, then the stall that failed a run
(the host slowed every rank for ~40 s; hand-offs up to 262 ms an iteration)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from support.emulated_training import (
    MAX_STALLED_WINDOWS,
    Training,
    host_stalled,
    window_of,
)

# (iteration, replica 0 s, replica 1 s, cumulative energy J, hand-off ms), from the run's log.
STEADY = [
    (55, 1.5867, 1.5835, 239513.8, 8.3),
    (56, 1.5841, 1.5850, 243958.5, 13.9),
    (57, 1.5867, 1.5881, 248405.5, 15.5),
    (58, 1.5924, 1.5889, 252854.6, 13.7),
    (59, 1.5847, 1.5867, 257298.3, 14.1),
    (60, 1.5891, 1.5866, 261745.4, 14.8),
    (61, 1.5868, 1.5841, 266186.2, 11.5),
    (62, 1.5866, 1.5884, 270631.4, 13.7),
    (63, 1.5877, 1.5883, 275076.0, 17.8),
]
STALLED = [
    (67, 1.5883, 1.5871, 292856.9, 18.8),
    (68, 1.6167, 1.5951, 297333.9, 51.7),
    (69, 1.6156, 1.6009, 301834.4, 31.6),
    (70, 1.6061, 1.6097, 306315.3, 53.5),
    (71, 1.6026, 1.5994, 310794.1, 24.1),
    (72, 1.6428, 1.6587, 315367.1, 113.8),
    (73, 1.6152, 1.6428, 319872.9, 67.4),
    (74, 1.6517, 1.6641, 324482.7, 137.3),
    (75, 1.7374, 1.7239, 329175.1, 262.0),
]


def record(row: tuple[int, float, float, float, float]) -> dict[str, Any]:
    iteration, rep0, rep1, energy_j, handoff_ms = row
    return {
        "iteration": iteration,
        "replica_times_s": [rep0, rep1],
        "energy_j": energy_j,
        "node_energy_j": {"gpu-node-0": energy_j / 2, "gpu-node-1": energy_j / 2},
        "overheads": {
            "hook_s": 0.05,
            "clock_lag_s": 0.002,
            "clock_changes": 5.0,
            "handoff_s": handoff_ms / 1e3,
            "handoffs": 50.0,
        },
    }


def test_a_steady_window_is_the_plans_and_the_stalled_one_is_the_hosts() -> None:
    steady = window_of([record(r) for r in STEADY])
    assert steady.iterations == 8
    assert steady.iteration_s == pytest.approx(1.5874)  # replica 1's median
    assert steady.energy_j == pytest.approx((275076.0 - 239513.8) / 8)
    assert steady.overheads["handoff_s"] == pytest.approx(0.014375)
    assert not host_stalled(steady)

    stalled = window_of([record(r) for r in STALLED])
    assert stalled.overheads["handoff_s"] == pytest.approx(0.092675)
    assert host_stalled(stalled)


class Replay(Training):
    """A Training whose iterations are the given records, in order (no process, no log)."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self._replay, self._at = records, 0

    def wait_iterations(self, count: int, timeout_s: float = 0.0) -> list[dict[str, Any]]:
        window = self._replay[self._at : self._at + count + 1]
        assert len(window) == count + 1, "the replay ran out of records"
        self._at += count
        return window


def replay(*stretches: list[tuple[int, float, float, float, float]]) -> Replay:
    """The stretches' iterations one after the other, renumbered, energy counters carried on."""
    records = [record((0, STEADY[0][1], STEADY[0][2], 0.0, STEADY[0][4]))]
    for rows in stretches:
        for before, row in itertools.pairwise(rows):
            last = records[-1]
            energy_j = last["energy_j"] + row[3] - before[3]
            records.append(record((last["iteration"] + 1, row[1], row[2], energy_j, row[4])))
    return Replay(records)


def test_measure_sets_stalled_windows_aside_and_says_how_many() -> None:
    training = replay(STEADY, STALLED, STALLED, STEADY)
    first = training.measure()
    assert first.stalled == 0 and first.iteration_s == pytest.approx(1.5874)
    after = training.measure()  # the stall's two windows set aside, then the plan again
    assert after.stalled == 2 and after.iteration_s == pytest.approx(1.5874)
    assert not host_stalled(after)


def test_measure_gives_up_on_a_stall_that_does_not_end() -> None:
    window = replay(*[STALLED] * (MAX_STALLED_WINDOWS + 1)).measure()
    assert window.stalled == MAX_STALLED_WINDOWS and host_stalled(window)
    # A window in which the plan may change (steady=False) is never set aside.
    assert replay(STALLED).measure(steady=False).stalled == 0
