"""The installed version of the project, for every console script's ``--version``."""

from __future__ import annotations

from importlib import metadata

__all__ = ["DISTRIBUTION", "distribution_version"]

DISTRIBUTION = "perseus-k8s"


def distribution_version() -> str:
    """The version of ``perseus-k8s`` installed, or a note that it is run from a source tree."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "(not installed)"
