"""Writing a command's output files as one set: all new, or (on any failure) all old.

A plan is read together with its frontier; writing them one after the other meant that a
full disk could replace ``frontier.csv`` and then fail on ``plan.json``, leaving a new
frontier beside an old plan. Here every file is first written to a temporary sibling in the
same directory (same filesystem, so the final renames cannot run out of space), and only
when all are complete are they renamed over the old ones.

Also what every command that writes files shares: its ``--out DIR`` and ``--force`` options
(:func:`add_out_dir_arguments`), the check of that directory before any work
(:func:`prepare_out_dir`) and the writer of a model as JSON (:func:`json_writer`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_cli import CliError

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = [
    "Output",
    "add_out_dir_arguments",
    "json_writer",
    "prepare_out_dir",
    "temporary_sibling",
    "write_together",
]

log = logging.getLogger(__name__)

Output = tuple[Path, Callable[[Path], object]]
"""A file to write and the function that writes its content to the (temporary) path given."""


def add_out_dir_arguments(group: argparse._ActionsContainer, default: Path) -> None:
    """``--out DIR`` and ``--force``, the output directory of a command that writes files."""
    group.add_argument(
        "--out",
        type=Path,
        default=default,
        metavar="DIR",
        help="directory to write into (default: %(default)s)",
    )
    group.add_argument(
        "--force", action="store_true", help="write into DIR even if it is not empty"
    )


def prepare_out_dir(out_dir: Path, *, force: bool) -> None:
    """Create ``out_dir``, or check that it is a directory to write into (empty, or ``force``)."""
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise CliError(f"--out {out_dir} exists and is not a directory")
        if out_dir.is_dir() and not force and any(out_dir.iterdir()):
            raise CliError(
                f"output directory {out_dir} is not empty; pass --force to write into it "
                "(existing frontier.csv, plan.json and frontier.png are replaced)"
            )
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot use output directory {out_dir}: {exc.strerror or exc}") from exc


def json_writer(model: BaseModel) -> Callable[[Path], object]:
    """An output's writer: ``model`` as indented JSON."""
    return lambda tmp: tmp.write_text(model.model_dump_json(indent=2) + "\n")


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
