"""Pipeline-parallel training with DeepSpeed's PipelineEngine, attached to Perseus.

Runs ``dp x pp`` processes on this machine (gloo, CPU; ``DS_ACCELERATOR=cpu``): a
``PipelineModule`` of a tiny MLP in ``pp`` stages, ``dp`` data-parallel replicas, trained with
``engine.train_batch()`` (DeepSpeed's ``TrainSchedule``, 1F1B). The one Perseus line is
``attach(engine)``; the node agent's socket is ``$PERSEUS_AGENT_SOCKET`` (without an agent the
hooks are no-ops, after one warning)::

    DS_ACCELERATOR=cpu python examples/deepspeed_pipeline.py --dp 2 --pp 2 --steps 5

On GPUs the same script runs with DeepSpeed's launcher instead of the processes it starts
itself (``deepspeed --num_gpus 4 examples/deepspeed_pipeline.py ...`` is not wired here: the
worker is what to copy). DeepSpeed's rank layout puts replica ``d`` of stage ``s`` on global
rank ``s * dp + d``.

``--slow-replica R --slow-forward-s S`` makes replica ``R`` a straggler (each of its forwards
sleeps ``S`` s more); ``--eval`` runs one ``eval_batch()`` after training (the adapter reports
nothing for it); ``--schedule dualpipev`` runs ``DualPipeVEngine`` (each rank two stages), an
order the planner does not follow: step hooks only, with one warning.

Without GPUs, ``--emulated-gpus STATE_FILE --emulated-profile CSV`` runs each rank's stage on
emulated GPU ``rank`` of a node agent's emulated backend: each forward and backward is padded
to the profile's time at the clock the agent locked (``perseus_emulation.instruction_padding``).

DeepSpeed compiles a C++ op the first time it starts on the CPU (~90 s; cached under
``$TORCH_EXTENSIONS_DIR``). The tests run this file
(``tests/integration/test_deepspeed_adapter.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import deepspeed
import torch
import torch.multiprocessing as mp
from deepspeed.pipe import PipelineModule
from torch import nn

from perseus_client.deepspeed import attach

WIDTH = 16
BATCH = 8


class SlowForward(nn.Module):
    """Sleeps before its forward: a straggler's slower computation."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds > 0:
            time.sleep(self.seconds)
        return x


def layers(pp: int, slow_s: float, stages_per_rank: int) -> list[nn.Module]:
    """One layer per pipeline stage (``partition_method="uniform"``)."""
    torch.manual_seed(0)  # every replica starts from the same weights
    return [
        nn.Sequential(SlowForward(slow_s), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        for _ in range(pp * stages_per_rank)
    ]


def batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield (
            torch.randn(BATCH, WIDTH, generator=generator),
            torch.randn(BATCH, WIDTH, generator=generator),
        )


def worker(rank: int, args: argparse.Namespace, store_file: str) -> None:
    world = args.dp * args.pp
    # Every rank is on this machine: the ranks meet through a file (a tcp:// rendezvous's
    # store listens on every address) and gloo binds to the loopback interface.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo"
    )
    deepspeed.init_distributed(
        dist_backend="gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world,
        auto_mpi_discovery=False,
        verbose=False,
    )
    stage, dp_rank = divmod(rank, args.dp)  # DeepSpeed's layout: axes (pipe, data)
    slow_s = args.slow_forward_s if dp_rank == args.slow_replica else 0.0
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": args.microbatches,
        "train_batch_size": BATCH * args.microbatches * args.dp,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.schedule == "dualpipev":
        from deepspeed.pipe import DualPipeVModule

        module: PipelineModule = DualPipeVModule(
            layers=layers(args.pp, slow_s, 2),
            num_stages=args.pp,
            loss_fn=nn.MSELoss(),
            partition_method="uniform",
        )
    else:
        module = PipelineModule(
            layers=layers(args.pp, slow_s, 1),
            num_stages=args.pp,
            loss_fn=nn.MSELoss(),
            partition_method="uniform",
        )
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=module.parameters(), config=config
    )
    if args.emulated_gpus is not None:
        from perseus_agent.gpu.emulated import EmulatedBackend
        from perseus_emulation.instruction_padding import pad_deepspeed_engine

        gpus = EmulatedBackend.from_csv(
            world,
            args.emulated_profile,
            blocking_power_w=args.blocking_power,
            node_name=args.node_name,
            state_file=Path(args.emulated_gpus),
        )
        pad_deepspeed_engine(engine, gpus, rank, profile_stage=stage, time_scale=args.time_scale)
    if not args.no_perseus:
        attach(engine)  # <- the Perseus line

    data = batches(1000 + dp_rank)
    for step in range(args.steps):
        begin_ns = time.monotonic_ns()
        engine.train_batch(data)
        end_ns = time.monotonic_ns()
        if args.step_times is not None:
            record = {"rank": rank, "dp_rank": dp_rank, "pp_rank": stage, "step": step,
                      "begin_ns": begin_ns, "end_ns": end_ns}  # fmt: skip
            with Path(args.step_times).open("a") as f:
                f.write(json.dumps(record) + "\n")
    if args.eval:
        engine.eval_batch(batches(7))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--schedule", choices=["1f1b", "dualpipev"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--slow-replica", type=int, default=-1, help="straggler replica")
    parser.add_argument("--slow-forward-s", type=float, default=0.0)
    parser.add_argument("--step-times", default=None, help="append train_batch() times here")
    parser.add_argument("--eval", action="store_true", help="one eval_batch() after training")
    parser.add_argument("--no-perseus", action="store_true", help="do not attach (compare)")
    emulation = parser.add_argument_group("emulated GPUs (tests and demos without GPUs)")
    emulation.add_argument("--emulated-gpus", default=None, help="the agent's GPU state file")
    emulation.add_argument("--emulated-profile", default=None, help="profile CSV they follow")
    emulation.add_argument("--blocking-power", type=float, default=83.64, help="watts")
    emulation.add_argument("--node-name", default="emulated")
    emulation.add_argument("--time-scale", type=float, default=1.0, help="x profiled times")
    args = parser.parse_args(argv)
    if (args.emulated_gpus is None) != (args.emulated_profile is None):
        parser.error("--emulated-profile goes with --emulated-gpus")
    with tempfile.TemporaryDirectory(prefix="deepspeed-pipeline-") as directory:
        store_file = str(Path(directory, "store"))
        mp.spawn(worker, args=(args, store_file), nprocs=args.dp * args.pp, join=True)


if __name__ == "__main__":
    main()
