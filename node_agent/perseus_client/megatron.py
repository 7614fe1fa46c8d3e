"""Perseus hooks for Megatron-Core's pipeline schedules: one line, ``attach(config)``.

::

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from perseus_client.megatron import attach

    attach(config)  # the model's TransformerConfig; before get_forward_backward_func()
    forward_backward_func = get_forward_backward_func()
    forward_backward_func(forward_step_func=..., model=model, num_microbatches=M, ...)

With Megatron-LM, ``attach(config)`` goes where the script builds its ``TransformerConfig``
(``model_provider``): Megatron-LM's ``train()`` later sets ``config.timers``, and the
adapter wraps the timers it then finds at each iteration.

What it uses, Megatron's own hook points (its code stays unchanged):

* the iteration: the schedule function ``get_forward_backward_func()`` returns. ``attach``
  puts a wrapper around the three schedule functions it chooses from
  (``megatron.core.pipeline_parallel.schedules``: ``forward_backward_no_pipelining``,
  ``..._pipelining_without_interleaving``, ``..._pipelining_with_interleaving``); a call
  whose model's config is attached is an iteration (``on_step_begin``/``on_step_end``), one
  with ``forward_only=True`` (evaluation) reports nothing. Calls for other configs pass
  straight through. A function fetched *before* ``attach`` is Megatron's own: its
  iterations go unreported (one warning, at the first computation seen outside one).
* the computations: ``config.timers``, which the schedules start and stop around every
  forward (``forward-compute``: the model and the loss) and backward (``backward-compute``).
  The adapter's timers call the hooks and then the timers they replace (or none).
  Microbatch and chunk come from counting, as Megatron's schedule does: 1F1B runs microbatch
  n as the n-th forward and backward; the interleaved schedule's k-th forward is entry k of
  Megatron's ``get_schedule_table`` (microbatch, chunk) and its k-th backward the same
  microbatch of chunk ``V - 1 - chunk``.

The iteration ends when the rank's last backward returns, **before** the data-parallel
gradient sync, which Megatron finishes in ``config.finalize_model_grads_func`` after the
schedule's last backward (with ``overlap_grad_reduce`` the all-reduces start during the last
backward, on their own stream, and are waited for there).

Instruction hooks need an order the planner follows: 1F1B (``1f1b``, also without
pipelining), and the interleaved schedule (``interleaved-1f1b``, ``virtualStages`` = model
chunks) with ``microbatch_group_size_per_vp_stage`` equal to the pipeline size (Megatron's
default) and microbatches a multiple of it; the interleaved hooks name chunks (protocol
version 2). With ``overlap_moe_expert_parallel_comm`` Megatron runs its combined 1F1B, which
overlaps one microbatch's forward with another's backward and bypasses both timers; that,
and any other size, gets one warning and the step hooks only: ``Stage`` granularity and
straggler detection work, ``Instruction`` plans are not applied.

Identity comes from ``torch.distributed`` (global rank) and the current CUDA device: the
client reports **only that device's UUID**, and synchronizes the **current stream** before
each hook (the compute work; not the gradient all-reduces ``overlap_grad_reduce`` runs on
another stream, which would otherwise be waited for inside the last backward). Without CUDA
no GPU is reported (the agent then goes by rank).

Megatron-Core and torch are imported when :func:`attach` is called; this module imports
without them.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from perseus_client.attaching import Iteration, attach_client, distributed_rank
from perseus_client.client import PerseusClient
from perseus_client.identity import gpu_uuids_from_env

logger = logging.getLogger("perseus_client")

_ATTACHED = "_perseus_attachment"
_SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
_PATCH_LOCK = threading.Lock()
_patched: dict[str, Callable[..., Any]] = {}
"""Megatron's own schedule functions, while the wrappers stand in their module."""
_attached_count = 0


