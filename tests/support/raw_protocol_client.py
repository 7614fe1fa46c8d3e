"""A bare client of the agent's Unix socket, to send any bytes the protocol allows or not, and a
hello request for it."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from perseus_client.protocol import PROTOCOL_VERSION

HELLO: dict[str, Any] = {
    "op": "hello",
    "version": PROTOCOL_VERSION,
    "rank": 0,
    "local_rank": 0,
    "gpu_uuids": ["GPU-0000"],
    "pid": 1,
    "job": "job",
    "namespace": "ns",
    "pod": "pod-0",
}


class Raw:
    """A bare protocol client: send lines, read reply lines."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(os.fspath(path))
        self.file = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> dict[str, Any]:
        line = self.file.readline()
        assert line.endswith(b"\n"), f"connection closed (got {line!r})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, msg: Mapping[str, Any] | bytes) -> dict[str, Any]:
        self.send(msg if isinstance(msg, bytes) else json.dumps(msg).encode() + b"\n")
        return self.reply()

    def at_eof(self) -> bool:
        return self.file.readline() == b""

    def close(self) -> None:
        self.file.close()
        self.sock.close()
