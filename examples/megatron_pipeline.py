"""Pipeline-parallel training with Megatron-Core's schedules, attached to Perseus.

Runs ``dp x pp`` processes on this machine: a tiny model of ``pp * V`` linear layers, each
rank running ``V`` model chunks (``--virtual 2``: Megatron's interleaved 1F1B; 1: 1F1B),
trained with the function ``get_forward_backward_func()`` returns. The one Perseus line is
``attach(config)``; the node agent's socket is ``$PERSEUS_AGENT_SOCKET``::

    torchrun --nproc-per-node 4 examples/megatron_pipeline.py --pp 2 --virtual 2 --steps 5

Megatron-Core's schedules need CUDA (they allocate on ``"cuda"``): this script is written
for GPUs (NCCL). The tests run its :func:`train` on the CPU through a test-side shim that maps
CUDA devices to the CPU (``tests/support/megatron_cpu_worker.py``, which also starts the
processes); nothing here knows about it.

``--slow-replica R --slow-forward-s S`` makes replica ``R`` a straggler; ``--eval`` runs one
``forward_only=True`` call after training (the adapter reports nothing for it);
``--microbatch-group-size G`` sets Megatron's ``microbatch_group_size_per_vp_stage`` (default
the pipeline size); another value runs an interleaved order the planner does not follow
(step hooks only, one warning). ``--emulated-gpus STATE --emulated-profile CSV`` pads
each computation to an emulated GPU's profile (``perseus_emulation.instruction_padding``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from perseus_client.megatron import attach

HIDDEN = 16
SEQ = 4
MICRO_BATCH = 2


class Chunk(MegatronModule):
    """One model chunk: a linear layer; the first chunk of the first stage reads the batch,
    the others the activation Megatron hands over (``set_input_tensor``)."""

    def __init__(self, config: TransformerConfig, first: bool, slow_s: float) -> None:
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.first, self.slow_s = first, slow_s
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: Any) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow_s > 0:
            time.sleep(self.slow_s)
        h = x if self.first else self.input_tensor
        assert h is not None
        out: torch.Tensor = torch.tanh(self.linear(h))
        return out


def batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield (
            torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=generator),
            torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=generator),
        )


def loss_func(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = nn.functional.mse_loss(output, target)
    return loss, {"loss": loss.detach()}


def forward_step(data: Iterator[tuple[torch.Tensor, torch.Tensor]], model: Chunk) -> Any:
    x, y = next(data)
    return model(x), partial(loss_func, y)


def train(args: argparse.Namespace, rank: int, device: torch.device) -> None:
    """One rank's training; ``torch.distributed`` is initialized."""
    virtual = args.virtual if args.virtual > 1 else None
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=virtual
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    config = TransformerConfig(
        num_layers=args.pp * args.virtual,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=virtual,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size,
    )
    slow_s = args.slow_forward_s if dp_rank == args.slow_replica else 0.0
    torch.manual_seed(parallel_state.get_pipeline_model_parallel_rank())
    model = [
        Chunk(
            config,
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            slow_s,
        ).to(device)
        for v in range(args.virtual)
    ]
    if args.emulated_gpus is not None:
        from perseus_agent.gpu.emulated import EmulatedBackend
        from perseus_emulation.instruction_padding import PaddedTimers

        gpus = EmulatedBackend.from_csv(
            dist.get_world_size(),
            args.emulated_profile,
            blocking_power_w=args.blocking_power,
            node_name=args.node_name,
            state_file=Path(args.emulated_gpus),
        )
        stage = parallel_state.get_pipeline_model_parallel_rank()
        config.timers = PaddedTimers(
            config.timers, gpus, rank, profile_stage=stage, time_scale=args.time_scale
        )
    if not args.no_perseus:
        attach(config)  # <- the Perseus line
    optimizer = torch.optim.SGD([p for chunk in model for p in chunk.parameters()], lr=0.01)
    forward_backward = get_forward_backward_func()
    data = batches(1000 + dp_rank)
    grad_group = parallel_state.get_data_parallel_group()

    for step in range(args.steps):
        optimizer.zero_grad()
        begin_ns = time.monotonic_ns()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=[data] * args.virtual if virtual else data,
            model=model if virtual else model[0],
            num_microbatches=args.microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        # The data-parallel gradient sync (Megatron's DDP would do it in
        # finalize_model_grads_func; a plain all-reduce keeps the example small).
        if dist.get_world_size(grad_group) > 1:
            for p in optimizer.param_groups[0]["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=grad_group)
                    p.grad /= dist.get_world_size(grad_group)
        end_ns = time.monotonic_ns()
        optimizer.step()
        if args.step_times is not None:
            record = {"rank": rank, "dp_rank": dp_rank, "step": step,
                      "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                      "begin_ns": begin_ns, "end_ns": end_ns}  # fmt: skip
            with Path(args.step_times).open("a") as f:
                f.write(json.dumps(record) + "\n")
    if args.eval:
        with torch.no_grad():
            forward_backward(
                forward_step_func=forward_step,
                data_iterator=[batches(7)] * args.virtual if virtual else batches(7),
                model=model if virtual else model[0],
                num_microbatches=args.microbatches,
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
                forward_only=True,
            )
    dist.barrier()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks)")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per rank")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--slow-replica", type=int, default=-1, help="straggler replica")
    p.add_argument("--slow-forward-s", type=float, default=0.0)
    p.add_argument("--step-times", default=None, help="append step times (with the sync) here")
    p.add_argument("--eval", action="store_true", help="one forward_only call after training")
    p.add_argument("--microbatch-group-size", type=int, default=None, help="interleaved: G")
    p.add_argument("--no-perseus", action="store_true", help="do not attach (compare)")
    emulation = p.add_argument_group("emulated GPUs (tests and demos without GPUs)")
    emulation.add_argument("--emulated-gpus", default=None, help="the agent's GPU state file")
    emulation.add_argument("--emulated-profile", default=None, help="profile CSV they follow")
    emulation.add_argument("--blocking-power", type=float, default=83.64, help="watts")
    emulation.add_argument("--node-name", default="emulated")
    emulation.add_argument("--time-scale", type=float, default=1.0, help="x profiled times")
    return p


def main() -> None:
    """Under ``torchrun`` on GPUs: one process per GPU, NCCL."""
    args = parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    train(args, dist.get_rank(), torch.device("cuda", local_rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
