"""Pipeline-parallel training with torch.distributed.pipelining, attached to Perseus.

Runs ``dp x pp`` processes on this machine (gloo, CPU): ``dp`` data-parallel replicas of a
``pp``-stage pipeline of a tiny MLP, each stage a ``DistributedDataParallel`` module over
its replicas. The one Perseus line is ``attach(schedule)``; the node agent's socket is
``$PERSEUS_AGENT_SOCKET`` (without an agent the hooks are no-ops, after one warning)::

    python examples/torch_pipeline.py --dp 2 --pp 2 --schedule 1f1b --steps 5

``--schedule interleaved-1f1b`` runs two stages per process (``ScheduleInterleaved1F1B``),
``zb-h1`` one with the backward split (``ScheduleInterleavedZeroBubble``), ``looped-bfs`` a
schedule the planner does not follow (step hooks only).

While it runs, rank 0 prints each step's time. With ``--agent-metrics URL`` (the node agent's
``/metrics``, e.g. ``http://127.0.0.1:7461/metrics``) it also reads the energy counters of the
ranks' GPUs (GPU ``r`` for rank ``r``: one machine) and, at the end, prints the energy per
iteration; with ``--baseline-steps K`` as well, the first ``K`` steps run without the hooks,
so under an ``Instruction`` plan (which locks nothing until a process calls in) at the GPUs'
own clocks, all at max, and the end compares the two: the measured savings against all-max::

    python examples/torch_pipeline.py --steps 8 --baseline-steps 4 \
        --agent-metrics http://127.0.0.1:7461/metrics

``--slow-replica R --slow-forward-s S`` makes replica ``R`` a straggler (each of its
forwards sleeps ``S`` seconds more); ``--step-times FILE`` appends, per rank and step, when
``schedule.step()`` was called and when it returned (JSON lines), which is what a training
loop timing ``step()`` itself would see. ``--eval`` runs one ``schedule.eval()`` after
training (the adapter reports nothing for it).

Without GPUs, ``--emulated-gpus STATE_FILE --emulated-profile CSV`` runs each rank's stage
on emulated GPU ``rank`` of a node agent's emulated backend (``--gpu-backend=emulated``):
every computation is padded to the profile's time at the clock the agent locked, and the
emulated GPU counts its energy (``perseus_emulation.torch_stage``). With one
``--node NAME,SOCKET,STATE_FILE`` per replica instead, replica ``k`` runs on the k-th node:
its agent's socket, its GPU ``stage``.

The tests run this file (``tests/integration/test_torch_adapter.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)

from perseus_client.torch import attach

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved-1f1b": ScheduleInterleaved1F1B,  # 2 stages per process
    "zb-h1": ScheduleInterleavedZeroBubble,  # one stage per process: the planner's ZB-H1
    "looped-bfs": ScheduleLoopedBFS,  # 2 stages per process; not plannable: step hooks only
}
MULTI_STAGE = ("interleaved-1f1b", "zb-h1", "looped-bfs")
"""Schedules built from the list of the process's stages."""
WIDTH = 16
BATCH = 8


class SlowForward(nn.Module):
    """Sleeps before its module's forward: a straggler's slower computation."""

    def __init__(self, module: nn.Module, seconds: float) -> None:
        super().__init__()
        self.module, self.seconds = module, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        out: torch.Tensor = self.module(x)
        return out


def stage_module(stage_index: int, slow_s: float) -> nn.Module:
    torch.manual_seed(stage_index)  # replicas of a stage start from the same weights
    module: nn.Module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    return SlowForward(module, slow_s) if slow_s > 0 else module


