"""The data-parallel gradient sync of a ``DistributedDataParallel`` pipeline stage.

torch's pipelining runs DDP's all-reduce inside the stage's last ``backward_one_chunk``
(``last_backward=True``), before that backward's gradient is sent to the previous stage. So
the previous stage of a fast replica waits for the slowest replica's sync of this stage
before it can run its own last backward: every stage but the last ends the iteration at the
straggler's pace, and a replica's time (its slowest rank's) is the straggler's.

:class:`DeferredSync` moves the sync after the iteration's computations: the last backward
runs under ``no_sync()`` like the others, and after the schedule's ``step()`` the
accumulated gradients are averaged over the DDP group (one flattened all-reduce, DDP's own
arithmetic: sum, then divide by the group's size). The result is the same gradients, the
upstream send no longer waits, and each rank's iteration ends with its own computations.
It is used only where it matches DDP exactly: no communication hook, no mixed precision,
``find_unused_parameters`` off, and not while the user holds ``no_sync()``.
Otherwise :func:`end_at_last_gradient` at least takes the stage's own end before DDP's wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def deferral_blocker(ddp: Any) -> str | None:
    """Why DDP's sync of ``ddp`` cannot be moved after the step (``None``: it can)."""
    if getattr(ddp, "_comm_hooks", None):
        return "it has a communication hook"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "it uses mixed precision"
    if getattr(ddp, "find_unused_parameters", False):
        return "find_unused_parameters is on"
    if getattr(ddp, "_delay_all_reduce_params", None):
        return "it delays the all-reduce of some parameters"
    if getattr(ddp, "static_graph", False):
        return "static_graph is on"
    return None


class DeferredSync:
    """Average a DDP module's accumulated gradients over its group, after the step."""

    def __init__(self, torch: Any, ddp: Any) -> None:
        self._torch = torch
        self._ddp = ddp
        self._params = [p for p in ddp.parameters() if p.requires_grad]

    def active(self) -> bool:
        """Whether this step's gradients are to be synchronized (not under ``no_sync()``)."""
        return bool(self._ddp.require_backward_grad_sync)

    def sync(self) -> None:
        torch = self._torch
        dist = torch.distributed
        group = self._ddp.process_group
        grads = []
        for p in self._params:
            if p.grad is None:  # as DDP: a parameter without a gradient contributes zeros
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
        for grad, synced in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            grad.copy_(synced)


def end_at_last_gradient(module: Any, on_done: Callable[[], None]) -> list[Any]:
    """Call ``on_done`` when every trainable parameter of ``module`` has its gradient.

    DDP's reducer waits for its all-reduces at the end of the backward, after every
    gradient is accumulated: this is the end of the stage's computation, before the sync.
    Returns the hook handles (``remove()`` them after the backward).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    remaining = set(range(len(params)))
    lock = threading.Lock()

    def make_hook(index: int) -> Callable[[Any], None]:
        def hook(_: Any) -> None:
            with lock:
                if index not in remaining:
                    return
                remaining.discard(index)
                done = not remaining
            if done:
                on_done()

        return hook

    return [p.register_post_accumulate_grad_hook(make_hook(i)) for i, p in enumerate(params)]
