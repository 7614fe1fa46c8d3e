"""Where a job's profile comes from, and whether the job may measure one: pure decisions.

A job plans from a stored profile when one fits, in this order: ``profiling.profileRef``; the
profile the job stored itself (ConfigMap ``<job>-profile``); with ``profiling.model``, the
newest profile another job of the same model stored for the same pipeline on the same GPU
product. Without one, measuring it means sweeping every SM clock, which only modes that may
change clocks do (``Intrinsic``, ``StragglerAware``), or ``Observe`` when the job opts in
(``profiling.profileInObserve``). Otherwise the job waits, saying how to get a profile
(:func:`decide_start`).

Stored profiles are ConfigMaps with the planner's CSV (:data:`PROFILE_KEY`), the pipeline
they were measured for (:data:`PIPELINE_KEY`, see :func:`pipeline_key`) and the measured
blocking power; a job with a ``model`` labels the one it stores with :func:`profile_labels`,
which is how other jobs find it (:func:`choose_shared_profile`). The GPU product is the
``nvidia.com/gpu.product`` label that NVIDIA's GPU feature discovery puts on GPU nodes.

The reconcile step (:mod:`perseus_operator.jobs.lifecycle`) does the reading and writing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from perseus_api import resources
from perseus_api.job import Mode, PerseusJobSpec
from perseus_api.plan import Granularity
from perseus_api.schedule import Schedule

PROFILE_KEY: Final = "profile.csv"
BLOCKING_POWER_KEY: Final = "blockingPowerWatts"
PIPELINE_KEY: Final = "pipeline"
MODEL_LABEL: Final = f"{resources.GROUP}/profile-model"
"""On a stored profile: the ``profiling.model`` of the job that measured it."""
GPU_PRODUCT_LABEL: Final = f"{resources.GROUP}/gpu-product"
"""On a stored profile: the GPU product it was measured on."""
NODE_GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
"""Node label naming the node's GPU product (NVIDIA GPU feature discovery)."""


@dataclass(frozen=True)
class StoredProfile:
    """A profile to plan from."""

    csv_text: str
    blocking_power_w: float | None
    config_map: str
    """Name of the ConfigMap holding it."""


def pipeline_key(spec: PerseusJobSpec) -> str:
    """What a stored profile was measured for: the pipeline's stages (and clocks swept), and
    the profile's form where the schedule's is not one stage per GPU with whole backwards
    (virtual stages: ``P * V`` stages; ZB-H1: split backwards), so that a profile of one form
    is not reused for a job of another (keys of the other schedules are unchanged)."""
    p = spec.parallelism
    clamp = spec.policy.frequency_mhz
    span = f"{clamp.min_mhz}-{clamp.max_mhz}" if clamp else "default"
    key = f"stages={p.pipeline_stages};clocks={span};step={spec.profiling.frequency_step_mhz}"
    if p.virtual_stages > 1:
        key += f";virtualStages={p.virtual_stages}"
    elif Schedule.parse(p.schedule.value) is Schedule.ZB_H1:
        key += ";backward=split"
    return key


def read_profile(
    config_map: Mapping[str, Any], key: str = PROFILE_KEY, *, name: str | None = None
) -> StoredProfile | None:
    """The profile in ``config_map`` under ``key`` (None when there is no such key);
    ``name``: the ConfigMap's, when it was read by name (default: its metadata's)."""
    data = config_map.get("data") or {}
    csv_text = data.get(key)
    if not isinstance(csv_text, str):
        return None
    blocking = data.get(BLOCKING_POWER_KEY)
    try:
        blocking_w = float(blocking) if blocking else None
    except ValueError:
        blocking_w = None
    if name is None:
        name = str((config_map.get("metadata") or {}).get("name") or "")
    return StoredProfile(csv_text, blocking_w, name)


def gpu_product(nodes: Sequence[Mapping[str, Any] | None]) -> str | None:
    """The GPU product of all ``nodes`` (Node objects; None: unreadable), if they agree and
    each says (label :data:`NODE_GPU_PRODUCT_LABEL`); else None."""
    products = set()
    for node in nodes:
        labels = ((node or {}).get("metadata") or {}).get("labels") or {}
        product = labels.get(NODE_GPU_PRODUCT_LABEL) if isinstance(labels, Mapping) else None
        if not isinstance(product, str) or not product:
            return None
        products.add(product)
    return products.pop() if len(products) == 1 else None