def worker(rank: int, args: argparse.Namespace, store_file: str) -> None:
    # Every rank is on this machine, so nothing listens beyond it: the ranks meet through a
    # file (a tcp:// rendezvous's TCPStore listens on every address, whatever its host) and
    # gloo's connections bind to the loopback interface rather than the hostname's address.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.dp * args.pp),
        GLOO_SOCKET_IFNAME="lo",
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=args.dp * args.pp
    )
    dp_rank, pp_rank = divmod(rank, args.pp)
    # Every rank creates every group, in the same order (torch.distributed's rule).
    pp_groups = [dist.new_group([d * args.pp + p for p in range(args.pp)]) for d in range(args.dp)]
    dp_groups = [dist.new_group([d * args.pp + p for d in range(args.dp)]) for p in range(args.pp)]
    virtual = 2 if args.schedule in ("interleaved-1f1b", "looped-bfs") else 1
    num_stages = args.pp * virtual
    slow_s = args.slow_forward_s if dp_rank == args.slow_replica else 0.0
    stages = []
    for v in range(virtual):
        index = v * args.pp + pp_rank
        module = stage_module(index, slow_s)
        if args.dp > 1:
            module = nn.parallel.DistributedDataParallel(module, process_group=dp_groups[pp_rank])
            if args.ddp_comm_hook:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                module.register_comm_hook(dp_groups[pp_rank], default_hooks.allreduce_hook)
        stages.append(
            PipelineStage(module, index, num_stages, torch.device("cpu"), group=pp_groups[dp_rank])
        )
    params = [p for s in stages for p in s.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    schedule: Any
    if args.schedule in MULTI_STAGE:
        schedule = SCHEDULES[args.schedule](
            stages, n_microbatches=args.microbatches, loss_fn=loss_fn
        )
    else:
        schedule = SCHEDULES[args.schedule](stages[0], args.microbatches, loss_fn=loss_fn)

    if args.node:  # replica dp_rank runs on node dp_rank: its agent, its GPUs
        name, socket_path, state = args.node[dp_rank].split(",")
        os.environ["PERSEUS_AGENT_SOCKET"] = socket_path
        emulate(args, stages, state, name, args.pp, pp_rank)
    elif args.emulated_gpus is not None:
        emulate(args, stages, args.emulated_gpus, args.node_name, args.dp * args.pp, rank)
    baseline_steps = 0 if args.no_perseus else args.baseline_steps
    if not args.no_perseus and baseline_steps == 0:
        attach(schedule, **client_options(args))  # <- the Perseus line (options: optional)

    generator = torch.Generator().manual_seed(1000 + dp_rank)
    first = pp_rank == 0
    last = pp_rank == args.pp - 1
    # Measuring synchronizes the ranks at phase boundaries: only when asked, so that a plain
    # run (a straggler's, say) keeps its own timing.
    measuring = args.agent_metrics is not None or baseline_steps > 0
    meter = EnergyMeter(args.agent_metrics, args.dp * args.pp) if rank == 0 else None
    phases: list[Phase] = []
    step_times_s: list[float] = []
    for step in range(args.steps):
        if step == baseline_steps and baseline_steps > 0:
            attach(schedule, **client_options(args))  # after the all-max steps
        if measuring and step in (0, baseline_steps, baseline_steps + 1):
            # Phase boundaries: all-max steps, the first hooked step (the agent finds its place
            # in the schedule), the measured ones. A barrier so that every rank is there.
            dist.barrier()
            if meter is not None:
                phases.append(meter.mark(step))
        x = torch.randn(BATCH, WIDTH, generator=generator)
        y = torch.randn(BATCH, WIDTH, generator=generator)
        optimizer.zero_grad()
        inputs = (x,) if first else ()
        begin_ns = time.monotonic_ns()
        schedule.step(*inputs, target=y if last else None)
        end_ns = time.monotonic_ns()
        optimizer.step()
        if rank == 0:
            step_times_s.append((end_ns - begin_ns) / 1e9)
            hooked = " (all max)" if step < baseline_steps else ""
            print(f"step {step + 1}/{args.steps}: {step_times_s[-1]:.3f} s{hooked}", flush=True)
        if args.step_times is not None:
            record = {"rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank, "step": step,
                      "begin_ns": begin_ns, "end_ns": end_ns}  # fmt: skip
            with Path(args.step_times).open("a") as f:
                f.write(json.dumps(record) + "\n")
    if measuring:
        dist.barrier()
        if meter is not None:
            phases.append(meter.mark(args.steps))
            summary = energy_summary(phases, baseline_steps, meter.enabled, args.blocking_power)
            print(summary, flush=True)
    elif rank == 0 and step_times_s:
        mean_s = sum(step_times_s) / len(step_times_s)
        print(f"mean step time {mean_s:.3f} s over {len(step_times_s)} steps", flush=True)
    if args.weights_out is not None:
        weights = {k: v.tolist() for k, v in stages[0].submod.state_dict().items()}
        Path(args.weights_out, f"rank{rank}.json").write_text(json.dumps(weights))
    if args.eval:
        x = torch.randn(BATCH, WIDTH, generator=generator)
        y = torch.randn(BATCH, WIDTH, generator=generator)
        schedule.eval(*((x,) if first else ()), target=y if last else None)
    dist.barrier()
    dist.destroy_process_group()


@dataclass(frozen=True)
class Phase:
    """A mark at the start of ``step``: the time and the GPUs' energy counters then."""

    step: int
    time_s: float
    energy_j: float | None
    gpus: int


class EnergyMeter:
    """The energy counters of GPUs ``0..num_gpus-1`` from the node agent's ``/metrics``."""

    _SAMPLE = re.compile(r"^perseus_gpu_energy_joules_total\{([^}]*)\} (\S+)$", re.MULTILINE)

    def __init__(self, url: str | None, num_gpus: int) -> None:
        # One GPU per rank; energy_summary stretches all max clock over this many.
        self.url = url
        self.num_gpus = num_gpus
        self.enabled = url is not None

    def mark(self, step: int) -> Phase:
        return Phase(step, time.monotonic(), self.read_j(), self.num_gpus)

    def read_j(self) -> float | None:
        """Joules of the ranks' GPUs together; None without an agent (or when it is gone)."""
        if self.url is None:
            return None
        try:
            with urllib.request.urlopen(self.url, timeout=5) as response:
                text = response.read().decode()
        except OSError as exc:
            print(f"cannot read the agent's metrics at {self.url}: {exc}", file=sys.stderr)
            return None
        total, seen = 0.0, set()
        for labels, value in self._SAMPLE.findall(text):
            gpu = re.search(r'gpu="(\d+)"', labels)
            if gpu is not None and int(gpu.group(1)) < self.num_gpus:
                seen.add(int(gpu.group(1)))
                total += float(value)
        return total if len(seen) == self.num_gpus else None


def energy_summary(
    phases: list[Phase], baseline_steps: int, metered: bool, blocking_power_w: float
) -> str:
    """Time and energy per iteration of the hooked steps, beside the all-max ones if any.

    ``phases``: marks at step 0, at the first hooked step (with baseline steps), at the one
    after it, and at the end. The first hooked step is left out: the agent finds its place in
    the schedule during it. Savings are also given at equal iteration time, the planner's
    comparison: the shorter iteration stretched to the longer one's length with every GPU
    waiting at ``blocking_power_w``, so that the host's own delays (a busy machine's
    scheduling) weigh on neither side.
    """
    end, start = phases[-1], phases[-2]

    def per_step(a: Phase, b: Phase) -> tuple[float, float | None]:
        steps = b.step - a.step
        energy = None if a.energy_j is None or b.energy_j is None else b.energy_j - a.energy_j
        return (b.time_s - a.time_s) / steps, None if energy is None else energy / steps

    if end.step <= start.step:
        return "too few steps to measure (--steps must exceed --baseline-steps + 1)"
    time_s, energy_j = per_step(start, end)
    if not metered:
        return f"mean step time {time_s:.3f} s (pass --agent-metrics for energy)"
    if energy_j is None:
        return f"mean step time {time_s:.3f} s; energy unknown (agent metrics unreadable)"
    lines = [f"Perseus        {time_s:.3f} s  {energy_j:9.2f} J per iteration"]
    if baseline_steps > 0:
        base_s, base_j = per_step(phases[0], phases[1])
        if base_j is not None:
            # The shorter of the two iterations waits out the longer one's time.
            wait_w, equal_s = blocking_power_w * phases[0].gpus, max(time_s, base_s)
            perseus_j = energy_j + wait_w * (equal_s - time_s)
            max_j = base_j + wait_w * (equal_s - base_s)
            lines += [
                f"all max clock  {base_s:.3f} s  {base_j:9.2f} J per iteration",
                f"saved          {100 * (1 - energy_j / base_j):.1f} % energy per iteration, "
                f"time {100 * (time_s / base_s - 1):+.1f} %",
                f"at equal time  {100 * (1 - perseus_j / max_j):.1f} % saved, both iterations "
                f"{equal_s:.3f} s ({phases[0].gpus} GPUs waiting at {blocking_power_w:g} W when "
                "done early: the planner's comparison)",
            ]
    return "\n".join(lines)


def emulate(
    args: argparse.Namespace,
    stages: list[PipelineStage],
    state_file: str,
    node_name: str,
    num_gpus: int,
    gpu_index: int,
) -> None:
    from perseus_agent.gpu.emulated import EmulatedBackend
    from perseus_emulation.torch_stage import emulate_stage

    gpus = EmulatedBackend.from_csv(
        num_gpus,
        args.emulated_profile,
        blocking_power_w=args.blocking_power,
        node_name=node_name,
        state_file=Path(state_file),
    )
    for stage in stages:
        emulate_stage(stage, gpus, gpu_index, time_scale=args.time_scale)


def client_options(args: argparse.Namespace) -> dict[str, float]:
    options = {}
    if args.client_timeout_s is not None:
        options["reply_timeout_s"] = args.client_timeout_s
    if args.client_retry_s is not None:
        options["retry_interval_s"] = args.client_retry_s
    return options


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--slow-replica", type=int, default=-1, help="straggler replica")
    parser.add_argument("--slow-forward-s", type=float, default=0.0)
    parser.add_argument("--step-times", default=None, help="append step() times here")
    parser.add_argument("--eval", action="store_true", help="one eval() after training")
    parser.add_argument("--no-perseus", action="store_true", help="do not attach (compare)")
    parser.add_argument(
        "--agent-metrics",
        default=None,
        metavar="URL",
        help="the node agent's /metrics: report the energy per iteration at the end",
    )
    parser.add_argument(
        "--baseline-steps",
        type=int,
        default=0,
        metavar="K",
        help="run the first K steps without the hooks (all max clock) and compare at the end",
    )
    parser.add_argument(
        "--ddp-comm-hook", action="store_true", help="DDP with its all-reduce as a comm hook"
    )
    parser.add_argument("--client-timeout-s", type=float, default=None, help="hook round trip")
    parser.add_argument("--client-retry-s", type=float, default=None, help="reconnect interval")
    parser.add_argument("--weights-out", default=None, help="write rankN.json weights here")
    emulation = parser.add_argument_group("emulated GPUs (tests and demos without GPUs)")
    emulation.add_argument("--emulated-gpus", default=None, help="the agent's GPU state file")
    emulation.add_argument("--emulated-profile", default=None, help="profile CSV they follow")
    emulation.add_argument(
        "--blocking-power",
        type=float,
        default=83.64,
        help="watts of a waiting GPU: the emulated GPUs', and the savings at equal time",
    )
    emulation.add_argument("--node-name", default="emulated")
    emulation.add_argument("--time-scale", type=float, default=1.0, help="x profiled times")
    emulation.add_argument(
        "--node",
        action="append",
        default=[],
        help="NAME,SOCKET,STATE_FILE of the node running replica k (k-th --node; GPU = stage)",
    )
    args = parser.parse_args(argv)
    if (args.emulated_gpus is None and not args.node) != (args.emulated_profile is None):
        parser.error("--emulated-profile goes with --emulated-gpus or --node")
    if args.node and len(args.node) != args.dp:
        parser.error(f"--node: one per replica, {args.dp} in all; got {len(args.node)}")
    if args.baseline_steps and args.steps < args.baseline_steps + 2:
        parser.error("--steps must leave two hooked steps after --baseline-steps or more")
    with tempfile.TemporaryDirectory(prefix="torch-pipeline-") as directory:
        store_file = str(Path(directory, "store"))  # created by the ranks' FileStore
        mp.spawn(worker, args=(args, store_file), nprocs=args.dp * args.pp, join=True)


if __name__ == "__main__":
    main()
