"""Perseus hooks for DeepSpeed's pipeline engine: one line, ``attach(engine)``.

::

    from perseus_client.deepspeed import attach

    engine, _, _, _ = deepspeed.initialize(model=pipeline_module, config=ds_config, ...)
    attach(engine)  # every train_batch() is an iteration, every forward/backward a hook
    for step in range(steps):
        engine.train_batch(data_iter)

What it wraps, on the engine instance (the class and other engines stay untouched):

* ``engine.train_batch``: the iteration (``on_step_begin``/``on_step_end``).
  ``eval_batch()`` reports nothing.
* the engine's instruction map: DeepSpeed's ``_exec_schedule`` runs each instruction through
  the class-level ``_INSTRUCTION_MAP`` (so replacing ``engine._exec_forward_pass`` would see
  nothing); an instance ``_INSTRUCTION_MAP``, a copy with ``ForwardPass`` and ``BackwardPass``
  wrapped, is what it then calls. Instructions carry a pipe buffer id, not a microbatch: the
  n-th forward (backward) of a ``train_batch()`` is microbatch n, as in ``TrainSchedule``.
  DeepSpeed runs one stage per rank, so no chunk is sent (protocol version 1).

The iteration ends when the rank's last backward returns, **before** the data-parallel
gradient reduction: ``TrainSchedule`` runs ``ReduceTiedGrads``, ``ReduceGrads`` (the
all-reduce; DeepSpeed turns off the engine's own all-reduce in ``backward`` for pipelines)
and ``OptimizerStep`` after the last ``BackwardPass``, so a straggler replica is seen.

Only ``TrainSchedule`` (1F1B, the planner's ``1f1b`` order on every rank) run by
``PipelineEngine``'s own ``_exec_schedule`` gets instruction hooks. Any other schedule
(``DualPipeVEngine``'s ``DualPipeVSchedule``, a subclass's own ``_train_schedule``) gets one
warning and the step hooks only, the iteration then ending at the first gradient reduction
instruction: ``Stage`` granularity and straggler detection work, ``Instruction`` plans are
not applied.

Identity comes from ``torch.distributed`` (global rank) and the engine's device: on CUDA the
client reports **only that device's UUID** and synchronizes the device before each hook (so
that a clock change lines up with the kernels, not the CPU's run-ahead). On the CPU no GPU is
reported (the agent then goes by rank).

DeepSpeed and torch are imported when :func:`attach` is called; this module imports without
them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from perseus_client.attaching import Iteration, attach_client, distributed_rank
from perseus_client.client import PerseusClient
from perseus_client.torch import _device_sync, _gpu_uuid

logger = logging.getLogger("perseus_client")

_ATTACHED = "_perseus_attachment"
_REDUCTIONS = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
"""Instructions that come after the iteration's computations: the end, at the latest."""


@dataclass
class Attachment:
    """What :func:`attach` did to one engine; :meth:`detach` undoes it.

    Attributes:
        client: The client the hooks call.
        rank, world_size: From ``torch.distributed`` (``None`` when it is not initialized).
        stage: The pipeline stage this process runs (``engine.stage_id``).
        num_stages: Stages in the pipeline.
        schedule: The planner's name of the schedule (``"1f1b"``), or ``None`` when it cannot
            be planned per instruction (step hooks only).
        gpu_uuid: The UUID reported for the engine's device (``None``: not a CUDA device).
        steps: Iterations reported so far.
    """

    client: PerseusClient
    rank: int | None
    world_size: int | None
    stage: int
    num_stages: int
    schedule: str | None
    gpu_uuid: str | None
    steps: int = 0
    _engine: Any = field(default=None, repr=False)

    @property
    def instruction_hooks(self) -> bool:
        """Whether forwards and backwards are reported (else only the iterations)."""
        return self.schedule is not None

    def detach(self) -> None:
        """Remove the wrappers: the engine runs DeepSpeed's own methods and map again."""
        if self._engine is None:
            return
        for name in ("train_batch", "_INSTRUCTION_MAP", _ATTACHED):
            vars(self._engine).pop(name, None)
        self._engine = None


class _Iteration(Iteration):
    """Where the engine is: inside a ``train_batch()`` or not, and which computation."""

    def __init__(self, client: PerseusClient, sync: Callable[[], object] | None) -> None:
        super().__init__(client, sync)
        self.forwards = 0
        self.backwards = 0
        self.last_backward = 0
        """Backwards of the running iteration; the iteration ends with this one."""

    def begin(self, step: int, microbatches: int) -> None:
        def reset() -> None:
            self.forwards = self.backwards = 0
            self.last_backward = microbatches

        self.begin_iteration(step, reset)


