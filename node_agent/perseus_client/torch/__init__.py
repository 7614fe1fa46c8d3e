"""Perseus hooks for ``torch.distributed.pipelining``: one line, ``attach(schedule)``.

::

    from perseus_client.torch import attach

    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    attach(schedule)  # every schedule.step() is an iteration, every forward/backward a hook
    for batch in data:
        schedule.step(batch.x, target=batch.y)
        optimizer.step()

What it wraps, on the instances (the classes stay untouched, other schedules too):

* ``schedule.step``: the iteration (``on_step_begin``/``on_step_end``). ``schedule.eval()``
  and any call without a backward report nothing.
* each stage's ``forward_one_chunk``/``backward_one_chunk``/``backward_weight_one_chunk``:
  the computations (``on_instruction_begin(name, microbatch, chunk)`` and their ends), only
  while a ``step()`` runs (the stage's shape inference and ``eval()`` report nothing). The
  name is ``forward``, ``backward`` (a full backward), or, for the two halves a zero-bubble
  schedule runs apart, ``backward_input`` (``full_backward=False``) and ``backward_weight``;
  ``chunk`` is the stage's place among the rank's stages, ``stage_index // P`` (stage
  ``v * P + p`` runs on rank ``p`` as its chunk ``v``), sent only when the rank runs several.

The iteration ends when the rank's last backward returns (of every stage it runs, the
backward weight half for a zero-bubble schedule), **before** the data-parallel
gradient synchronization: ended after it, every replica would report the time of the
slowest one and a straggler would go unseen. FSDP reduces in ``perform_reduce_grad`` and a
user's own all-reduce runs after ``step()``, both after the end. A
``DistributedDataParallel`` stage module would all-reduce inside the last backward, before
its gradient goes upstream, so that every earlier stage of a fast replica waited for the
straggler: its sync is moved after the step (same gradients, see
:mod:`perseus_client.torch.ddp`), or, where that would not match DDP exactly (a
communication hook, mixed precision, unused parameters), the end is taken when the last
gradient is accumulated, with a warning that the earlier stages still wait.

Only the schedules the planner can follow computation by computation get instruction hooks
(:data:`PLANNABLE_SCHEDULES`; each rank's order is
``perseus_api.schedule.gpu_computation_order``'s):

* ``Schedule1F1B`` (``1f1b``) and ``ScheduleGPipe`` (``gpipe``): protocol version 1 is enough;
* ``ScheduleInterleaved1F1B`` with two or more stages per rank and microbatches a multiple of
  the ranks (``interleaved-1f1b`` with ``virtualStages`` = stages per rank);
* ``ScheduleInterleavedZeroBubble`` with one stage per rank (``zb-h1``: the planner's order
  is torch's for one local stage).

The last two need protocol version 2 (chunks, split backwards): against an agent that
speaks only version 1 the client stays disconnected and says to upgrade the agent. Any other
schedule (``ScheduleZBVZeroBubble``, ``ScheduleLoopedBFS``, a subclass with its own order,
other sizes) gets one warning naming the supported ones and the step hooks only: ``Stage``
granularity and straggler detection work, ``Instruction`` plans are not applied.
A ``DistributedDataParallel`` stage under a zero-bubble schedule keeps its gradient sync
where torch runs it (with a warning): the deferral below follows full backwards only.

Identity comes from ``torch.distributed`` (global rank, world size) and the stage (its
index, its device): on a CUDA device the client reports **only that device's UUID** (not
every GPU the process can see), and synchronizes the device before each hook, so that a
clock change lines up with the kernels instead of the CPU's run-ahead. A stage on the CPU
reports no GPU (the agent then goes by rank).

torch is imported when :func:`attach` is called; this module imports without it.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from perseus_client.attaching import Iteration, attach_client, distributed_rank
from perseus_client.client import PerseusClient
from perseus_client.identity import gpu_uuids_from_env
from perseus_client.torch import ddp

logger = logging.getLogger("perseus_client")

PLANNABLE_SCHEDULES = {
    "Schedule1F1B": "1f1b",
    "ScheduleGPipe": "gpipe",
    "ScheduleInterleaved1F1B": "interleaved-1f1b",
    "ScheduleInterleavedZeroBubble": "zb-h1",
}
"""torch schedule classes with instruction hooks, and the planner's name for each (sizes:
see the module docstring)."""
_VERSION_2_SCHEDULES = frozenset({"interleaved-1f1b", "zb-h1"})
"""Schedules whose hooks name chunks or split backwards (protocol version 2)."""

_ATTACHED = "_perseus_attachment"


@dataclass
class Attachment:
    """What :func:`attach` did to one schedule; :meth:`detach` undoes it.

    Attributes:
        client: The client the hooks call.
        rank, world_size: From ``torch.distributed`` (``None`` when it is not initialized).
        stage_indices: The pipeline stages this process runs.
        num_stages: Stages in the pipeline.
        schedule: The planner's name of the schedule (``"1f1b"``, ``"gpipe"``,
            ``"interleaved-1f1b"``, ``"zb-h1"``), or ``None`` when it cannot be planned per
            instruction (step hooks only).
        virtual_stages: Stages this process runs (the plan's ``virtualStages``).
        gpu_uuid: The UUID reported for the stage's device (``None``: not a CUDA device).
        steps: Iterations reported so far.
    """

    client: PerseusClient
    rank: int | None
    world_size: int | None
    stage_indices: list[int]
    num_stages: int
    schedule: str | None
    gpu_uuid: str | None
    virtual_stages: int = 1
    steps: int = 0
    _restore: list[tuple[object, str]] = field(default_factory=list, repr=False)

    @property
    def instruction_hooks(self) -> bool:
        """Whether forwards and backwards are reported (else only the iterations)."""
        return self.schedule is not None

    def detach(self) -> None:
        """Remove the wrappers: the schedule and its stages run torch's own methods again."""
        for obj, name in self._restore:
            vars(obj).pop(name, None)
        self._restore.clear()


class _StepState(Iteration):
    """Where the wrapped schedule is: inside a training ``step()`` or not, and its end."""

    def __init__(self, client: PerseusClient, sync: Callable[[], object] | None) -> None:
        super().__init__(client, sync)
        self.after_step: list[Callable[[], None]] = []
        self.stages = 1
        """Stages of the rank: the iteration ends at the last backward of the last of them."""
        self.stages_left = 1

    def begin(self, step: int) -> None:
        def reset() -> None:
            self.stages_left = self.stages

        self.begin_iteration(step, reset)

    def stage_done(self) -> None:
        """A stage's last backward ended: the iteration ends with the last stage's."""
        with self.lock:
            self.stages_left -= 1
            if self.stages_left > 0:
                return
        self.end()


def attach(schedule: Any, client: PerseusClient | None = None, **client_options: Any) -> Attachment:
    """Report every training ``step()`` of ``schedule`` and its computations to the agent.

    Args:
        schedule: A ``torch.distributed.pipelining`` schedule (one of
            :data:`PLANNABLE_SCHEDULES`, or any other: step hooks only, with a warning).
        client: The client to call; default a new process-wide client
            (:func:`perseus_client.configure`) with the identity from ``torch.distributed``
            and the stage's device. A given client keeps its identity; on CUDA it gets the
            device's synchronization when it has none.
        client_options: For the client created here, other :class:`PerseusClient`
            arguments (``reply_timeout_s``, ``retry_interval_s``, ``pipelined``, ...).

    Returns:
        The :class:`Attachment` (identity, schedule name, ``detach()``).

    Raises:
        ImportError: torch is not installed.
        TypeError: ``schedule`` is not a pipelining schedule, or ``client_options`` come
            with a ``client``.
        ValueError: ``schedule`` is already attached.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules as torch_schedules

    if not isinstance(schedule, torch_schedules._PipelineSchedule):
        raise TypeError(
            f"attach() needs a torch.distributed.pipelining schedule, got {type(schedule)!r}"
        )
    if vars(schedule).get(_ATTACHED) is not None:
        raise ValueError("this schedule is already attached; detach() it first")
    stages = _stages(schedule)
    device = stages[0].device
    sync = _device_sync(torch, device)
    gpu_uuid = _gpu_uuid(torch, device)
    rank, world_size = distributed_rank(dist)
    name = _plannable(torch_schedules, schedule, stages)
    needs_version = 2 if name in _VERSION_2_SCHEDULES else 1
    client = attach_client(
        client,
        client_options,
        rank=rank,
        gpu_uuid=gpu_uuid,
        sync=sync,
        needs_protocol_version=needs_version,
    )
    attachment = Attachment(
        client=client,
        rank=rank,
        world_size=world_size,
        stage_indices=[int(s.stage_index) for s in stages],
        num_stages=int(stages[0].num_stages),
        schedule=name,
        gpu_uuid=gpu_uuid,
        virtual_stages=len(stages),
    )
    if name is None:
        logger.warning(
            "Perseus: %s with %d stage(s) per rank and %d microbatches cannot be planned per "
            "instruction (the planner follows Schedule1F1B, ScheduleGPipe, "
            "ScheduleInterleaved1F1B with 2+ stages per rank and microbatches a multiple of "
            "the ranks, and ScheduleInterleavedZeroBubble with one stage per rank); reporting "
            "iterations only: Stage granularity and straggler detection work, Instruction "
            "plans are not applied",
            type(schedule).__name__,
            len(stages),
            int(schedule._n_microbatches),
        )
    state = _StepState(client, sync)
    state.stages = len(stages)
    _wrap_step(schedule, state, attachment)
    if name is not None:
        n_microbatches = int(schedule._n_microbatches)
        ranks = int(stages[0].num_stages) // len(stages)
        for stage in stages:
            chunk = int(stage.stage_index) // ranks if len(stages) > 1 else None
            _wrap_stage(torch, stage, state, attachment, n_microbatches, chunk)
    logger.info(
        "Perseus attached to %s: rank %s of %s, stage(s) %s of %d, GPU %s, %s",
        type(schedule).__name__,
        rank,
        world_size,
        attachment.stage_indices,
        attachment.num_stages,
        gpu_uuid or "none",
        "instruction hooks" if name else "iterations only",
    )
    return attachment


def _stages(schedule: Any) -> list[Any]:
    single = getattr(schedule, "_stage", None)
    if single is not None:
        return [single]
    return list(schedule._stages)


def _plannable(torch_schedules: Any, schedule: Any, stages: list[Any]) -> str | None:
    """The planner's name of ``schedule``, if it runs torch's own order of a plannable class
    at sizes the planner's order is torch's for.

    A subclass that replaces ``_step_microbatches`` (or, for the schedules with an action
    list, ``_calculate_single_rank_operations``) may run another order: not plannable.
    """
    local = len(stages)
    num_stages = int(stages[0].num_stages)
    ranks = num_stages // local if local and num_stages % local == 0 else 0
    microbatches = int(schedule._n_microbatches)
    for cls_name, name in PLANNABLE_SCHEDULES.items():
        cls = getattr(torch_schedules, cls_name, None)
        if cls is None or not isinstance(schedule, cls):
            continue
        kind = type(schedule)
        for method in ("_step_microbatches", "_calculate_single_rank_operations"):
            if getattr(kind, method, None) is not getattr(cls, method, None):
                return None
        if name == "interleaved-1f1b" and not (local >= 2 and ranks and microbatches % ranks == 0):
            return None
        if name == "zb-h1" and local != 1:
            return None
        if name in ("1f1b", "gpipe") and local != 1:
            return None
        # Stage v * P + p on rank p (Megatron's layout), so chunk = stage_index // P.
        if (
            local > 1
            and sorted(int(s.stage_index) % ranks for s in stages)
            != [int(stages[0].stage_index) % ranks] * local
        ):
            return None
        return name
    return None


def _device_sync(torch: Any, device: Any) -> Callable[[], object] | None:
    if getattr(device, "type", None) != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)


def _gpu_uuid(torch: Any, device: Any) -> str | None:
    """The NVML-style UUID (``GPU-...``/``MIG-...``) of a CUDA ``device``, else ``None``."""
    if getattr(device, "type", None) != "cuda":
        return None
    raw = str(torch.cuda.get_device_properties(device).uuid)
    # The container's list spells the prefix right (a MIG instance is "MIG-..."); CUDA's own
    # index order need not be that list's, so match by the UUID itself.
    for entry in gpu_uuids_from_env(os.environ):
        if entry.split("-", 1)[-1] == raw:
            return entry
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def _wrap(obj: object, name: str, attachment: Attachment, wrapper: Callable[..., Any]) -> None:
    setattr(obj, name, wrapper)
    attachment._restore.append((obj, name))


def _wrap_step(schedule: Any, state: _StepState, attachment: Attachment) -> None:
    step = schedule.step

    def perseus_step(*args: Any, **kwargs: Any) -> Any:
        # eval() runs step() with the backward off: not a training iteration.
        if state.in_step or not getattr(schedule, "_has_backward", True):
            return step(*args, **kwargs)
        state.begin(attachment.steps)
        attachment.steps += 1
        try:
            result = step(*args, **kwargs)
        except BaseException:
            state.after_step.clear()
            raise
        finally:
            state.in_step = False
            state.end()  # no-op when the last backward has reported it
        while state.after_step:
            state.after_step.pop(0)()  # the deferred DDP gradient syncs
        return result

    _wrap(schedule, "step", attachment, perseus_step)
    _wrap(schedule, _ATTACHED, attachment, attachment)  # type: ignore[arg-type]


def _wrap_stage(
    torch: Any,
    stage: Any,
    state: _StepState,
    attachment: Attachment,
    n_microbatches: int,
    chunk: int | None,
) -> None:
    client = state.client
    forward = stage.forward_one_chunk
    backward = stage.backward_one_chunk
    backward_weight = stage.backward_weight_one_chunk
    backward_sig = inspect.signature(backward)
    weight_sig = inspect.signature(backward_weight)
    split = attachment.schedule == "zb-h1"  # the stage's last backward is a weight half
    deferred: ddp.DeferredSync | None = None
    hook_last_gradient = False
    if split and isinstance(stage.submod, torch.nn.parallel.DistributedDataParallel):
        logger.warning(
            "Perseus: stage %s's DDP gradient sync stays where the zero-bubble schedule runs "
            "it: the stages before it wait for the slowest replica's sync, so their "
            "iteration times include it",
            stage.stage_index,
        )
    elif isinstance(stage.submod, torch.nn.parallel.DistributedDataParallel):
        blocker = ddp.deferral_blocker(stage.submod)
        if blocker is None:
            deferred = ddp.DeferredSync(torch, stage.submod)
        else:
            hook_last_gradient = True
            logger.warning(
                "Perseus: stage %s's DDP gradient sync stays inside its last backward (%s): "
                "the stages before it wait for the slowest replica's sync, so their "
                "iteration times include it",
                stage.stage_index,
                blocker,
            )

    def perseus_forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not state.in_step:
            return forward(fwd_chunk_id, *args, **kwargs)
        client.on_instruction_begin("forward", fwd_chunk_id, chunk)
        try:
            return forward(fwd_chunk_id, *args, **kwargs)
        finally:
            client.on_instruction_end("forward", chunk)

    def perseus_backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not state.in_step:
            return backward_weight(bwd_chunk_id, *args, **kwargs)
        bound = weight_sig.bind(bwd_chunk_id, *args, **kwargs)
        last = bool(bound.arguments.get("last_backward", False))
        client.on_instruction_begin("backward_weight", bwd_chunk_id, chunk)
        try:
            return backward_weight(*bound.args, **bound.kwargs)
        finally:
            client.on_instruction_end("backward_weight", chunk)
            if last:
                state.stage_done()

    def perseus_backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not state.in_step:
            return backward(bwd_chunk_id, *args, **kwargs)
        bound = backward_sig.bind(bwd_chunk_id, *args, **kwargs)
        full = bool(bound.arguments.get("full_backward", True))
        name = "backward" if full else "backward_input"
        # torch says which backward is the stage's last; a backward input half never is
        # (its weight half comes after it).
        last = full and bool(
            bound.arguments.get("last_backward", bwd_chunk_id == n_microbatches - 1)
        )
        if last and deferred is not None and deferred.active():
            bound.arguments["last_backward"] = False  # no sync inside: after the step
            state.after_step.append(deferred.sync)
        ended = threading.Event()

        def end_backward() -> None:
            if ended.is_set():
                return
            ended.set()
            client.on_instruction_end(name, chunk)
            if last:
                state.stage_done()

        client.on_instruction_begin(name, bwd_chunk_id, chunk)
        handles = []
        if last and hook_last_gradient:
            handles = ddp.end_at_last_gradient(stage.submod, end_backward)
        try:
            return backward(*bound.args, **bound.kwargs)
        finally:
            for handle in handles:
                handle.remove()
            end_backward()  # unless a gradient hook has: at the return

    _wrap(stage, "forward_one_chunk", attachment, perseus_forward_one_chunk)
    _wrap(stage, "backward_one_chunk", attachment, perseus_backward_one_chunk)
    if split:
        _wrap(stage, "backward_weight_one_chunk", attachment, perseus_backward_weight_one_chunk)
