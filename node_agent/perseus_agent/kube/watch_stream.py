"""What the agent's list-then-watch loops share: retry delays and the lines of a watch stream."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
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


def watch_arguments(
    version: str | None, watch_timeout_s: float, request_timeout_s: float, **selector: str
) -> dict[str, Any]:
    """A watch call's keyword arguments, from ``version`` (None: from now) with bookmarks; the
    read timeout outlasts the server's own end of the watch, so a quiet stream is not cut."""
    kwargs: dict[str, Any] = {
        **selector,
        "watch": True,
        "allow_watch_bookmarks": True,
        "timeout_seconds": watch_timeout_s,
        "_preload_content": False,
        "_request_timeout": (request_timeout_s, watch_timeout_s + 30.0),
    }
    if version:
        kwargs["resource_version"] = version
    return kwargs


def list_version(body: Mapping[str, Any]) -> str | None:
    """The ``resourceVersion`` a list answer was taken at (to watch from), if it says one."""
    version = (body.get("metadata") or {}).get("resourceVersion")
    return version if isinstance(version, str) and version else None