def profile_labels(spec: PerseusJobSpec, product: str | None) -> dict[str, str]:
    """Labels of the profile a job stores: how jobs of the same model and GPU find it."""
    model = spec.profiling.model
    if model is None:
        return {}
    labels = {MODEL_LABEL: model}
    if product is not None:
        labels[GPU_PRODUCT_LABEL] = resources.label_value(product)
    return labels


def shared_profile_selector(model: str) -> str:
    """Label selector of the profiles stored for ``model`` (products are compared after)."""
    return f"{MODEL_LABEL}={model}"


def choose_shared_profile(
    config_maps: Sequence[Mapping[str, Any]],
    *,
    model: str,
    product: str | None,
    pipeline: str,
) -> StoredProfile | None:
    """The newest profile among ``config_maps`` measured for ``model`` on GPU ``product`` for
    the ``pipeline`` (:func:`pipeline_key`); None when none fits or the product is unknown
    (a profile of another GPU would plan clocks it does not have)."""
    if product is None:
        return None
    wanted = {MODEL_LABEL: model, GPU_PRODUCT_LABEL: resources.label_value(product)}
    fitting = []
    for cm in config_maps:
        metadata = cm.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if any(labels.get(k) != v for k, v in wanted.items()):
            continue
        if (cm.get("data") or {}).get(PIPELINE_KEY) != pipeline:
            continue
        profile = read_profile(cm)
        if profile is not None:
            fitting.append((str(metadata.get("creationTimestamp") or ""), profile.config_map, cm))
    if not fitting:
        return None
    newest = max(fitting, key=lambda f: (f[0], f[1]))[2]
    return read_profile(newest)


class StartAction(StrEnum):
    PLAN = "Plan"
    """A stored profile fits: plan from it."""
    PROFILE = "Profile"
    """Measure a profile (this locks every SM clock of the job's GPUs in turn)."""
    REQUIRE_PROFILE = "RequireProfile"
    """Wait for a stored profile (condition ``Profiled``, reason :data:`PROFILE_REQUIRED`)."""


PROFILE_REQUIRED: Final = "ProfileRequired"


@dataclass(frozen=True)
class StartDecision:
    """How a job that has no plan yet goes on; ``message`` says why, for its status."""

    action: StartAction
    message: str


def may_profile(spec: PerseusJobSpec) -> bool:
    """Whether the job may sweep its GPUs' clocks to measure a profile: every mode that
    changes clocks, and ``Observe`` only with ``profiling.profileInObserve``."""
    return spec.policy.mode != Mode.OBSERVE or spec.profiling.profile_in_observe


def decide_start(
    spec: PerseusJobSpec,
    found: StoredProfile | None,
    *,
    product: str | None,
    stages: int,
) -> StartDecision:
    """Plan from ``found``, profile, or wait for a profile, with the message that says so.

    ``product``: the GPU product of the job's nodes (None: unknown or mixed); ``stages``: its
    pipeline stages (for the message).
    """
    if found is not None:
        return StartDecision(StartAction.PLAN, found.config_map)
    if may_profile(spec):
        return StartDecision(StartAction.PROFILE, profiling_note(spec))
    model = spec.profiling.model
    if model is None:
        shared = (
            "or set spec.profiling.model to the model's name, so that this job uses the "
            "profile a job of that model measured in this namespace (in mode Intrinsic or "
            "StragglerAware) for the same pipeline on the same GPU product"
        )
    elif product is None:
        shared = (
            f"or label the job's nodes with {NODE_GPU_PRODUCT_LABEL} (NVIDIA GPU feature "
            f"discovery does), so that a profile of model {model} measured on the same GPU "
            "product can be used"
        )
    else:
        shared = (
            f"or run a job of model {model} on {product} GPUs with {stages} pipeline stages "
            "in mode Intrinsic or StragglerAware in this namespace: it stores a profile this "
            "job then uses"
        )
    return StartDecision(
        StartAction.REQUIRE_PROFILE,
        "Observe mode changes no clock, so it plans from a stored profile, and none fits "
        f"this job: set spec.profiling.profileRef to a ConfigMap holding one (key "
        f"{PROFILE_KEY}: stage,instruction,frequency,time,energy), {shared}; or set "
        "spec.profiling.profileInObserve: true to measure one here (this locks every SM "
        "clock of the job's GPUs in turn while it profiles)",
    )


def profiling_note(spec: PerseusJobSpec) -> str:
    """What profiling needs from the training loop, for the status while it profiles."""
    if spec.policy.granularity != Granularity.STAGE:
        return ""
    return (
        "Stage granularity: profiling needs the training loop to call perseus_client "
        "(step and instruction begin/end); without it set spec.profiling.profileRef"
    )
