"""Finds TCP listeners off loopback among a process's descendants (the tests' house rule).

Every server a test starts must bind to 127.0.0.1 only: the machine's other addresses may face
a network. What a process was told to bind to proves nothing (torch's TCPStore listens on every
address whatever host it is given), so this reads what the kernel reports: the listening
sockets of /proc/net/tcp{,6}, and which processes hold them (/proc/<pid>/fd). Linux only;
without /proc it finds nothing. A sampler polls, so a listener that lives for less than one
interval may go unseen, and so may a process that daemonizes out of the tree.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path
from typing import Literal

PROC = Path("/proc")
LISTEN = "0A"  # TCP_LISTEN in the st column
# A process (or its fd table) can vanish, or hide, between listing it and reading it.
GONE = (FileNotFoundError, ProcessLookupError, PermissionError)
Address = IPv4Address | IPv6Address


@dataclass(frozen=True, order=True)
class Listener:
    """A process that was seen listening on a non-loopback address."""

    pid: int
    address: str  # "0.0.0.0:29500", "[::]:29500"
    command: str


def parse_address(
    field: str, byteorder: Literal["little", "big"] = sys.byteorder
) -> tuple[IPv4Address | IPv6Address, int]:
    """``0100007F:0CEA`` -> (127.0.0.1, 3306). The kernel prints the address as 32-bit words
    (one for tcp, four for tcp6), each in the host's byte order; the port as a plain number."""
    hex_address, hex_port = field.split(":")
    raw = b"".join(
        int(hex_address[i : i + 8], 16).to_bytes(4, byteorder)
        for i in range(0, len(hex_address), 8)
    )
    address = IPv4Address(raw) if len(raw) == 4 else IPv6Address(raw)
    return address, int(hex_port, 16)


def is_loopback(address: Address) -> bool:
    """127.0.0.0/8, ::1, or ::ffff:127.x (which Python 3.11 does not count as loopback)."""
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def off_loopback(
    lines: list[str],
    byteorder: Literal["little", "big"] = sys.byteorder,
    allowed: Callable[[Address], bool] = is_loopback,
) -> dict[int, str]:
    """Socket inode -> ``address:port`` of the listeners off loopback (not ``allowed``) in
    /proc/net/tcp{,6} lines (a header line is skipped)."""
    found = {}
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or fields[3] != LISTEN:  # the header, or not listening
            continue
        address, port = parse_address(fields[1], byteorder)
        if not allowed(address):
            host = f"[{address}]" if address.version == 6 else str(address)
            found[int(fields[9])] = f"{host}:{port}"
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # GONE among others
        return ""


def descendants(root: int, proc: Path = PROC) -> set[int]:
    """``root`` and every process below it (the ppid in /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            after_comm = _read(entry / "stat").rpartition(")")[2].split()
            if len(after_comm) > 1:
                children.setdefault(int(after_comm[1]), []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _socket_inodes(pid: int, proc: Path) -> set[int]:
    inodes = set()
    try:
        for fd in (proc / str(pid) / "fd").iterdir():
            try:
                target = str(fd.readlink())
            except GONE:  # closed since listed
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except GONE:
        pass
    return inodes


def scan(
    root: int, proc: Path = PROC, allowed: Callable[[Address], bool] = is_loopback
) -> set[Listener]:
    """The listeners off loopback (not ``allowed``) that ``root`` or its descendants hold now.
    ``allowed`` narrower than loopback lets this guard's own tests prove it on real sockets
    without ever listening off loopback."""
    lines = [*_read(proc / "net" / "tcp").splitlines(), *_read(proc / "net" / "tcp6").splitlines()]
    listeners = off_loopback(lines, allowed=allowed)
    if not listeners:  # nothing off loopback at all: no process to look at
        return set()
    found = set()
    for pid in descendants(root, proc):
        for inode in _socket_inodes(pid, proc) & listeners.keys():
            command = " ".join(_read(proc / str(pid) / "cmdline").replace("\0", " ").split())
            found.add(Listener(pid, listeners[inode], command[:300] or "?"))
    return found


class Sampler:
    """Scans (:func:`scan`) every ``interval_s`` from a daemon thread until :meth:`stop`,
    keeping every listener it saw (processes come and go between scans: a final scan alone
    would miss them)."""

    def __init__(
        self,
        root: int,
        interval_s: float = 0.5,
        proc: Path = PROC,
        allowed: Callable[[Address], bool] = is_loopback,
    ) -> None:
        self.root, self.interval_s, self.proc, self.allowed = root, interval_s, proc, allowed
        self._found: set[Listener] = set()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loopback-guard", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while True:
                self._found |= scan(self.root, self.proc, self.allowed)
                if self._stopping.wait(self.interval_s):
                    return
        except BaseException as e:  # raised again by stop(): a guard that died says so
            self._error = e

    def stop(self) -> set[Listener]:
        """Stops the thread (after one last scan) and returns what it found."""
        self._stopping.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the loopback guard's sampler failed") from self._error
        self._found |= scan(self.root, self.proc, self.allowed)
        return set(self._found)


def describe(found: set[Listener]) -> str:
    """One line per listener, for a test failure."""
    return "\n".join(
        f"pid {x.pid} listened on {x.address} (not loopback): {x.command}" for x in sorted(found)
    )
