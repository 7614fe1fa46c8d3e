"""The end-to-end tests' training: ``perseus_emulation.job``, all 2 x 4 ranks of a
data-parallel x pipeline-parallel 1F1B job over the nodes' emulated GPUs (the bundled GPT-3 /
A100 profile's first four stages), and what its iteration records say."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from perseus_emulation.job import OVERHEADS
from support.agent_process import Agent, source_env
from support.operator_harness import cut_profile

STAGES, REPLICAS, MICROBATCHES, GPUS = 4, 2, 8, 4
BLOCKING_W = 83.64
# Profiled instruction times scaled by this; at 1, the profile's own times, an iteration of
# these 4 stages x 8 microbatches takes ~1.6 s, so hooks and hand-offs are a small share.
TIME_SCALE = 1.0
TIMEOUT_S = 240.0
MEASURED_ITERATIONS = 8
# Hand-off time per iteration tells a window the host stalled from one that measured the plan.
# Steady windows in the full e2e runs on this machine kind: 9-16 ms quiet, 16-26 ms with one
# core kept busy (single iterations up to 31 ms). In the one of 11 runs since the hand-off fix
# that failed (dbd071f), a stall of 15-40 s, with no change in the API traffic or the plans,
# put its two failing windows at 93 ms and 77 ms (single iterations up to 342 ms): the T_min
# plan at 1.626 s, 2.4% slower than after the stall, and the Stage plan 1.3% over its target.
# 2% of the iteration, the tests' time tolerance, is 32 ms at 1.59 s.
STALL_SHARE = 0.02
# That stall lasted 25 iterations: 3 windows of 8 more, then the tests judge what they get.
MAX_STALLED_WINDOWS = 3


@dataclass(frozen=True)
class Window:
    """Iterations between two records: energy per iteration (the mean) and each replica's
    median iteration time."""

    iterations: int
    energy_j: float
    node_energy_j: dict[str, float]
    replica_times_s: list[float]
    overheads: dict[str, float]
    """Per iteration, the emulation's own costs (``emulated_job.OVERHEADS``), mean."""
    stalled: int = 0
    """Windows set aside before this one, the host having stalled the ranks in them."""

    @property
    def iteration_s(self) -> float:
        return max(self.replica_times_s)


def window_of(records: list[dict[str, Any]], stalled: int = 0) -> Window:
    """The iterations after ``records[0]`` up to ``records[-1]``."""
    first, last = records[0], records[-1]
    n = last["iteration"] - first["iteration"]
    return Window(
        n,
        (last["energy_j"] - first["energy_j"]) / n,
        {k: (v - first["node_energy_j"][k]) / n for k, v in last["node_energy_j"].items()},
        # The median: a 2-core machine stalls every process now and then (an iteration ~10%
        # longer on both replicas at once), which says nothing about the plan.
        [
            statistics.median(r["replica_times_s"][d] for r in records[1:])
            for d in range(len(last["replica_times_s"]))
        ],
        {k: statistics.mean(r["overheads"][k] for r in records[1:]) for k in OVERHEADS},
        stalled,
    )


def host_stalled(window: Window) -> bool:
    """Whether the host, not the plan, set the window's pace: its ranks lost more time per
    iteration waking up at hand-offs (``handoff_s``, summed over the ranks) than
    :data:`STALL_SHARE` of the iteration."""
    return window.overheads["handoff_s"] > STALL_SHARE * window.iteration_s


class Training:
    """``perseus_emulation.job`` over the nodes' emulated GPUs, until :meth:`stop`.

    ``replicas`` and ``microbatches`` other than the module's: another job's shape (one replica
    per agent); ``name`` tells its files apart from another training's in ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        agents: list[Agent],
        *,
        hooks: bool,
        replicas: int = REPLICAS,
        microbatches: int = MICROBATCHES,
        name: str = "",
    ) -> None:
        kind = (f"{name}-" if name else "") + ("hooks" if hooks else "no-hooks")
        self.log = workdir / f"iterations-{kind}.jsonl"
        self.out = workdir / f"training-{kind}.out"
        self._records: list[dict[str, Any]] = []
        self._read_bytes = 0
        nodes = []
        for agent in agents:
            spec = f"name={agent.node},gpus={agent.num_gpus},state={agent.gpu_state}"
            if hooks:
                spec += f",socket={agent.socket_dir / 'agent.sock'}"
            nodes += ["--node", spec]
        profile = workdir / f"profile{'-' + name if name else ''}.csv"
        profile.write_text(cut_profile(STAGES) + "\n")
        with self.out.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "perseus_emulation.job",
                    f"--profile={profile}", f"--blocking-power={BLOCKING_W}",
                    f"--stages={STAGES}", f"--replicas={replicas}",
                    f"--microbatches={microbatches}", f"--time-scale={TIME_SCALE}",
                    f"--log={self.log}", "--client-retry-s=1", *nodes,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=source_env(),
            )  # fmt: skip

    def records(self) -> list[dict[str, Any]]:
        """Every iteration's record so far. Read on from where the last call stopped: the tests
        poll this ten times a second, and re-parsing the whole log would take CPU from the
        training it measures."""
        if not self.log.exists():
            return []
        with self.log.open("rb") as log:
            log.seek(self._read_bytes)
            text = log.read()
        complete = text[: text.rfind(b"\n") + 1]  # a line still being written waits
        self._read_bytes += len(complete)
        self._records += [json.loads(line) for line in complete.splitlines() if line]
        return list(self._records)

    def wait_iterations(self, count: int, timeout_s: float = TIMEOUT_S) -> list[dict[str, Any]]:
        """The records of the next ``count`` iterations, and the one before them."""
        start = len(self.records())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = self.records()
            if len(records) > start + count:
                return records[start : start + count + 1]
            if self.proc.poll() is not None:
                pytest.fail(f"the training exited ({self.proc.returncode}):\n{self.output()}")
            time.sleep(0.1)
        pytest.fail(f"{count} iterations took over {timeout_s} s:\n{self.output()}")

    def measure(self, count: int = MEASURED_ITERATIONS, *, steady: bool = True) -> Window:
        """The next ``count`` iterations. ``steady``: the plan is not changing, so a window in
        which the host stalled the ranks (:func:`host_stalled`) is set aside and the next one
        measured, up to :data:`MAX_STALLED_WINDOWS` times; the window says how many were."""
        for stalled in range(MAX_STALLED_WINDOWS + 1):
            window = window_of(self.wait_iterations(count), stalled=stalled)
            if not steady or not host_stalled(window):
                break
            if stalled < MAX_STALLED_WINDOWS:
                print(f"set aside a stalled window: {window}")
        return window

    def output(self) -> str:
        return self.out.read_text(errors="replace")[-10000:] if self.out.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
