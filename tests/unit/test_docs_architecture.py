"""docs/architecture.md's folder map names every package and subpackage of the source roots."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

MAP = REPO_ROOT / "docs" / "architecture.md"


def test_the_folder_map_names_every_package() -> None:
    packages = {
        f"{init.parent.relative_to(REPO_ROOT).as_posix()}/"
        for root in ("operator", "node_agent")
        for init in (REPO_ROOT / root).rglob("__init__.py")
    }
    mapped = set(re.findall(r"^\| `([\w/]+/)` \|", MAP.read_text(), re.MULTILINE))
    assert packages <= mapped, f"missing from the folder map: {sorted(packages - mapped)}"
    assert mapped <= packages, f"in the folder map but not a package: {sorted(mapped - packages)}"
