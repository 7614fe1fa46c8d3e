"""What the agent's list-then-watch loops share: retry delays and the lines of a watch stream."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

__all__ = ["Backoff", "lines"]


class Backoff:
    """Exponential backoff with jitter, ``min_s`` to ``max_s`` seconds."""

    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s, self.max_s = min_s, max_s
        self._next = min_s

    def reset(self) -> None:
        self._next = self.min_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self.max_s, self._next * 2)
        return delay * random.uniform(0.8, 1.2)


def lines(response: Any) -> Iterator[str]:
    """The lines of a streamed HTTP response, as they arrive."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=True):
        buffer += chunk if isinstance(chunk, bytes) else str(chunk).encode()
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line.decode("utf-8", errors="replace")
    if buffer.strip():
        yield buffer.decode("utf-8", errors="replace")