def attach(engine: Any, client: PerseusClient | None = None, **client_options: Any) -> Attachment:
    """Report every ``train_batch()`` of a DeepSpeed ``PipelineEngine`` and its computations.

    Args:
        engine: What ``deepspeed.initialize`` returned for a ``PipelineModule``.
        client: The client to call; default a new process-wide client
            (:func:`perseus_client.configure`) with the identity from ``torch.distributed``
            and the engine's device. A given client keeps its identity; on CUDA it gets the
            device's synchronization when it has none.
        client_options: For the client created here, other :class:`PerseusClient`
            arguments (``reply_timeout_s``, ``retry_interval_s``, ``pipelined``, ...).

    Returns:
        The :class:`Attachment` (identity, schedule name, ``detach()``).

    Raises:
        ImportError: DeepSpeed (or torch) is not installed.
        TypeError: ``engine`` is not a pipeline engine, or ``client_options`` come with a
            ``client``.
        ValueError: ``engine`` is already attached.
    """
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.pipe import schedule as ds_schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, PipelineEngine):
        raise TypeError(
            "attach() needs DeepSpeed's PipelineEngine (deepspeed.initialize of a "
            f"PipelineModule), got {type(engine)!r}"
        )
    if vars(engine).get(_ATTACHED) is not None:
        raise ValueError("this engine is already attached; detach() it first")
    device = getattr(engine, "device", None)
    if isinstance(device, (str, int)):
        device = torch.device(device)
    sync = _device_sync(torch, device)
    gpu_uuid = _gpu_uuid(torch, device)
    rank, world_size = distributed_rank(dist)
    name = _plannable(ds_schedule, PipelineEngine, engine)
    client = attach_client(client, client_options, rank=rank, gpu_uuid=gpu_uuid, sync=sync)
    attachment = Attachment(
        client=client,
        rank=rank,
        world_size=world_size,
        stage=int(engine.stage_id),
        num_stages=int(engine.num_stages),
        schedule=name,
        gpu_uuid=gpu_uuid,
        _engine=engine,
    )
    if name is None:
        logger.warning(
            "Perseus: %s runs %s, an order the planner does not follow (it follows "
            "PipelineEngine's TrainSchedule, 1F1B); reporting iterations only: Stage granularity "
            "and straggler detection work, Instruction plans are not applied",
            type(engine).__name__,
            type(engine._train_schedule()).__name__,
        )
    iteration = _Iteration(client, sync)
    _wrap_train_batch(engine, iteration, attachment)
    _wrap_instructions(ds_schedule, engine, iteration, attachment)
    vars(engine)[_ATTACHED] = attachment
    logger.info(
        "Perseus attached to %s: rank %s of %s, stage %d of %d, GPU %s, %s",
        type(engine).__name__,
        rank,
        world_size,
        attachment.stage,
        attachment.num_stages,
        gpu_uuid or "none",
        "instruction hooks" if name else "iterations only",
    )
    return attachment


def _plannable(ds_schedule: Any, pipeline_engine: Any, engine: Any) -> str | None:
    """``"1f1b"`` when ``engine`` runs ``TrainSchedule`` through DeepSpeed's own
    ``_exec_schedule``, else ``None``."""
    kind = type(engine)
    if getattr(kind, "_exec_schedule", None) is not pipeline_engine._exec_schedule:
        return None
    if type(engine._train_schedule()) is not ds_schedule.TrainSchedule:
        return None
    return "1f1b"


def _wrap_train_batch(engine: Any, iteration: _Iteration, attachment: Attachment) -> None:
    train_batch = engine.train_batch

    def perseus_train_batch(*args: Any, **kwargs: Any) -> Any:
        if iteration.in_step:
            return train_batch(*args, **kwargs)
        iteration.begin(attachment.steps, int(engine.micro_batches))
        attachment.steps += 1
        try:
            return train_batch(*args, **kwargs)
        finally:
            iteration.in_step = False
            iteration.end()  # no-op when the last backward has reported it

    vars(engine)["train_batch"] = perseus_train_batch


def _wrap_instructions(
    ds_schedule: Any, engine: Any, iteration: _Iteration, attachment: Attachment
) -> None:
    # From the engine's own map: an emulation (or another tool) may have put one there first.
    instructions: dict[type, Callable[..., Any]] = dict(engine._INSTRUCTION_MAP)
    client = iteration.client
    hooks = attachment.instruction_hooks

    def computation(kind: str, run: Callable[..., Any]) -> Callable[..., Any]:
        forward = kind == "forward"

        def perseus_computation(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not iteration.in_step:
                return run(self, *args, **kwargs)
            with iteration.lock:
                if forward:
                    microbatch, iteration.forwards = iteration.forwards, iteration.forwards + 1
                else:
                    microbatch, iteration.backwards = iteration.backwards, iteration.backwards + 1
            if hooks:
                client.on_instruction_begin(kind, microbatch)
            try:
                return run(self, *args, **kwargs)
            finally:
                if hooks:
                    client.on_instruction_end(kind)
                if hooks and not forward and microbatch + 1 == iteration.last_backward:
                    iteration.end()  # before the gradient reductions

        return perseus_computation

    def reduction(run: Callable[..., Any]) -> Callable[..., Any]:
        def perseus_reduction(self: Any, *args: Any, **kwargs: Any) -> Any:
            if iteration.in_step:
                iteration.end()  # at the latest here, before the data-parallel sync
            return run(self, *args, **kwargs)

        return perseus_reduction

    for cls, run in list(instructions.items()):
        if cls is ds_schedule.ForwardPass:
            instructions[cls] = computation("forward", run)
        elif cls is ds_schedule.BackwardPass:
            instructions[cls] = computation("backward", run)
        elif cls.__name__ in _REDUCTIONS:
            instructions[cls] = reduction(run)
    vars(engine)["_INSTRUCTION_MAP"] = instructions
