"""Profiles for the schedules with virtual stages or a split backward.

Forms a profile can take for each schedule:

- ``1f1b``, ``gpipe``: one stage per GPU with ``forward`` and ``backward``.
- ``interleaved-1f1b`` with ``V`` virtual stages on ``P`` GPUs: ``P * V`` stages, where
  virtual (model) stage ``v * P + p`` runs on GPU ``p`` (Megatron-LM's layout), each with
  ``forward`` and ``backward``.
- ``zb-h1``: one stage per GPU with ``forward``, ``backward_input`` and
  ``backward_weight``.

The bundled profiles (the Perseus artifact's, Apache-2.0; see :mod:`perseus_planner.bundled`)
have one stage per GPU and a whole backward. For the demo they are adapted, and only by the
two functions here (``perseus plan --derive-profile``):

- :func:`split_virtual_stages`: stage ``p`` of the profile becomes the ``V`` virtual stages
  ``v * P + p``, each with ``1/V`` of its time and energy at every clock (the GPU's layers
  split evenly into ``V`` chunks; what a chunk costs on its own is not measured).
- :func:`split_backward`: every backward becomes a ``backward_input`` with a fraction
  (default one half, as the zero-bubble paper's analysis and torch's ZB-V docs assume:
  ``T_B = T_W``) of its time and energy at every clock and a ``backward_weight`` with the
  rest.

A measured profile in the schedule's own form is always better; these splits keep each
clock's time and energy ratios, so they shift where the frontier's savings come from only
through the pipeline's shape, not through any new per-chunk measurement.
"""

from __future__ import annotations

import math

from perseus_api.errors import ProfileError
from perseus_api.profile import Measurements, Profile
from perseus_api.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    Schedule,
    check_schedule_sizes,
)
from perseus_planner.dag import PipelineDAG

__all__ = [
    "DEFAULT_BACKWARD_INPUT_FRACTION",
    "derive_profile",
    "schedule_profile",
    "solver_profile",
    "split_backward",
    "split_virtual_stages",
]

DEFAULT_BACKWARD_INPUT_FRACTION = 0.5
"""Share of a backward's time and energy given to its backward-input by :func:`split_backward`."""


def _scaled(m: Measurements, factor: float) -> Measurements:
    return Measurements(m.frequencies_mhz, m.times_s * factor, m.energies_j * factor)


def split_virtual_stages(profile: Profile, virtual_stages: int) -> Profile:
    """A ``P * V``-stage profile from a ``P``-stage one: virtual stage ``v * P + p`` gets
    ``1/V`` of stage ``p``'s time and energy at every clock (see the module docstring).

    Raises:
        ProfileError: ``virtual_stages`` is not a positive integer.
    """
    if (
        isinstance(virtual_stages, bool)
        or not isinstance(virtual_stages, int)
        or virtual_stages < 1
    ):
        raise ProfileError(profile.source, f"virtual stages must be >= 1, got {virtual_stages!r}")
    p = profile.num_stages
    measurements = {
        (v * p + stage, instruction): _scaled(m, 1.0 / virtual_stages)
        for (stage, instruction), m in profile.measurements.items()
        for v in range(virtual_stages)
    }
    return Profile(
        source=f"{profile.source} (each stage split into {virtual_stages} virtual stages)",
        num_stages=p * virtual_stages,
        measurements=measurements,
    )


def split_backward(
    profile: Profile, input_fraction: float = DEFAULT_BACKWARD_INPUT_FRACTION
) -> Profile:
    """Every ``backward`` split into ``backward_input`` (``input_fraction`` of its time and
    energy at every clock) and ``backward_weight`` (the rest); other rows kept as they are.

    Raises:
        ProfileError: ``input_fraction`` not strictly between 0 and 1, or a stage without a
            whole backward to split.
    """
    if not (math.isfinite(input_fraction) and 0.0 < input_fraction < 1.0):
        raise ProfileError(
            profile.source, f"the backward-input fraction must be in (0, 1), got {input_fraction}"
        )
    measurements = {k: m for k, m in profile.measurements.items() if k[1] != BACKWARD}
    for stage in range(profile.num_stages):
        whole = profile.get(stage, BACKWARD)
        measurements[(stage, BACKWARD_INPUT)] = _scaled(whole, input_fraction)
        measurements[(stage, BACKWARD_WEIGHT)] = _scaled(whole, 1.0 - input_fraction)
    return Profile(
        source=f"{profile.source} (backward split {input_fraction:g}/{1 - input_fraction:g} "
        "into input/weight)",
        num_stages=profile.num_stages,
        measurements=measurements,
    )


def derive_profile(
    profile: Profile,
    schedule: Schedule | str,
    virtual_stages: int = 1,
    input_fraction: float = DEFAULT_BACKWARD_INPUT_FRACTION,
) -> Profile:
    """A one-stage-per-GPU, whole-backward profile in the form ``schedule`` needs (by the
    two splits above); unchanged for ``1f1b`` and ``gpipe``."""
    sched = Schedule.parse(schedule)
    if sched is Schedule.INTERLEAVED_1F1B:
        return split_virtual_stages(profile, virtual_stages)
    if sched.splits_backward:
        return split_backward(profile, input_fraction)
    return profile


def schedule_profile(
    profile: Profile,
    schedule: Schedule | str,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> Profile:
    """The part of ``profile`` the schedule uses (its model stages and instructions).

    Raises:
        ScheduleError: Sizes the schedule does not accept.
        ProfileError: The profile has another number of stages or lacks an instruction the
            schedule runs; the message says which form the schedule needs.
    """
    sched = check_schedule_sizes(schedule, num_stages, num_microbatches, virtual_stages)
    model_stages = num_stages * virtual_stages
    if profile.num_stages != model_stages:
        if virtual_stages == 1:
            needs = f"the pipeline has {num_stages}; profile every stage"
        else:
            needs = (
                f"{sched.value} on {num_stages} GPUs x {virtual_stages} virtual stages needs "
                f"{model_stages} (virtual stage v*{num_stages}+p runs on GPU p); profile every "
                "virtual stage, or derive them from a per-GPU profile (--derive-profile)"
            )
        raise ProfileError(
            profile.source, f"the profile has {profile.num_stages} stages but {needs}"
        )
    measurements = {}
    for stage in range(model_stages):
        for instruction in sched.instructions:
            if (stage, instruction) not in profile.measurements:
                hint = (
                    "; split each backward by a stated ratio (--derive-profile)"
                    if sched.splits_backward
                    else ""
                )
                raise ProfileError(
                    profile.source,
                    f"{sched.value} runs {', '.join(sched.instructions)} but stage {stage} has "
                    f"no {instruction} rows{hint}",
                )
            measurements[(stage, instruction)] = profile.measurements[(stage, instruction)]
    return Profile(profile.source, model_stages, measurements)


def solver_profile(profile: Profile, dag: PipelineDAG) -> Profile:
    """``profile`` as :func:`perseus_planner.solver.build_problem` takes it for ``dag``.

    The solver checks the profile's stage count against ``dag.num_stages``, the pipeline's
    GPUs (which also count its blocking power), and looks each computation up by its model
    stage. With virtual stages these differ, so the solver gets the same measurements
    (keyed by model stage) under the GPU count; without, the profile itself.

    Raises:
        ProfileError: see :func:`schedule_profile`.
    """
    needed = schedule_profile(
        profile, dag.schedule, dag.num_stages, dag.num_microbatches, dag.virtual_stages
    )
    if dag.virtual_stages == 1:
        return needed
    return Profile(needed.source, dag.num_stages, dict(needed.measurements))
