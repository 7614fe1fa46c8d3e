"""Cut the project's wheel down to one image's component (run inside the image build).

The perseus-k8s wheel holds every package of the repository and three console scripts. An
image gets only what its program imports, so that no console script there fails for want of
its dependencies and no unused code ships:

- ``operator``: perseus_api, perseus_planner, perseus_operator; ``perseus-operator``
- ``agent``: perseus_api, perseus_agent, perseus_client; ``perseus-node-agent``; and the
  bundled profiles (``perseus_planner/profiles/``, data only: no planner code), which the
  chart's emulated GPUs run on by default

The cut wheel keeps the distribution's name and version; its RECORD is written anew, and its
zip entries are sorted and dated 1980-01-01, so the same input gives the same bytes.

Usage: ``python image_wheel.py COMPONENT WHEEL OUT_DIR`` (standard library only).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path

COMPONENTS = {
    "operator": (("perseus_api", "perseus_planner", "perseus_operator"), ("perseus-operator",)),
    "agent": (("perseus_api", "perseus_agent", "perseus_client"), ("perseus-node-agent",)),
}
DATA = {"operator": (), "agent": ("perseus_planner/profiles/",)}
"""Folders of other packages kept as data (no module of theirs)."""
EPOCH = (1980, 1, 1, 0, 0, 0)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def _entry_points(text: str, scripts: tuple[str, ...]) -> str:
    """``entry_points.txt`` with only ``scripts`` in its console_scripts section."""
    out, section = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped
        elif (
            section == "[console_scripts]"
            and stripped
            and stripped.split("=", 1)[0].strip() not in scripts
        ):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def cut(component: str, wheel: Path, out_dir: Path) -> Path:
    packages, scripts = COMPONENTS[component]
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (dist_info,) = {n.split("/", 1)[0] for n in names if ".dist-info/" in n}
        for name in names:
            top = name.split("/", 1)[0]
            data = name.startswith(DATA[component]) and not name.endswith(".py")
            if top in packages or data or (top == dist_info and not name.endswith("/RECORD")):
                files[name] = zf.read(name)
    missing = [p for p in packages if not any(n.startswith(f"{p}/") for n in files)]
    if missing:
        raise SystemExit(f"{wheel.name}: no package {', '.join(missing)}")
    entry_points = f"{dist_info}/entry_points.txt"
    files[entry_points] = _entry_points(files[entry_points].decode(), scripts).encode()
    files[f"{dist_info}/top_level.txt"] = "".join(f"{p}\n" for p in sorted(packages)).encode()

    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name in sorted(files):
        writer.writerow([name, _record_hash(files[name]), len(files[name])])
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    files[f"{dist_info}/RECORD"] = record.getvalue().encode()

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        # dist-info last, as wheels are written
        for name in sorted(files, key=lambda n: (n.startswith(dist_info), n)):
            info = zipfile.ZipInfo(name, EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, files[name])
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in COMPONENTS:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    print(cut(argv[0], Path(argv[1]), Path(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
