"""Run a built image's program from its root filesystem, as a container runtime would.

``scripts/build_images.sh`` leaves each image mounted (a buildah working container) and writes
a record of it (``record``: image, id, root filesystem, entrypoint, user, environment). From a
record, :func:`command` builds the argv that runs the image's entrypoint:

- in a mount namespace of its own (``unshare --mount``), the image's root filesystem under an
  overlay with a throw-away upper layer, so that mount points can be made, then remounted
  read-only (the chart sets ``readOnlyRootFilesystem``); a tmpfs on ``/tmp``; ``/proc``,
  ``/dev``, ``/sys`` and the host's ``/etc/hosts`` and ``/etc/resolv.conf``; the bind mounts
  asked for (a pod's volumes);
- ``chroot`` to it as the image's user, with the image's environment, so the process runs the
  image's Python, packages and entrypoint: what users deploy is what runs.

The host network is shared (as ``hostNetwork``): the tests' API server and ports on 127.0.0.1
are reachable. Each step ``exec``s the next, so the PID returned to the caller is the image's
program itself: signals reach it directly.

Standard library only: run by the build script with any Python 3.11 and imported by the tests
(``tests/support/image_process.py``).

Usage: ``buildah inspect --type image IMAGE | python image_run.py record --image IMAGE
--rootfs DIR --storage-conf FILE > record.json``;
``python image_run.py run RECORD.json [--bind SRC:DST[:ro]] [--env K=V] [--user U]
[--entrypoint PROG] -- ARGS``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST_FILES = ("/etc/hosts", "/etc/resolv.conf")


class ImageError(Exception):
    """The image's record or root filesystem is missing or unusable."""


@dataclass(frozen=True)
class Bind:
    source: Path
    target: str
    read_only: bool = False


def record(
    inspect: Mapping[str, Any], image: str, rootfs: str, storage_conf: str
) -> dict[str, Any]:
    """What the tests need of an image, from ``buildah inspect --type image``."""
    config = inspect["OCIv1"]["config"]
    return {
        "image": image,
        "id": inspect.get("FromImageID", ""),
        "digest": inspect.get("FromImageDigest", ""),
        "rootfs": rootfs,
        "storage_conf": storage_conf,
        "entrypoint": config.get("Entrypoint") or [],
        "cmd": config.get("Cmd") or [],
        "user": config.get("User") or "0:0",
        "env": config.get("Env") or [],
        "working_dir": config.get("WorkingDir") or "/",
        "exposed_ports": sorted(config.get("ExposedPorts") or {}),
        "labels": config.get("Labels") or {},
        "layers": inspect["OCIv1"]["rootfs"]["diff_ids"],
    }


def load(path: Path) -> dict[str, Any]:
    """A record written by ``build_images.sh``; fails if its root filesystem is gone (after a
    reboot the working containers are unmounted: run the script again)."""
    try:
        rec: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ImageError(
            f"{path}: no image record: build the images (scripts/build_images.sh)"
        ) from None
    if not (Path(rec["rootfs"]) / "usr").is_dir():
        raise ImageError(
            f"{rec['image']}: its root filesystem {rec['rootfs']} is not mounted: "
            "run scripts/build_images.sh again"
        )
    return rec


