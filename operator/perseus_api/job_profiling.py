"""The ``profiling`` section of a ``PerseusJob``'s spec: where the profile the job is planned
from comes from (a stored one, another job's of the same model) and how the node agents measure
one. The rest of the spec is in :mod:`perseus_api.job`.
"""

from __future__ import annotations

from typing import Final

from pydantic import Field

from perseus_api.spec_model import _Spec


class ProfileRef(_Spec):
    """A stored profile (the planner's CSV) to use instead of profiling."""

    config_map_name: str = Field(min_length=1, max_length=253)
    """ConfigMap in the job's namespace that holds the profile."""
    key: str = Field(default="profile.csv", min_length=1, max_length=253)
    """Key of the ConfigMap whose value is the profile CSV (default profile.csv)."""


MODEL_PATTERN: Final = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
"""A Kubernetes label value (the model names the label of the profiles a job stores)."""
DEFAULT_TRAINING_PROCESS_TIMEOUT_S: Final = 600


class Profiling(_Spec):
    """Where the profile the job is planned from comes from, and how it is measured.

    A profile is the time and energy of every forward and backward of each pipeline stage at
    each SM clock. The job plans from, in this order: ``profileRef``; the profile it stored
    itself (ConfigMap ``<job>-profile``); with ``model``, the newest profile another job of
    the same model stored for the same pipeline on the same GPU product (node label
    ``nvidia.com/gpu.product``). Without one, the node agents measure it: they sweep the SM
    clocks while the training loop calls the ``perseus_client`` hooks (``step`` and
    ``instruction`` begin/end), so a training loop without them (``Stage`` granularity
    with no code change) needs a stored profile. ``Observe`` changes no clock, so it never
    measures one unless ``profileInObserve`` is set.
    """

    profile_ref: ProfileRef | None = Field(
        default=None, description="Reuse this profile and skip profiling."
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=MODEL_PATTERN,
        description="Names the model trained (a label value, e.g. gpt3-175b). The profile "
        "this job measures is labelled with it and its GPU product, and a job of the same "
        "model on the same GPU product and pipeline plans from it instead of profiling "
        "(while the job that stored it exists: the ConfigMap is owned by that job).",
    )
    profile_in_observe: bool = Field(
        default=False,
        description="Observe mode only: measure a profile when none is stored. Profiling "
        "locks every SM clock in turn; without this, Observe changes no clock, ever, and "
        "waits for a profile (condition Profiled, reason ProfileRequired).",
    )
    training_process_timeout_seconds: int = Field(
        default=DEFAULT_TRAINING_PROCESS_TIMEOUT_S,
        ge=1,
        le=86400,
        description="While profiling: how long to wait for every training process to begin "
        "an iteration through perseus_client, and for a running sweep to move (an "
        "iteration measured or dropped on some GPU). Then the job fails (reason "
        "NoTrainingProcess, or ProfilingStalled) naming the pods, and resets their GPUs.",
    )
    iterations_per_frequency: int = Field(default=5, ge=1, le=100)
    """Iterations measured at each profiled clock, after the warm-up ones (default 5)."""
    warmup_iterations: int = Field(
        default=2, ge=0, le=100, description="Dropped after every clock change."
    )
    frequency_step_mhz: int = Field(
        default=15,
        alias="frequencyStepMHz",
        ge=1,
        le=1000,
        description="Spacing of the profiled clocks.",
    )
