"""Who a training process is, read from its container's environment.

The rank, local rank and pod come from the variables the launchers and the downward API set
(``RANK``, ``LOCAL_RANK``, ``POD_NAME``, ...); the GPUs from the UUIDs the NVIDIA device
plugin puts in ``NVIDIA_VISIBLE_DEVICES`` (else ``CUDA_VISIBLE_DEVICES``). Standard library
only (imported inside training processes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

_UUID_PREFIXES: Final = ("GPU-", "MIG-")


def env_int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key, "").strip()
    try:
        number = int(value)
    except ValueError:
        return None
    return number if number >= 0 else None


def env_str(env: Mapping[str, str], key: str) -> str | None:
    return env.get(key) or None


def gpu_uuids_from_env(env: Mapping[str, str] | None = None) -> list[str]:
    """GPU UUIDs of this container: ``NVIDIA_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES``.

    A variable counts only when every entry is a UUID (``GPU-...`` or ``MIG-...``),
    as the NVIDIA device plugin sets it; indices, ``all`` or ``none`` give nothing.
    """
    env = os.environ if env is None else env
    for key in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        entries = [e.strip() for e in env.get(key, "").split(",") if e.strip()]
        if entries and all(e.startswith(_UUID_PREFIXES) for e in entries):
            return entries
    return []
