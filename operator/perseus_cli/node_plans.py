"""Node plans for standalone agents: a pipeline plan spread over the GPUs that run its ranks.

A standalone node agent (``perseus-node-agent --standalone``, no Kubernetes) applies one
``NodePlan`` per node, the document the operator writes on a cluster. Here it is built from
``perseus plan``'s pipeline plan and a rank-to-GPU mapping, given either as

- ``--gpus 0,1,2,3`` (with ``--node``): this node's GPUs, by index or UUID, one per rank in
  rank order, or
- ``--ranks FILE``: a CSV with the header ``rank,node,gpu`` and optionally ``stage``,
  ``dp_rank`` and ``tp_rank`` columns, one row per training process (several nodes).

Without ``stage`` and ``dp_rank``, rank ``r`` of a ``P``-stage pipeline is stage ``r % P`` of
data-parallel replica ``r // P``: the order ``torch.distributed`` launchers and the bundled
torch example give ranks (``rank = dp_rank * P + stage``).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_cli import CliError

if TYPE_CHECKING:
    from perseus_api import PipelinePlan
    from perseus_api.node_plan import NodePlan, ProfilingSpec

__all__ = [
    "DEFAULT_JOB",
    "Placement",
    "RankGpu",
    "add_node_plan_arguments",
    "build_node_plans",
    "node_plan_file_name",
    "parse_gpu_list",
    "place_ranks",
    "rank_gpus",
    "read_rank_file",
    "standalone_hint",
]

DEFAULT_JOB = "training"
PLAN_KEY = "main"
"""The pipeline plan's key in each node plan (one pipeline plan per job here)."""
_REQUIRED_COLUMNS = ("rank", "node", "gpu")
_OPTIONAL_COLUMNS = ("stage", "dp_rank", "tp_rank")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
_MAX_RANKS = 100_000
"""More rows than any job has ranks: a file this long is the wrong file."""


@dataclass(frozen=True)
class RankGpu:
    """One training process: its global rank, its node and GPU (index or UUID), its place."""

    rank: int
    node: str
    gpu: str
    stage: int | None = None
    dp_rank: int | None = None
    tp_rank: int = 0


def parse_gpu_list(text: str, node: str) -> list[RankGpu]:
    """``--gpus 0,1,2,3`` on ``node``: rank ``r`` runs on the ``r``-th GPU listed."""
    gpus = [g.strip() for g in text.split(",")]
    if not gpus or any(not g for g in gpus):
        raise CliError(f"--gpus: a comma-separated list of GPU indices or UUIDs, got {text!r}")
    return [RankGpu(rank, node, gpu) for rank, gpu in enumerate(gpus)]


def read_rank_file(path: Path) -> list[RankGpu]:
    """The rows of a ``--ranks`` CSV (see the module docstring)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CliError(f"--ranks {path}: {exc.strerror or exc}") from None
    reader = csv.DictReader(text.splitlines())
    columns = [c.strip() for c in reader.fieldnames or []]
    missing = [c for c in _REQUIRED_COLUMNS if c not in columns]
    unknown = [c for c in columns if c not in (*_REQUIRED_COLUMNS, *_OPTIONAL_COLUMNS)]
    if missing or unknown:
        raise CliError(
            f"--ranks {path}: the header must name rank,node,gpu (and optionally "
            f"{','.join(_OPTIONAL_COLUMNS)}); got {','.join(columns) or 'nothing'}"
        )
    rows: list[RankGpu] = []
    for line, raw in enumerate(reader, start=2):
        if len(rows) >= _MAX_RANKS:
            raise CliError(f"--ranks {path}: more than {_MAX_RANKS:,} rows")
        row = {k.strip(): (v or "").strip() for k, v in raw.items() if k is not None}
        where = f"--ranks {path} line {line}"
        if not row["node"] or not row["gpu"]:
            raise CliError(f"{where}: node and gpu must not be empty")
        rows.append(
            RankGpu(
                rank=_non_negative(row["rank"], "rank", where),
                node=row["node"],
                gpu=row["gpu"],
                stage=_optional(row.get("stage"), "stage", where),
                dp_rank=_optional(row.get("dp_rank"), "dp_rank", where),
                tp_rank=_optional(row.get("tp_rank"), "tp_rank", where) or 0,
            )
        )
    if not rows:
        raise CliError(f"--ranks {path}: no rows after the header")
    return rows


def _non_negative(text: str, column: str, where: str) -> int:
    if not text.isdigit():
        raise CliError(f"{where}: {column} must be an integer >= 0, got {text!r}")
    return int(text)


def _optional(text: str | None, column: str, where: str) -> int | None:
    return None if not text else _non_negative(text, column, where)


@dataclass(frozen=True)
class Placement:
    """A rank's place in the job: its GPU and its stage and replica."""

    rank: RankGpu
    stage: int
    dp_rank: int