@dataclass
class Attachment:
    """What :func:`attach` did to one config; :meth:`detach` undoes it.

    Attributes:
        client: The client the hooks call.
        rank, world_size: From ``torch.distributed`` (``None`` when it is not initialized).
        gpu_uuid: The UUID reported for the current CUDA device (``None``: no CUDA).
        schedule: The planner's name of the last iteration's schedule (``"1f1b"``,
            ``"interleaved-1f1b"``), ``None`` when it could not be planned per instruction
            (step hooks only), or before the first iteration.
        virtual_stages: Model chunks of the last iteration (the plan's ``virtualStages``).
        steps: Iterations reported so far.
    """

    client: PerseusClient
    rank: int | None
    world_size: int | None
    gpu_uuid: str | None
    schedule: str | None = None
    virtual_stages: int = 1
    steps: int = 0
    _config: Any = field(default=None, repr=False)
    _iteration: Any = field(default=None, repr=False)

    def detach(self) -> None:
        """Give the config its own timers back; the schedule functions are Megatron's again
        once no config is attached."""
        global _attached_count
        config = self._config
        if config is None:
            return
        timers = vars(config).get("timers")
        if isinstance(timers, _HookedTimers):
            config.timers = timers.inner
        vars(config).pop(_ATTACHED, None)
        self._config = None
        with _PATCH_LOCK:
            _attached_count -= 1
            if _attached_count == 0:
                _unpatch()


class _Iteration(Iteration):
    """One attached config's state: inside a training call or not, and its counters."""

    def __init__(self, client: PerseusClient, sync: Callable[[], object] | None) -> None:
        super().__init__(client, sync)
        self.hooks = False
        self.forwards = 0
        self.backwards = 0
        self.table: list[tuple[int, int]] = []
        """Megatron's schedule table (microbatch, chunk) per virtual microbatch."""
        self.chunks = 1
        self.last_backward = 0
        self.open: list[tuple[str, int | None]] = []
        self.outside_warned = False
        self.evaluating = 0
        """Attached ``forward_only`` calls running (their computations report nothing)."""

    def begin(self, step: int, hooks: bool, table: list[tuple[int, int]], chunks: int) -> None:
        def reset() -> None:
            self.hooks, self.table, self.chunks = hooks, table, chunks
            self.forwards = self.backwards = 0
            self.last_backward = len(table)
            self.open.clear()

        self.begin_iteration(step, reset)

    def computation_begin(self, kind: str) -> None:
        if not self.in_step:
            if not self.outside_warned and not self.evaluating:
                self.outside_warned = True
                logger.warning(
                    "Perseus: Megatron ran a %s outside an attached forward-backward call: "
                    "the schedule function was fetched before attach(config) (call attach "
                    "first); these iterations are not reported",
                    kind,
                )
            return
        if not self.hooks:
            return
        with self.lock:
            if kind == "forward":
                k, self.forwards = self.forwards, self.forwards + 1
            else:
                k, self.backwards = self.backwards, self.backwards + 1
            microbatch, chunk = self.table[k % len(self.table)]
            if kind == "backward":
                chunk = self.chunks - 1 - chunk
            named = chunk if self.chunks > 1 else None
            self.open.append((kind, named))
        self.client.on_instruction_begin(kind, microbatch, named)

    def computation_end(self, kind: str) -> None:
        if not (self.in_step and self.hooks):
            return
        with self.lock:
            if not self.open:
                return
            name, chunk = self.open.pop()
            last = name == "backward" and self.backwards == self.last_backward
        self.client.on_instruction_end(name, chunk)
        if last:
            self.end()  # before finalize_model_grads_func: the data-parallel sync


class _NullTimer:
    def start(self, *args: Any, **kwargs: Any) -> None:
        pass

    def stop(self, *args: Any, **kwargs: Any) -> None:
        pass

    def elapsed(self, *args: Any, **kwargs: Any) -> float:
        return 0.0


