"""Entry point of the ``perseus`` command.

Each subcommand lives in its own module with ``add_parser(subparsers)``, which registers its
options and sets ``handler``; adding ``simulate`` or ``demo`` means adding a module to
``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from perseus_cli import CliError, plan_command, profile_plan_command, simulate_command

PROG = "perseus"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

_COMMANDS = (plan_command, profile_plan_command, simulate_command)
_DISTRIBUTION = "perseus-k8s"
_PACKAGES = ("perseus_cli", "perseus_planner", "perseus_api")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Perseus: remove energy bloat from large-model training (SOSP 2024).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log what happens to stderr (-vv for debug detail)",
    )
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``perseus`` with ``argv`` (default: the process arguments); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors; tests call main directly
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    # Only once a command runs, when perseus_api (pydantic) is about to load anyway: `perseus
    # --help` imports neither. `plan --no-plot` draws nothing, so it runs without matplotlib.
    from perseus_api.extras import check_extra

    extra = "planner" if getattr(args, "no_plot", False) else "cli"
    # Without numba the solver's kernels run as plain Python (perseus_planner._jit): slower,
    # same results; `make demo` installs none.
    if (missing_extra := check_extra(PROG, extra, optional=("numba",))) is not None:
        return missing_extra
    _configure_logging(args.verbose)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CliError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    except ValueError as exc:
        # Imported only here because loading the planner is what makes startup slow; any
        # command that can raise one of these has loaded them already.
        from perseus_api.errors import ApiError
        from perseus_planner.errors import PlannerError

        if isinstance(exc, PlannerError | ApiError):
            return _fail(str(exc))
        raise


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _configure_logging(verbosity: int) -> None:
    if verbosity <= 0:
        return
    # Only our packages get chattier: numba's debug logging would bury everything else.
    logging.basicConfig(format=f"{PROG}: %(levelname)s: %(message)s", level=logging.WARNING)
    level = logging.INFO if verbosity == 1 else logging.DEBUG
    for package in _PACKAGES:
        logging.getLogger(package).setLevel(level)


def _version() -> str:
    try:
        return metadata.version(_DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        return "(not installed)"


if __name__ == "__main__":
    sys.exit(main())
