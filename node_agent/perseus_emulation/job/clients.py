"""A rank's hooks: the node agent's client, none, or either timed into the rank's overheads."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from perseus_client import PerseusClient
from perseus_client.client import DEFAULT_RETRY_INTERVAL_S
from perseus_emulation.job.records import RankInfo

__all__ = ["ClientFactory", "NoClient", "RankClient", "TimedClient", "default_client"]


class RankClient(Protocol):
    """What a rank calls: the hooks of :class:`perseus_client.PerseusClient`, and ``close``."""

    def on_step_begin(self, step: int) -> None: ...

    def on_step_end(self, step: int) -> None: ...

    def on_instruction_begin(self, name: str, microbatch: int | None = None) -> int | None: ...

    def on_instruction_end(self, name: str) -> None: ...

    def close(self) -> None: ...


ClientFactory = Callable[[RankInfo], RankClient]
"""Makes a rank's client; called in the rank's thread before its first iteration."""


class NoClient:
    """Hooks that do nothing: a node without an agent socket."""

    def on_step_begin(self, step: int) -> None:
        pass

    def on_step_end(self, step: int) -> None:
        pass

    def on_instruction_begin(self, name: str, microbatch: int | None = None) -> int | None:
        return None

    def on_instruction_end(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


class TimedClient:
    """A rank's client whose calls add their time to the rank's ``hook_s`` overhead."""

    def __init__(self, client: RankClient, overheads: dict[str, float]) -> None:
        self._client = client
        self._overheads = overheads

    def on_step_begin(self, step: int) -> None:
        start_s = time.monotonic()
        self._client.on_step_begin(step)
        self._overheads["hook_s"] += time.monotonic() - start_s

    def on_step_end(self, step: int) -> None:
        start_s = time.monotonic()
        self._client.on_step_end(step)
        self._overheads["hook_s"] += time.monotonic() - start_s

    def on_instruction_begin(self, name: str, microbatch: int | None = None) -> None:
        start_s = time.monotonic()
        self._client.on_instruction_begin(name, microbatch)
        self._overheads["hook_s"] += time.monotonic() - start_s

    def on_instruction_end(self, name: str) -> None:
        start_s = time.monotonic()
        self._client.on_instruction_end(name)
        self._overheads["hook_s"] += time.monotonic() - start_s


def default_client(
    info: RankInfo, *, retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S
) -> RankClient:
    """A pipelined :class:`PerseusClient` on the node's socket, or no hooks without one."""
    if info.node.socket is None:
        return NoClient()
    return PerseusClient(
        info.node.socket,
        rank=info.rank,
        local_rank=info.gpu_index,
        gpu_uuids=[info.gpu_uuid],
        pipelined=True,
        retry_interval_s=retry_interval_s,
    )
