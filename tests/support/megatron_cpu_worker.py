"""Run ``examples/megatron_pipeline.py``'s training on the CPU, as real processes: the tests'
Megatron job.

Megatron-Core 0.16's pipeline schedules allocate on CUDA (``schedules.py``:
``torch.zeros(..., device="cuda")``; ``p2p_communication.py``: receive buffers on
``torch.cuda.current_device()``), so on a machine without GPUs they run only inside this
**test-side shim**: a ``torch.overrides.TorchFunctionMode`` that maps every CUDA device
argument to the CPU, and ``torch.cuda.current_device`` returning 0. Megatron's code and the
example stay unchanged; the shim lives here, in the test worker only.

What the shim hides, so untested until a run on GPUs: the adapter's device synchronization
before each hook (``torch.cuda.current_stream().synchronize()``; CUDA is not available here,
so the adapter installs none) and its GPU identity (the current device's UUID; here the
client claims no GPU and the agent goes by rank), as well as Megatron's own CUDA-only paths
(``batch_p2p_comm``, which synchronizes the device; NCCL).

Usage (what :mod:`support.framework_job` runs): the example's arguments, the processes started
here with ``torch.multiprocessing`` on gloo and a file rendezvous (nothing listens beyond the
loopback interface).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_pipeline  # type: ignore[import-not-found]


def _cpu(device: Any) -> Any:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # torch.cuda.current_device()'s index, passed as device=
    return device


class CudaToCpu(TorchFunctionMode):  # type: ignore[misc]
    """Every ``device=`` argument naming CUDA names the CPU instead."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if getattr(func, "__name__", "") in ("to", "cuda") and args:
            args = (args[0], *(_cpu(a) for a in args[1:]))
            if func.__name__ == "cuda":
                return args[0]
        return func(*args, **kwargs)


def worker(rank: int, argv: list[str], store_file: str) -> None:
    args = megatron_pipeline.parser().parse_args(argv)
    world = args.dp * args.pp
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo"
    )
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    torch.cuda.current_device = lambda: 0
    with CudaToCpu():
        megatron_pipeline.train(args, rank, torch.device("cpu"))
    dist.destroy_process_group()


def main() -> None:
    argv = sys.argv[1:]
    args = megatron_pipeline.parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megatron-pipeline-") as directory:
        store_file = str(Path(directory, "store"))
        mp.spawn(worker, args=(argv, store_file), nprocs=args.dp * args.pp, join=True)


if __name__ == "__main__":
    main()
