"""Writing a command's output files as one set: all new, or (on any failure) all old.

A plan is read together with its frontier; writing them one after the other meant that a
full disk could replace ``frontier.csv`` and then fail on ``plan.json``, leaving a new
frontier beside an old plan. Here every file is first written to a temporary sibling in the
same directory (same filesystem, so the final renames cannot run out of space), and only
when all are complete are they renamed over the old ones.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

from perseus_cli import CliError

__all__ = ["Output", "temporary_sibling", "write_together"]

log = logging.getLogger(__name__)

Output = tuple[Path, Callable[[Path], object]]
"""A file to write and the function that writes its content to the (temporary) path given."""


def temporary_sibling(path: Path) -> Path:
    """A hidden, unique name next to ``path`` (kept out of globs such as ``*.csv``)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def write_together(outputs: Sequence[Output], stale: Sequence[Path] = ()) -> None:
    """Write every output, then rename them all into place and remove ``stale`` files.

    Raises:
        CliError: A write failed (nothing was replaced; the message names the file and says
            so) or a rename failed (the message says which files are new).
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for path, write in outputs:
            tmp = temporary_sibling(path)
            staged.append((tmp, path))
            try:
                write(tmp)
            except OSError as exc:
                raise CliError(
                    f"cannot write {path}: {exc.strerror or exc}; no output in {path.parent} "
                    "was replaced"
                ) from exc
        replaced: list[Path] = []
        for tmp, path in staged:
            try:
                tmp.replace(path)
            except OSError as exc:
                done = ", ".join(p.name for p in replaced) or "none"
                raise CliError(
                    f"cannot rename {tmp} to {path}: {exc.strerror or exc}; already replaced: "
                    f"{done}"
                ) from exc
            replaced.append(path)
        for path in stale:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise CliError(
                    f"cannot remove {path}, left from an earlier run: {exc.strerror or exc}"
                ) from exc
    finally:
        # After success the temporary names are gone already; after a failure they must not
        # be left to fill the disk that has just run out.
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    for path, _ in outputs:
        log.info("wrote %s", path)
