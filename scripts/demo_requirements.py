"""Print what ``make demo`` installs, one requirement per line: the project's dependencies and
its ``demo`` extra, read from ``pyproject.toml`` (standard library only: it runs before any
virtual environment exists).

The demo runs the CLI from the source tree (``PYTHONPATH=operator``), so no wheel of the
project is built; this keeps its requirements in the one place they are declared.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def demo_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    with pyproject.open("rb") as file:
        project = tomllib.load(file)["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["demo"]]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{line}\n" for line in demo_requirements()))
