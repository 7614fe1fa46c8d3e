"""The process-wide client and the module-level hooks that use it.

``perseus_client.on_step_begin(...)``, ``perseus_client.instruction(...)`` and the others call
the one :class:`~perseus_client.client.PerseusClient` of the process, made from the
environment at the first hook or by :func:`configure`. Standard library only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from perseus_client.client import PerseusClient

_default: PerseusClient | None = None
_default_lock = threading.Lock()


def get_client() -> PerseusClient:
    """The process-wide client, created from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PerseusClient()
        return _default


def configure(socket_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> PerseusClient:
    """Replace the process-wide client with ``PerseusClient(socket_path, **kwargs)``."""
    global _default
    client = PerseusClient(socket_path, **kwargs)
    with _default_lock:
        old, _default = _default, client
    if old is not None:
        old.close()
    return client


def on_step_begin(step: int) -> None:
    get_client().on_step_begin(step)


def on_step_end(step: int) -> None:
    get_client().on_step_end(step)


def on_instruction_begin(
    name: str, microbatch: int | None = None, chunk: int | None = None
) -> int | None:
    return get_client().on_instruction_begin(name, microbatch, chunk)


def on_instruction_end(name: str, chunk: int | None = None) -> None:
    get_client().on_instruction_end(name, chunk)


@contextmanager
def step(step: int) -> Iterator[None]:
    """The process-wide client's :meth:`PerseusClient.step`."""
    with get_client().step(step):
        yield


@contextmanager
def instruction(
    name: str, microbatch: int | None = None, chunk: int | None = None
) -> Iterator[int | None]:
    """The process-wide client's :meth:`PerseusClient.instruction`; yields the SM clock."""
    with get_client().instruction(name, microbatch, chunk) as clock:
        yield clock
