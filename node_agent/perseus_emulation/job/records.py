"""What an emulated job is given and gives back: its nodes, its ranks' places, its
iteration records, its result and its error."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "OVERHEADS",
    "EmulatedJobError",
    "IterationRecord",
    "JobResult",
    "NodeSpec",
    "RankInfo",
]


@dataclass(frozen=True)
class NodeSpec:
    """One emulated node (one pod of the job).

    Attributes:
        name: Node name; part of its GPUs' UUIDs (``GPU-emu-<name>-<index>``).
        gpus: Its GPUs, one rank each.
        socket: The node agent's socket; ``None``: the ranks send no hooks.
        state_file: Emulated GPU state file shared with the node's agent; ``None``: in memory.
    """

    name: str
    gpus: int
    socket: Path | None = None
    state_file: Path | None = None


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: what a :data:`ClientFactory` is given."""

    rank: int
    replica: int
    stage: int
    node_rank: int
    node: NodeSpec
    gpu_index: int
    gpu_uuid: str


@dataclass(frozen=True)
class IterationRecord:
    """One completed iteration of the whole job (see the package docstring)."""

    iteration: int
    end_s: float
    """``time.monotonic()`` when the last rank reached the all-reduce barrier."""
    replica_times_s: tuple[float, ...]
    """Per replica: its ranks' earliest ``on_step_begin`` to their latest ``on_step_end``."""
    energy_j: float
    """Sum of the energy counters of all the job's GPUs, read after the iteration."""
    node_energy_j: dict[str, float]
    """Per node name, the sum of its GPUs' energy counters."""
    busy_s: float
    """Sum of the busy-time counters of all the job's GPUs."""
    node_busy_s: dict[str, float]
    """Per node name, the sum of its GPUs' busy-time counters."""
    overheads: dict[str, float] = field(default_factory=dict)
    """What the emulation spent on the iteration, summed over its ranks (see
    :data:`OVERHEADS`)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "end_s": self.end_s,
            "replica_times_s": list(self.replica_times_s),
            "energy_j": self.energy_j,
            "node_energy_j": dict(self.node_energy_j),
            "busy_s": self.busy_s,
            "node_busy_s": dict(self.node_busy_s),
            "overheads": dict(self.overheads),
        }


OVERHEADS: dict[str, str] = {
    "hook_s": "time the ranks spent in perseus_client calls",
    "clock_lag_s": "time computations ran at the previous clock before the agent's change",
    "clock_changes": "computations whose clock changed while they ran",
    "handoff_s": "from a computation's end to the rank that waited on it running again",
    "handoffs": "waits on another stage's computation",
}
"""The keys of :attr:`IterationRecord.overheads`, and what each sums over the ranks."""


@dataclass(frozen=True)
class JobResult:
    """What a run did: its records and the energy counters before and after."""

    records: tuple[IterationRecord, ...]
    stopped: bool
    """Ended before ``steps`` iterations (by :meth:`EmulatedJob.stop` or an error), or ran
    without a number of steps."""
    wall_s: float
    """Monotonic time from the start of the run until every rank had exited."""
    start_energy_j: float | None
    """Sum of the GPUs' energy counters when the run started (``None``: unreadable)."""
    energy_j: float | None
    """Sum of the GPUs' energy counters when the run ended, every GPU idle (``None``:
    unreadable)."""
    node_energy_j: dict[str, float] = field(default_factory=dict)
    """Per node, the energy counters when the run ended (empty: unreadable)."""

    @property
    def iterations(self) -> int:
        return len(self.records)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: iterations, stopped, wall_s, energy (end, used), mean replica times."""
        num_replicas = len(self.records[0].replica_times_s) if self.records else 0
        return {
            "iterations": self.iterations,
            "stopped": self.stopped,
            "wall_s": self.wall_s,
            "energy_j": self.energy_j,
            "energy_used_j": (
                None
                if self.energy_j is None or self.start_energy_j is None
                else self.energy_j - self.start_energy_j
            ),
            "node_energy_j": dict(self.node_energy_j),
            "mean_replica_times_s": [
                sum(r.replica_times_s[d] for r in self.records) / len(self.records)
                for d in range(num_replicas)
            ],
        }


class EmulatedJobError(RuntimeError):
    """A rank, or the iteration bookkeeping, failed; every rank was stopped.

    Attributes:
        rank: The failing rank, ``None`` when it was not a rank: the iteration bookkeeping
            (e.g. the ``on_iteration`` callback raised), or reading the GPUs' state before or
            after the ranks ran.
        result: What the run did until then.
    """

    def __init__(self, message: str, rank: int | None, result: JobResult) -> None:
        super().__init__(message)
        self.rank = rank
        self.result = result
