"""Command-line interface of the Perseus planner (``perseus``).

Kept free of heavy imports: the planner (numpy, numba, scipy) and matplotlib load only when a
command needs them, so that ``perseus --help`` answers at once.
"""


class CliError(Exception):
    """A problem with the command line or the files it names, reported without a traceback."""


__all__ = ["CliError"]