def _home(rootfs: Path, uid: str) -> str:
    """The user's home from the image's /etc/passwd, ``/`` when it has none (as runtimes do)."""
    try:
        for line in (rootfs / "etc" / "passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) > 5 and fields[2] == uid:
                return fields[5]
    except OSError:
        pass
    return "/"


def environment(rec: Mapping[str, Any], user: str, extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(e.split("=", 1) for e in rec["env"])
    env.setdefault("HOME", _home(Path(rec["rootfs"]), user.split(":")[0]))
    env.update(extra)
    return env


def command(
    rec: Mapping[str, Any],
    args: Sequence[str] | None = None,
    *,
    binds: Sequence[Bind] = (),
    scratch: Path,
    user: str | None = None,
    entrypoint: Sequence[str] | None = None,
    tmpfs: Sequence[str] = ("/tmp",),
) -> list[str]:
    """The argv that runs the image's program (``entrypoint`` + ``args``, by default the
    image's own: ENTRYPOINT + CMD) as ``user`` (default: the image's USER). ``scratch``: an
    empty directory of the host, mounted over inside the namespace (nothing is written to it)."""
    if rec["working_dir"] not in ("", "/"):
        raise ImageError(f"{rec['image']}: WORKDIR {rec['working_dir']} is not supported")
    user = user or rec["user"]
    if ":" not in user:
        user = f"{user}:{user}"
    argv = [*(rec["entrypoint"] if entrypoint is None else entrypoint)]
    argv += list(rec["cmd"] if args is None else args)
    root = f"{scratch}/root"
    q = shlex.quote
    lines = [
        "set -eu",
        f"mount -t tmpfs -o size=16m,mode=0755 scratch {q(str(scratch))}",
        f"mkdir {q(f'{scratch}/upper')} {q(f'{scratch}/work')} {q(root)}",
        f"mount -t overlay overlay -o lowerdir={rec['rootfs']},upperdir={scratch}/upper,"
        f"workdir={scratch}/work {q(root)}",
        f"mount -t proc proc {q(root)}/proc",
        f"mount --rbind /dev {q(root)}/dev",
        f"mount --rbind /sys {q(root)}/sys",
    ]
    for path in tmpfs:
        lines += [
            f"mkdir -p {q(root + path)}",
            f"mount -t tmpfs -o mode=1777,size=512m tmpfs {q(root + path)}",
        ]
    for host_file in HOST_FILES:
        if Path(host_file).exists():
            lines += [
                f"touch {q(root + host_file)}",
                f"mount --bind {host_file} {q(root + host_file)}",
            ]
    for bind in binds:
        target = q(root + bind.target)
        parent = q(root + str(Path(bind.target).parent))
        make = (
            f"mkdir -p {target}" if bind.source.is_dir() else f"mkdir -p {parent}; touch {target}"
        )
        lines += [make, f"mount --bind {q(str(bind.source))} {target}"]
        if bind.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    lines += [
        f"mount -o remount,ro {q(root)}",
        f"exec chroot --userspec={q(user)} {q(root)} " + " ".join(q(a) for a in argv),
    ]
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    return [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", "\n".join(lines)]


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    rec_p = sub.add_parser("record", help="write an image's record (JSON) from buildah inspect")
    rec_p.add_argument("--image", required=True)
    rec_p.add_argument("--rootfs", required=True)
    rec_p.add_argument("--storage-conf", required=True)
    run_p = sub.add_parser("run", help="run the image's entrypoint from its root filesystem")
    run_p.add_argument("record", type=Path)
    run_p.add_argument("--bind", action="append", default=[], help="SRC:DST[:ro]")
    run_p.add_argument("--env", action="append", default=[], help="NAME=VALUE")
    run_p.add_argument("--user")
    run_p.add_argument("--entrypoint")
    # The program's arguments follow "--" (argparse mishandles it after a subcommand).
    rest: list[str] = []
    if "--" in argv:
        argv, rest = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    ns = parser.parse_args(argv)
    ns.args = rest
    if ns.what == "record":
        json.dump(record(json.load(sys.stdin), ns.image, ns.rootfs, ns.storage_conf), sys.stdout)
        print()
        return 0
    rec = load(ns.record)
    binds = []
    for spec in ns.bind:
        src, dst, *ro = spec.split(":")
        binds.append(Bind(Path(src).resolve(), dst, ro == ["ro"]))
    scratch = Path(tempfile.mkdtemp(prefix="perseus-image-run-"))
    user = ns.user or rec["user"]
    argv_ = command(
        rec,
        ns.args if (ns.args or ns.entrypoint) else None,
        binds=binds,
        scratch=scratch,
        user=user,
        entrypoint=None if ns.entrypoint is None else [ns.entrypoint],
    )
    env = environment(rec, user, dict(e.split("=", 1) for e in ns.env))
    proc = subprocess.Popen(argv_, env=env)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _: proc.send_signal(number))
    code = proc.wait()
    scratch.rmdir()
    return code


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
