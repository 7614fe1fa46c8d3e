"""Where the training process reaches its node's agent: a Unix socket or a TCP address.

``$PERSEUS_AGENT_ADDRESS`` wins when set: ``tcp://HOST:PORT`` (the node's address, which the
operator's admission webhook injects from the downward API's ``status.hostIP``: no volume, so
pods in namespaces enforcing PodSecurity ``baseline`` can use it) or ``unix:///path``. Else
``$PERSEUS_AGENT_SOCKET`` (a socket path, mounted from the host), else
:data:`~perseus_client.protocol.DEFAULT_SOCKET_PATH`.

Over TCP the agent tells the pod by the connection's source address (its pod IP), so a
process cannot speak for another pod. Nagle's algorithm is off: every hook waits for its
reply, and a small request held back for coalescing would cost the round trip tens of
milliseconds.

Standard library only (imported inside training processes).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from perseus_client import protocol

ADDRESS_ENV: Final = "PERSEUS_AGENT_ADDRESS"
TCP_SCHEME: Final = "tcp://"
_CONNECT_RETRY_S: Final = 0.002
"""Pause between connection attempts while the agent's backlog is full (within the timeout)."""
UNIX_SCHEME: Final = "unix://"


class AddressError(ValueError):
    """``$PERSEUS_AGENT_ADDRESS`` (or an address given in code) cannot be parsed."""


@dataclass(frozen=True)
class AgentAddress:
    """A Unix socket path (``port`` is ``None``) or a TCP host and port."""

    host_or_path: str
    port: int | None = None

    @property
    def is_tcp(self) -> bool:
        return self.port is not None

    def __str__(self) -> str:
        if self.port is None:
            return self.host_or_path
        host = self.host_or_path
        return (
            f"{TCP_SCHEME}[{host}]:{self.port}"
            if ":" in host
            else f"{TCP_SCHEME}{host}:{self.port}"
        )


def parse_address(text: str) -> AgentAddress:
    """``tcp://HOST:PORT`` (IPv6 as ``[addr]``), ``unix:///path`` or a bare socket path."""
    text = text.strip()
    if text.startswith(UNIX_SCHEME):
        path = text[len(UNIX_SCHEME) :]
        if not path:
            raise AddressError(f"agent address {text!r}: unix:// needs a socket path")
        return AgentAddress(path)
    if not text.startswith(TCP_SCHEME):
        if "://" in text:
            raise AddressError(
                f"agent address {text!r}: only tcp://HOST:PORT and unix:///path are supported"
            )
        if not text:
            raise AddressError("agent address is empty")
        return AgentAddress(text)
    rest = text[len(TCP_SCHEME) :]
    host, sep, port_text = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise AddressError(
            f"agent address {text!r}: expected tcp://HOST:PORT with a port in 1..65535 "
            "(an unexpanded $(VAR) means the pod lacks the variable it names)"
        )
    return AgentAddress(host, int(port_text))


def address_from_env(env: Mapping[str, str]) -> AgentAddress:
    """The agent's address from the environment (see the module)."""
    explicit = env.get(ADDRESS_ENV)
    if explicit:
        return parse_address(explicit)
    return AgentAddress(env.get(protocol.SOCKET_ENV) or protocol.DEFAULT_SOCKET_PATH)


def open_socket(address: AgentAddress) -> socket.socket:
    """An unconnected stream socket of the address's family (the caller connects it)."""
    if address.port is None:
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    family = socket.AF_INET6 if ":" in address.host_or_path else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def target(address: AgentAddress) -> str | tuple[str, int]:
    """What ``socket.connect`` takes for ``address``."""
    return address.host_or_path if address.port is None else (address.host_or_path, address.port)


def connect(address: AgentAddress, timeout_s: float) -> socket.socket:
    """A socket connected to ``address`` within ``timeout_s``, retried while the agent's listen
    backlog is full.

    Raises:
        OSError: The agent cannot be reached (the last attempt's error).
        ValueError: The socket path has an embedded NUL.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        sock = open_socket(address)
        try:
            sock.settimeout(timeout_s)
            sock.connect(target(address))
            return sock
        except BlockingIOError:
            # EAGAIN: the agent's listen backlog is full, e.g. while it sheds a flood of
            # connections; that passes in milliseconds, a retry interval is 30 s.
            sock.close()
            if time.monotonic() + _CONNECT_RETRY_S >= deadline:
                raise
            time.sleep(_CONNECT_RETRY_S)
        except BaseException:
            sock.close()
            raise
