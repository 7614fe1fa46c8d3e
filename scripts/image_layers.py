"""Check that an edit of the docs changed no dependency layer of an image (build_images.sh).

Given ``buildah inspect --type image`` of an image built from the repository and of the same
target built from a copy with README.md edited (it is the wheel's long description, so it
reaches the project's layer), the two must share every layer but the last: the one of the
project's own files (the Dockerfile's ``COPY --from=<target>-app /out/ /``). That last layer
must differ, or the edit never reached the build and the check proves nothing.

Usage: ``python image_layers.py BEFORE.json AFTER.json TARGET`` (standard library only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def layers(inspect: dict[str, Any]) -> list[tuple[str, str]]:
    """(diff id, the history entry that made it) of each layer, bottom to top."""
    oci = inspect["OCIv1"]
    made = [h.get("created_by", "") for h in oci["history"] if not h.get("empty_layer")]
    diff_ids: list[str] = oci["rootfs"]["diff_ids"]
    if len(made) != len(diff_ids):
        raise SystemExit(f"{len(diff_ids)} layers but {len(made)} history entries")
    return list(zip(diff_ids, made, strict=True))


def check(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What is wrong; empty when only the project's layer changed."""
    old, new = layers(before), layers(after)
    if len(old) != len(new):
        return [f"{len(old)} layers before the edit, {len(new)} after"]
    problems = []
    if not old[-1][1].rstrip().endswith(" in /"):
        problems.append(f"the top layer is not the project's COPY: {old[-1][1]!r}")
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a[0] != b[0]]
    problems += [f"layer {i} changed with a docs edit: {old[i][1][:120]!r}" for i in changed[:-1]]
    if changed[-1:] != [len(old) - 1]:
        problems.append("the project's layer did not change: the edit never reached the build")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    before, after = (json.loads(Path(p).read_text()) for p in argv[:2])
    problems = check(before, after)
    for problem in problems:
        print(f"{argv[2]}: {problem}", file=sys.stderr)
    if not problems:
        n = len(layers(before))
        print(f"  {argv[2]}: a README edit changed 1 layer of {n} (the project's); "
              f"dependencies {layers(before)[-2][0][:19]} unchanged")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
