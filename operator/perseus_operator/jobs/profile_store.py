"""Reading the stored profile a job plans from, through the reconcile step's cluster I/O.

The order and the rules are :mod:`perseus_operator.jobs.profile_source`'s (pure); this module only
reads: the ConfigMaps, and the job's Nodes for their GPU product (once per set of nodes,
:class:`GpuProducts`, kept in the job's memo). The calls for shared profiles (a label-selected
ConfigMap list, the Node reads) are made only for jobs that name a ``profiling.model``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from perseus_api.job import PerseusJobSpec
from perseus_operator.jobs.profile_source import (
    PIPELINE_KEY,
    StoredProfile,
    choose_shared_profile,
    gpu_product,
    pipeline_key,
    read_profile,
    shared_profile_selector,
)


class ProfileIO(Protocol):
    """What finding a profile reads (:class:`~perseus_operator.jobs.job_observation.JobIO` has
    it)."""

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def list_config_maps(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    async def get_node(self, name: str) -> dict[str, Any] | None: ...


class GpuProducts:
    """The GPU product of a job's nodes (None: unknown or mixed), read once per set of nodes:
    a job waiting for a profile looks again at every tick, its nodes' labels need not be."""

    def __init__(self) -> None:
        self._nodes: tuple[str, ...] | None = None
        self._product: str | None = None

    async def of(self, io: ProfileIO, nodes: Sequence[str]) -> str | None:
        key = tuple(sorted(set(nodes)))
        if key != self._nodes:
            self._product = gpu_product([await io.get_node(n) for n in key])
            self._nodes = key
        return self._product


@dataclass(frozen=True)
class Lookup:
    """A stored profile, if one fits; ``error`` when the job's ``profileRef`` cannot be read
    (the job fails with it)."""

    profile: StoredProfile | None
    error: str = ""


async def find_profile(
    io: ProfileIO,
    namespace: str,
    own_config_map: str,
    spec: PerseusJobSpec,
    nodes: Sequence[str],
    products: GpuProducts,
) -> Lookup:
    """The profile ``spec`` plans from: ``profileRef``; the job's own (``own_config_map``) if
    measured for the same pipeline; with ``profiling.model``, the newest one a job of that
    model stored for the pipeline on the GPU product of ``nodes``."""
    ref = spec.profiling.profile_ref
    if ref is not None:
        cm = await io.get_config_map(namespace, ref.config_map_name)
        if cm is None:
            return Lookup(None, f"profileRef: ConfigMap {ref.config_map_name} does not exist")
        found = read_profile(cm, ref.key, name=ref.config_map_name)
        if found is None:
            return Lookup(
                None, f"profileRef: ConfigMap {ref.config_map_name} has no key {ref.key!r}"
            )
        return Lookup(found)
    own = await io.get_config_map(namespace, own_config_map)
    if own is not None and (own.get("data") or {}).get(PIPELINE_KEY) == pipeline_key(spec):
        found = read_profile(own, name=own_config_map)
        if found is not None:
            return Lookup(found)
    # Measured for another pipeline, or none: a shared one, else profile again.
    model = spec.profiling.model
    if model is None:
        return Lookup(None)
    product = await products.of(io, nodes)
    if product is None:
        return Lookup(None)
    shared = await io.list_config_maps(namespace, shared_profile_selector(model))
    return Lookup(
        choose_shared_profile(shared, model=model, product=product, pipeline=pipeline_key(spec))
    )
