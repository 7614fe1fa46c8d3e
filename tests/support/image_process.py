"""The built container images, for tests that run the operator and the agent from them.

``scripts/build_images.sh`` (``make images``; CI runs it) builds both images, leaves each root
filesystem mounted and records it in ``~/.cache/perseus-k8s/images/<target>.json`` (override
the folder with ``PERSEUS_IMAGES_DIR``). :func:`image` returns that record, and
:func:`image_command` the argv and environment that run the image's entrypoint from it
(``scripts/image_run.py``: read-only root, tmpfs ``/tmp``, the image's user and environment,
the host network), so that the end-to-end tests run what users deploy.

Without built images :func:`image` returns None (the tests then run the sources) and, under
``PERSEUS_REQUIRE_E2E=1`` (CI), fails the test instead.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
OPERATOR, NODE_AGENT = "operator", "node-agent"


def _image_run() -> ModuleType:
    """scripts/image_run.py (a script, standard library only, shared with the build)."""
    name = "perseus_image_run"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / "image_run.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def images_dir() -> Path:
    default = Path.home() / ".cache" / "perseus-k8s" / "images"
    return Path(os.environ.get("PERSEUS_IMAGES_DIR", default))


def image(target: str) -> dict[str, Any] | None:
    """The record of the built ``target`` image (``operator`` or ``node-agent``); None when
    none is built, or a test failure under ``PERSEUS_REQUIRE_E2E=1``."""
    run = _image_run()
    try:
        record: dict[str, Any] = run.load(images_dir() / f"{target}.json")
    except run.ImageError as exc:
        if os.environ.get("PERSEUS_REQUIRE_E2E") == "1":
            pytest.fail(f"end-to-end prerequisite missing (PERSEUS_REQUIRE_E2E=1): {exc}")
        return None
    return record


def kubeconfig_files(kubeconfig: Path) -> list[Path]:
    """The kubeconfig and the files it names (CA, client certificate and key, token file): what
    to share with a process of the image, file by file. (Its folder would not do: pytest's
    temporary folders are root's, mode 0700, which the operator's user cannot enter; a pod's
    projected token is readable by it.)"""
    config = yaml.safe_load(kubeconfig.read_text()) or {}
    named = [
        entry.get(kind, {}).get(key)
        for section, kind in (("clusters", "cluster"), ("users", "user"))
        for entry in config.get(section) or ()
        for key in ("certificate-authority", "client-certificate", "client-key", "tokenFile")
    ]
    return [kubeconfig, *(Path(p) for p in named if p)]


def image_command(
    record: Mapping[str, Any],
    args: Sequence[str],
    *,
    scratch: Path,
    env: Mapping[str, str],
    shared: Sequence[Path] = (),
    writable: Sequence[Path] = (),
    entrypoint: Sequence[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) running the image's entrypoint (or ``entrypoint``, as a pod's
    ``command`` does) with ``args``, the image's environment plus ``env`` (a pod's), and the
    host files or folders ``shared`` at the same paths, read-only (kubeconfigs and
    certificates: :func:`kubeconfig_files`), and ``writable`` ones writable (a pod's volumes:
    sockets, state).
    ``scratch``: an empty folder of the host, mounted over in the namespace only."""
    run = _image_run()
    scratch.mkdir(parents=True, exist_ok=True)
    # Shared files are handed over as a kubelet mounts a secret or a projected token: copies,
    # readable by the image's user (the harness writes kubeconfigs 0600, as root).
    volumes = scratch.with_name(f"{scratch.name}-volumes")
    volumes.mkdir(mode=0o755, exist_ok=True)
    binds = []
    for i, path in enumerate(shared):
        source = path
        if path.is_file():
            source = volumes / f"{i}-{path.name}"
            shutil.copyfile(path, source)
            source.chmod(0o644)
        binds.append(run.Bind(source, str(path), read_only=True))
    binds += [run.Bind(path, str(path)) for path in writable]
    argv = run.command(record, args, binds=binds, scratch=scratch, entrypoint=entrypoint)
    environment: dict[str, str] = run.environment(record, record["user"], env)
    return argv, environment