def place_ranks(ranks: Sequence[RankGpu], num_stages: int) -> list[Placement]:
    """Each rank's stage and replica, checked (before a solve, so that a bad mapping costs
    nothing).

    Raises:
        CliError: A rank listed twice, a GPU given to two ranks, a stage outside the pipeline,
            two ranks on one place, or a data-parallel replica whose stages are not all there.
    """
    ranks_seen: set[int] = set()
    gpus_seen: dict[tuple[str, str], int] = {}
    placed: dict[tuple[int, int, int], int] = {}
    placements = []
    for r in ranks:
        if r.rank in ranks_seen:
            raise CliError(f"rank {r.rank} is given twice")
        ranks_seen.add(r.rank)
        if (r.node, r.gpu) in gpus_seen:
            raise CliError(
                f"ranks {gpus_seen[r.node, r.gpu]} and {r.rank} are both on GPU {r.gpu} of node "
                f"{r.node}: one GPU runs one rank"
            )
        gpus_seen[r.node, r.gpu] = r.rank
        stage = r.rank % num_stages if r.stage is None else r.stage
        dp_rank = r.rank // num_stages if r.dp_rank is None else r.dp_rank
        if stage >= num_stages:
            raise CliError(f"rank {r.rank}: stage {stage}, but the plan has {num_stages} stages")
        if (dp_rank, stage, r.tp_rank) in placed:
            raise CliError(
                f"ranks {placed[dp_rank, stage, r.tp_rank]} and {r.rank} both run stage {stage} "
                f"of replica {dp_rank} (tensor-parallel rank {r.tp_rank})"
            )
        placed[dp_rank, stage, r.tp_rank] = r.rank
        placements.append(Placement(r, stage, dp_rank))
    for dp in sorted({dp for dp, _, _ in placed}):
        have = {s for d, s, _ in placed if d == dp}
        if len(have) != num_stages:
            missing = ", ".join(str(s) for s in range(num_stages) if s not in have)
            raise CliError(
                f"replica {dp} has no rank for stage(s) {missing}: list {num_stages} ranks per "
                f"replica ({len(ranks)} given for {num_stages} stages)"
            )
    return placements


def build_node_plans(
    plan: PipelinePlan,
    ranks: Sequence[RankGpu],
    job: str,
    namespace: str = "default",
    profiling: ProfilingSpec | None = None,
) -> dict[str, NodePlan]:
    """One node plan per node that runs a rank of ``plan``, by node name (with ``profiling``:
    plans that measure a profile instead).

    Raises:
        CliError: The mapping does not fit the plan (see :func:`place_ranks`).
    """
    from pydantic import ValidationError

    from perseus_api.node_plan import GpuAssignment, NodePlan

    by_node: dict[str, list[GpuAssignment]] = {}
    for p in place_ranks(ranks, plan.num_stages):
        r = p.rank
        gpu = {"gpu_index": int(r.gpu)} if r.gpu.isdigit() else {"gpu_uuid": r.gpu}
        by_node.setdefault(r.node, []).append(
            GpuAssignment(
                **gpu,
                plan=PLAN_KEY,
                stage=p.stage,
                dp_rank=p.dp_rank,
                tp_rank=r.tp_rank,
                rank=r.rank,
            )
        )
    plans: dict[str, NodePlan] = {}
    for node, assignments in by_node.items():
        try:
            plans[node] = NodePlan(
                node=node,
                namespace=namespace,
                job=job,
                revision=1,
                granularity=plan.granularity,
                plans={PLAN_KEY: plan},
                assignments=assignments,
                profiling=profiling,
            )
        except ValidationError as exc:
            reason = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            raise CliError(f"node {node}: {reason}") from None
    return plans


def node_plan_file_name(node: str) -> str:
    """``node-plan-NODE.json``, the node's name made safe for a file name."""
    return f"node-plan-{_SAFE_NAME.sub('_', node)}.json"


def add_node_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpus``/``--node``, ``--ranks`` and ``--job``: node plans for standalone agents."""
    group = parser.add_argument_group(
        "node plans for standalone agents (perseus-node-agent --standalone; one of)",
        "rank r of a P-stage pipeline is stage r %% P of replica r // P unless --ranks says",
    )
    mapping = group.add_mutually_exclusive_group()
    mapping.add_argument(
        "--gpus",
        metavar="I,J,...",
        help="this node's GPUs (indices or UUIDs), one per training rank in rank order; "
        "writes node-plan-NODE.json",
    )
    mapping.add_argument(
        "--ranks",
        type=Path,
        metavar="FILE.csv",
        help="one row per rank: rank,node,gpu[,stage,dp_rank,tp_rank]; writes "
        "node-plan-NODE.json per node",
    )
    group.add_argument(
        "--node",
        metavar="NAME",
        help="node of --gpus, as the agent's --node-name (default: $NODE_NAME, else the host name)",
    )
    group.add_argument(
        "--job",
        default=DEFAULT_JOB,
        metavar="NAME",
        help="job name in the node plans and the agent's metrics (default: %(default)s)",
    )


def rank_gpus(args: argparse.Namespace) -> list[RankGpu] | None:
    """The rank-to-GPU mapping of ``--gpus``/``--node`` or ``--ranks``; None without one."""
    if args.node is not None and args.gpus is None:
        raise CliError("--node goes with --gpus (a --ranks file names each rank's node)")
    if args.ranks is not None:
        return read_rank_file(args.ranks)
    if args.gpus is not None:
        node = args.node or os.environ.get("NODE_NAME") or socket.gethostname()
        return parse_gpu_list(args.gpus, node)
    return None


def standalone_hint(out_dir: Path, nodes: list[str]) -> str:
    """How to run the agent on the node plans just written."""
    node = nodes[0]
    path = out_dir / node_plan_file_name(node)
    more = f" (and likewise on {', '.join(nodes[1:])})" if len(nodes) > 1 else ""
    return (
        f"Standalone     on {node}{more}: perseus-node-agent --standalone --node-name {node} "
        f"--plan-file {path}"
    )
