"""The file of the training-process socket: created with its access control, removed after.

Access control. Whoever can connect to this socket can make the agent change
GPU clocks, which slows down (or speeds up, at a power cost) every job on those
GPUs. So the socket is ``0o660`` (owner and ``socket_group`` only, never
others) and a directory the server creates is ``0o750``. Training pods get
access by running with ``socket_group`` among their supplementary groups
(``securityContext.supplementalGroups``), not by being privileged. The socket
is bound under a temporary name, given its mode and group, and only then
renamed into place, so there is no moment at which it is open to everyone.

A stale socket left by a crashed agent is removed; a live one (something accepts connections
there) or a file that is not a socket is an error. Only the socket file this agent created is
removed (another agent's, bound at the same path since, is left alone).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Final

from perseus_agent.errors import AgentError

__all__ = [
    "DEFAULT_SOCKET_MODE",
    "DIRECTORY_MODE",
    "MAX_SOCKET_PATH_BYTES",
    "LocalServerError",
    "SocketId",
    "bind_unix_socket",
    "unlink_socket",
]

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH_BYTES: Final = 107
"""AF_UNIX paths are limited to 108 bytes with the terminating NUL."""

DEFAULT_SOCKET_MODE: Final = 0o660
DIRECTORY_MODE: Final = 0o750

_LISTEN_BACKLOG: Final = 1024

SocketId = tuple[int, int]
"""``(st_dev, st_ino)`` of a socket file."""


class LocalServerError(AgentError):
    """The socket cannot be served (path taken by a file or a live agent, bad permissions, ...)."""


def bind_unix_socket(path: Path, mode: int, group: int | None) -> tuple[socket.socket, SocketId]:
    """A socket listening at ``path`` with ``mode`` and ``group`` (``None``: the agent's), and
    the identity of its file; the directory is created (``0o750``, ``group``) if missing. An
    existing directory (e.g. a hostPath the kubelet created) is left as it is: training pods
    must be able to traverse it.

    Raises:
        LocalServerError: The socket cannot be created there.
    """
    _prepare_directory(path.parent, group)
    _remove_stale(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if len(os.fsencode(tmp)) > MAX_SOCKET_PATH_BYTES:
        tmp = path.with_name(f".{os.getpid()}.tmp")
    if len(os.fsencode(tmp)) > MAX_SOCKET_PATH_BYTES:
        raise LocalServerError(f"directory path of {path} too long for a temporary socket")
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(tmp).st_mode):
            tmp.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(tmp))
        try:
            tmp.chmod(mode)
            if group is not None:
                os.chown(tmp, -1, group)
            # Room for bursts: a client finding the backlog full fails its connect at once.
            sock.listen(_LISTEN_BACKLOG)
            tmp.replace(path)  # only now reachable under its real name
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        st = os.lstat(path)
        socket_id = (st.st_dev, st.st_ino)
    except OSError as exc:
        sock.close()
        raise LocalServerError(f"cannot create socket {path}: {exc}") from exc
    return sock, socket_id


def unlink_socket(path: Path, socket_id: SocketId) -> None:
    """Remove the socket file at ``path`` if it is still the one ``socket_id`` names."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == socket_id:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove socket %s: %s", path, exc)


def _prepare_directory(directory: Path, group: int | None) -> None:
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=DIRECTORY_MODE)
    except FileExistsError:
        if not directory.is_dir():
            raise LocalServerError(f"{directory} exists and is not a directory") from None
        return
    except OSError as exc:
        raise LocalServerError(f"cannot create directory {directory}: {exc}") from exc
    try:
        directory.chmod(DIRECTORY_MODE)  # mkdir's mode is reduced by the umask
        if group is not None:
            os.chown(directory, -1, group)
    except OSError as exc:
        raise LocalServerError(f"cannot set up directory {directory}: {exc}") from exc


def _remove_stale(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise LocalServerError(
            f"{path} exists and is not a socket; refusing to remove it "
            "(check --socket-dir, or delete the file)"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(os.fspath(path))
    except ConnectionRefusedError:
        logger.info("removing stale socket %s left by an earlier agent", path)
        path.unlink(missing_ok=True)
        return
    except OSError as exc:
        raise LocalServerError(f"cannot check existing socket {path}: {exc}") from exc
    finally:
        probe.close()
    raise LocalServerError(f"another process is already serving on {path}")
