"""When the node's GPU driver upgrade needs the agent out of the way (pure).

The NVIDIA GPU Operator upgrades a node's driver in place through a state machine recorded on
the node label :data:`UPGRADE_STATE_LABEL` (``k8s-operator-libs``, ``pkg/upgrade``):
``upgrade-required`` -> ``cordon-required`` -> ``wait-for-jobs-required`` ->
``pod-deletion-required`` -> (``drain-required``) -> ``pod-restart-required`` ->
``validation-required`` -> ``uncordon-required`` -> ``upgrade-done``, or ``upgrade-failed``
(``node-maintenance-required`` and ``post-maintenance-required`` with the node maintenance
operator). The new driver can load only once no process holds the GPUs; the agent holds NVML
and requests no GPU, so the operator's pod deletion never evicts it (NVIDIA/gpu-operator#2570,
#2509). The agent therefore lets go — resets its clocks and calls ``nvmlShutdown`` — from the
moment the GPU pods are being removed until the new driver has been validated
(:data:`RELEASE_STATES`). Before that, training still runs and keeps its savings; after it, the
agent opens NVML again and re-applies its plans. ``upgrade-failed`` resumes too: the driver
pod either runs (the upgrade is retried from ``upgrade-required``) or NVML cannot be opened,
which the agent retries.
"""

from __future__ import annotations

from typing import Final

__all__ = ["HOLD_STATES", "RELEASE_STATES", "UPGRADE_STATE_LABEL", "releases_gpus"]

UPGRADE_STATE_LABEL: Final = "nvidia.com/gpu-driver-upgrade-state"

RELEASE_STATES: Final = frozenset(
    {
        "pod-deletion-required",
        "drain-required",
        "node-maintenance-required",
        "post-maintenance-required",
        "pod-restart-required",
        "validation-required",
    }
)
"""States in which the agent holds no NVML handle and no clock."""

HOLD_STATES: Final = frozenset(
    {
        "",  # no upgrade controller, or the node not processed yet
        "upgrade-required",
        "cordon-required",
        "wait-for-jobs-required",
        "uncordon-required",
        "upgrade-done",
        "upgrade-failed",
    }
)
"""States in which the agent manages the GPUs as usual."""


def releases_gpus(state: str | None) -> bool:
    """Whether the agent must let go of the GPUs in upgrade ``state`` (``None``: no label).

    A state this version does not know keeps the GPUs (and the plans' savings): a driver
    upgrade that needs the GPUs free passes through the known release states first.
    """
    return state in RELEASE_STATES
