"""What every framework adapter's ``attach()`` shares (:mod:`perseus_client.torch`,
:mod:`perseus_client.deepspeed`, :mod:`perseus_client.megatron`): the process's identity in
``torch.distributed``, the client the hooks report to, and the iteration they are in.

Standard library only: the adapters pass in the modules of torch they imported themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from perseus_client.client import PerseusClient
from perseus_client.default_client import configure


def distributed_rank(dist: Any) -> tuple[int | None, int | None]:
    """Global rank and world size from ``torch.distributed`` (``None``s when it is not
    initialized)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, None


def attach_client(
    client: PerseusClient | None,
    client_options: dict[str, Any],
    *,
    rank: int | None,
    gpu_uuid: str | None,
    sync: Callable[[], object] | None,
    needs_protocol_version: int | None = None,
) -> PerseusClient:
    """The client an attachment reports to: ``client``, given the device's ``sync`` when it
    has none (and at least ``needs_protocol_version``), else a new process-wide one
    (:func:`perseus_client.configure`) with this identity and ``client_options``.

    Raises:
        TypeError: ``client_options`` come with a ``client``.
    """
    versioned: dict[str, Any] = (
        {} if needs_protocol_version is None else {"needs_protocol_version": needs_protocol_version}
    )
    if client is None:
        return configure(
            rank=rank,
            gpu_uuids=[gpu_uuid] if gpu_uuid else [],
            synchronize=sync,
            **versioned,
            **client_options,
        )
    if client_options:
        raise TypeError("client options go with a client made here, not with client=")
    if client.synchronize is None and sync is not None:
        client.synchronize = sync
    if needs_protocol_version is not None:
        client.needs_protocol_version = max(client.needs_protocol_version, needs_protocol_version)
    return client


class Iteration:
    """Where an attached training loop is: inside an iteration or not; its end is reported
    once, by whichever comes first (the last backward, a gradient reduction, the return)."""

    def __init__(self, client: PerseusClient, sync: Callable[[], object] | None) -> None:
        self.client = client
        self.sync = sync
        self.lock = threading.Lock()  # the end may come from autograd's device thread
        self.in_step = False
        self.ended = True
        self.step = 0

    def begin_iteration(self, step: int, reset: Callable[[], None] | None = None) -> None:
        """Report iteration ``step``'s begin; ``reset`` clears a subclass's counters (under the
        lock, before the hook)."""
        if self.sync is not None and self.client.connected:
            self.sync()  # the previous iteration's kernels belong to it, not to this one
        with self.lock:
            self.step, self.ended, self.in_step = step, False, True
            if reset is not None:
                reset()
        self.client.on_step_begin(step)

    def end(self) -> None:
        """Report the iteration's end, once."""
        with self.lock:
            if self.ended:
                return
            self.ended = True
        self.client.on_step_end(self.step)
