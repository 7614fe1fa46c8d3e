"""The loopback guard (support.loopback_guard) on real processes: which descendants of a process
hold a listener it does not allow, through children and grandchildren. No test here listens off
loopback (the rule the guard enforces): the guard is told to allow 127.0.0.1 only, and a child
listens on 127.0.0.2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from ipaddress import IPv4Address

import pytest

from support.loopback_guard import Address, Sampler, describe, is_loopback, scan

# A child that listens on argv[1] (port 0), says "pid port", and holds on until stdin closes.
LISTENER = (
    "import os, socket, sys\n"
    "s = socket.socket(socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET)\n"
    "s.bind((sys.argv[1], 0)); s.listen()\n"
    "print(os.getpid(), s.getsockname()[1], flush=True)\n"
    "sys.stdin.read()\n"
)


def strict(address: Address) -> bool:
    """Loopback less 127.0.0.2: a guard that catches a child listening there."""
    return is_loopback(address) and address != IPv4Address("127.0.0.2")


@contextmanager
def listening_child(host: str, nested: bool = False) -> Iterator[tuple[int, int]]:
    """(pid, port) of a child (with ``nested``: a grandchild, under sh) listening on ``host``;
    stopped on exit."""
    argv = [sys.executable, "-c", LISTENER, host]
    if nested:  # "; exit": sh forks python rather than exec it
        argv = ["sh", "-c", '"$0" "$@"; exit $?', *argv]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        assert proc.stdout is not None
        pid_text, port = proc.stdout.readline().split()
        pid = int(pid_text)
        assert (pid != proc.pid) == nested
        yield pid, int(port)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the listener's EOF: it exits (and sh after it)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            if pid is not None and pid != proc.pid:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("nested", [False, True], ids=["child", "grandchild"])
def test_reports_a_descendant_listening_where_it_may_not(nested: bool) -> None:
    with listening_child("127.0.0.2", nested) as (pid, port):
        found = scan(os.getpid(), allowed=strict)
    assert [(x.pid, x.address) for x in found if x.pid == pid] == [(pid, f"127.0.0.2:{port}")]
    assert all(x.command.startswith(sys.executable) for x in found if x.pid == pid)


def test_ignores_a_descendant_listening_where_it_may() -> None:
    with listening_child("127.0.0.1", nested=True) as (pid, _):
        assert [x for x in scan(os.getpid(), allowed=strict) if x.pid == pid] == []
    with listening_child("127.0.0.2") as (pid, _):  # the session's guard allows all loopback
        assert [x for x in scan(os.getpid()) if x.pid == pid] == []


def test_ignores_other_trees() -> None:
    """A listener outside the root's tree is not the root's."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with listening_child("127.0.0.2") as (pid, _):
            assert [x for x in scan(sleeper.pid, allowed=strict) if x.pid == pid] == []
            assert [x.pid for x in scan(os.getpid(), allowed=strict) if x.pid == pid] == [pid]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sampler_keeps_what_it_saw_after_the_process_ends() -> None:
    sampler = Sampler(os.getpid(), interval_s=0.05, allowed=strict).start()
    with listening_child("127.0.0.2") as (pid, port):
        time.sleep(0.3)  # a few scans
    found = sampler.stop()  # its last scan sees the child no more
    address = f"127.0.0.2:{port}"
    assert [(x.pid, x.address) for x in found if x.pid == pid] == [(pid, address)]
    assert f"pid {pid} listened on {address} (not loopback): {sys.executable}" in describe(found)