class _HookedTimers:
    """``config.timers`` calling the hooks around ``forward-compute``/``backward-compute``."""

    _KINDS: ClassVar[dict[str, str]] = {
        "forward-compute": "forward",
        "backward-compute": "backward",
    }

    def __init__(self, inner: Any, iteration: _Iteration) -> None:
        self.inner = inner
        self.iteration = iteration

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        timer = self.inner(name, *args, **kwargs) if self.inner is not None else _NullTimer()
        kind = self._KINDS.get(name)
        return timer if kind is None else _HookedTimer(timer, kind, self.iteration)

    def __getattr__(self, name: str) -> Any:
        inner = vars(self).get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class _HookedTimer:
    def __init__(self, timer: Any, kind: str, iteration: _Iteration) -> None:
        self.timer, self.kind, self.iteration = timer, kind, iteration

    def start(self, *args: Any, **kwargs: Any) -> Any:
        self.iteration.computation_begin(self.kind)
        return self.timer.start(*args, **kwargs)

    def stop(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.timer.stop(*args, **kwargs)
        finally:
            self.iteration.computation_end(self.kind)

    def __getattr__(self, name: str) -> Any:
        if "timer" not in vars(self):
            raise AttributeError(name)
        return getattr(vars(self)["timer"], name)


def attach(config: Any, client: PerseusClient | None = None, **client_options: Any) -> Attachment:
    """Report every training call of Megatron's schedule for models of ``config``, and its
    forwards and backwards.

    Args:
        config: The models' ``TransformerConfig`` (``get_model_config(model[0])``).
        client: The client to call; default a new process-wide client
            (:func:`perseus_client.configure`) with the identity from ``torch.distributed``
            and the current CUDA device. A given client keeps its identity; on CUDA it gets
            the stream's synchronization when it has none.
        client_options: For the client created here, other :class:`PerseusClient`
            arguments (``reply_timeout_s``, ``retry_interval_s``, ``pipelined``, ...).

    Returns:
        The :class:`Attachment` (identity, schedule name, ``detach()``).

    Raises:
        ImportError: megatron-core (or torch) is not installed.
        TypeError: ``config`` is not a Megatron ``ModelParallelConfig``, or
            ``client_options`` come with a ``client``.
        ValueError: ``config`` is already attached.
    """
    global _attached_count
    import torch
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(config, ModelParallelConfig):
        raise TypeError(
            f"attach() needs Megatron's model config (TransformerConfig), got {type(config)!r}"
        )
    if vars(config).get(_ATTACHED) is not None:
        raise ValueError("this config is already attached; detach() it first")
    sync, gpu_uuid = _cuda(torch)
    rank, world_size = distributed_rank(dist)
    # Interleaved schedules name chunks: version 2 (known only at the first call; asked here,
    # before the first hello, whenever the model could be interleaved).
    interleaved = bool(getattr(config, "virtual_pipeline_model_parallel_size", None))
    needs_version = 2 if interleaved else 1
    client = attach_client(
        client,
        client_options,
        rank=rank,
        gpu_uuid=gpu_uuid,
        sync=sync,
        needs_protocol_version=needs_version,
    )
    iteration = _Iteration(client, sync)
    attachment = Attachment(
        client=client,
        rank=rank,
        world_size=world_size,
        gpu_uuid=gpu_uuid,
        _config=config,
        _iteration=iteration,
    )
    config.timers = _HookedTimers(config.timers, iteration)
    vars(config)[_ATTACHED] = attachment
    with _PATCH_LOCK:
        _attached_count += 1
        _patch(schedules)
    logger.info(
        "Perseus attached to Megatron-Core: rank %s of %s, GPU %s",
        rank,
        world_size,
        gpu_uuid or "none",
    )
    return attachment


def _cuda(torch: Any) -> tuple[Callable[[], object] | None, str | None]:
    """The current CUDA stream's synchronization and the current device's UUID, or ``None``s
    without CUDA."""
    if not torch.cuda.is_available():
        return None, None
    device = torch.device("cuda", torch.cuda.current_device())
    raw = str(torch.cuda.get_device_properties(device).uuid)
    uuid = raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"
    for entry in gpu_uuids_from_env(os.environ):
        if entry.split("-", 1)[-1] == raw.split("-", 1)[-1]:
            uuid = entry  # the container's spelling (a MIG instance is "MIG-...")
    return (lambda: torch.cuda.current_stream(device).synchronize()), uuid


def _patch(schedules: Any) -> None:
    for name in _SCHEDULE_FUNCTIONS:
        if name in _patched or not hasattr(schedules, name):
            continue
        original = getattr(schedules, name)
        _patched[name] = original
        setattr(schedules, name, _wrap_schedule(schedules, original, name))


def _unpatch() -> None:
    from megatron.core.pipeline_parallel import schedules

    for name, original in _patched.items():
        setattr(schedules, name, original)
    _patched.clear()


def _wrap_schedule(schedules: Any, run: Callable[..., Any], name: str) -> Callable[..., Any]:
    interleaving = name.endswith("_with_interleaving")

    @functools.wraps(run)
    def perseus_forward_backward(*args: Any, **kwargs: Any) -> Any:
        model = kwargs.get("model")
        chunks = model if isinstance(model, list) else [model]
        try:
            config = schedules.get_model_config(chunks[0])
        except Exception:  # not ours to judge: Megatron's own call says what is wrong
            return run(*args, **kwargs)
        attachment = vars(config).get(_ATTACHED)
        if attachment is None:
            return run(*args, **kwargs)
        iteration: _Iteration = attachment._iteration
        if kwargs.get("forward_only", False):  # evaluation: not an iteration
            iteration.evaluating += 1
            try:
                return run(*args, **kwargs)
            finally:
                iteration.evaluating -= 1
        if iteration.in_step:
            return run(*args, **kwargs)
        if not isinstance(config.timers, _HookedTimers):  # set again since (Megatron-LM does)
            config.timers = _HookedTimers(config.timers, iteration)
        microbatches = int(kwargs["num_microbatches"])
        plan = _plannable(schedules, config, interleaving, len(chunks), microbatches)
        schedule, table = plan if plan is not None else (None, [(0, 0)])
        if schedule != attachment.schedule or attachment.steps == 0:
            _announce(attachment, schedule, name, config, len(chunks), microbatches)
        attachment.schedule, attachment.virtual_stages = schedule, len(chunks)
        finalize = config.finalize_model_grads_func
        if finalize is not None:
            config.finalize_model_grads_func = _ending_before(finalize, iteration)
        iteration.begin(attachment.steps, schedule is not None, table, len(chunks))
        attachment.steps += 1
        try:
            return run(*args, **kwargs)
        finally:
            iteration.in_step = False
            iteration.end()  # no-op when the last backward has reported it
            if finalize is not None:
                config.finalize_model_grads_func = finalize

    return perseus_forward_backward


def _ending_before(finalize: Callable[..., Any], iteration: _Iteration) -> Callable[..., Any]:
    """``finalize`` (Megatron's data-parallel gradient sync), the iteration ended before it:
    at the latest there, when no last backward has ended it (step hooks only)."""

    @functools.wraps(finalize)
    def perseus_finalize(*args: Any, **kwargs: Any) -> Any:
        iteration.end()
        return finalize(*args, **kwargs)

    return perseus_finalize


def _plannable(
    schedules: Any, config: Any, interleaving: bool, chunks: int, microbatches: int
) -> tuple[str, list[tuple[int, int]]] | None:
    """The planner's name of the schedule about to run and Megatron's (microbatch, chunk)
    table of it, or ``None`` when the planner's order is not Megatron's."""
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return None  # the combined 1F1B: forward and backward overlapped, timers bypassed
    if not interleaving:
        return "1f1b", [(m, 0) for m in range(microbatches)]
    ranks = int(config.pipeline_model_parallel_size)
    group = config.microbatch_group_size_per_vp_stage or ranks
    if chunks < 2 or group != ranks or microbatches % ranks:
        return None
    table = schedules.get_schedule_table(microbatches, chunks, group)
    return "interleaved-1f1b", [(int(m), int(c)) for m, c in table]


def _announce(
    attachment: Attachment,
    schedule: str | None,
    function: str,
    config: Any,
    chunks: int,
    microbatches: int,
) -> None:
    if schedule is not None:
        return
    logger.warning(
        "Perseus: Megatron's %s with %d model chunk(s), %d microbatches%s runs an order the "
        "planner does not follow (it follows 1F1B, and interleaved 1F1B with "
        "microbatch_group_size_per_vp_stage = the pipeline size and microbatches a multiple "
        "of it); reporting iterations only: Stage granularity and straggler detection work, "
        "Instruction plans are not applied",
        function,
        chunks,
        microbatches,
        " and overlap_moe_expert_parallel_comm (combined 1F1B)"
        if getattr(config, "overlap_moe_expert_parallel_comm", False)
        else "",
    )
