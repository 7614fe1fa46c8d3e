"""The pipeline-schedule options shared by ``perseus plan`` and ``perseus simulate``.

``--schedule {1f1b,gpipe,interleaved-1f1b,zb-h1}``, ``--virtual-stages V`` (interleaved
1F1B), ``--derive-profile`` and ``--backward-input-fraction``: the profile a schedule needs
(see :mod:`perseus_planner.model_stages`) is either given in that form or derived from a
per-GPU, whole-backward one. Bundled profiles are always derived (they are per-GPU and
whole-backward); a ``--profile`` only with ``--derive-profile``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from perseus_cli import CliError
from perseus_cli.arguments import positive_float, positive_int

if TYPE_CHECKING:
    from perseus_planner import FrontierProblem, Profile

SCHEDULE_CHOICES = "{1f1b,gpipe,interleaved-1f1b,zb-h1}"


def add_schedule_arguments(group: argparse._ArgumentGroup, *, default: str | None) -> None:
    """``--schedule`` and the options that shape the profile for it."""
    shown = f" (default: {default})" if default else ""
    group.add_argument(
        "--schedule",
        default=default,
        metavar=SCHEDULE_CHOICES,
        help=f"pipeline schedule, case-insensitive{shown}",
    )
    group.add_argument(
        "--virtual-stages",
        type=positive_int,
        default=1,
        metavar="V",
        help="model stages per GPU for interleaved-1f1b (>= 2; microbatches a multiple of the "
        "stages); the profile has stages x V stages, virtual stage v*P+p on GPU p",
    )
    group.add_argument(
        "--derive-profile",
        action="store_true",
        help="derive the schedule's profile from a per-GPU one: split each stage into V "
        "virtual stages of 1/V its time and energy (interleaved), or each backward into "
        "backward_input and backward_weight (zb-h1); always done for bundled profiles",
    )
    group.add_argument(
        "--backward-input-fraction",
        type=positive_float,
        default=None,
        metavar="F",
        help="share of a backward's time and energy given to backward_input when deriving "
        "(0 < F < 1; default 0.5, the zero-bubble papers' T_B = T_W)",
    )


@dataclass(frozen=True)
class ScheduledProfile:
    """The profile to solve for a schedule, and how it was obtained."""

    profile: Profile
    num_stages: int
    virtual_stages: int
    derived: bool


def schedule_profile_for(
    args: argparse.Namespace, schedule: str, profile: Profile, *, bundled: bool
) -> ScheduledProfile:
    """The profile in ``schedule``'s form and the pipeline's GPU count.

    Raises:
        CliError: Options that do not go together, or a profile whose stages do not fit
            ``--stages`` x ``--virtual-stages``.
        ProfileError: A derivation that the profile cannot take.
    """
    from perseus_planner import Schedule
    from perseus_planner.model_stages import DEFAULT_BACKWARD_INPUT_FRACTION, derive_profile

    sched = Schedule.parse(schedule)
    virtual: int = args.virtual_stages
    fraction = args.backward_input_fraction
    if virtual != 1 and sched is not Schedule.INTERLEAVED_1F1B:
        raise CliError(f"--virtual-stages applies to interleaved-1f1b only, not {sched}")
    if fraction is not None and not sched.splits_backward:
        raise CliError("--backward-input-fraction applies to zb-h1 only")
    if fraction is not None and not (bundled or args.derive_profile):
        raise CliError("--backward-input-fraction needs --derive-profile with --profile")
    derive = sched in (Schedule.INTERLEAVED_1F1B, Schedule.ZB_H1) and (
        bundled or args.derive_profile
    )
    if derive:
        profile = derive_profile(
            profile,
            sched,
            virtual,
            DEFAULT_BACKWARD_INPUT_FRACTION if fraction is None else fraction,
        )
    elif args.derive_profile:
        raise CliError(f"--derive-profile applies to interleaved-1f1b and zb-h1, not {sched}")
    model_stages = profile.num_stages
    num_stages = model_stages // virtual if args.stages is None else args.stages
    if num_stages * virtual != model_stages:
        per_gpu = f" x {virtual} virtual stages" if virtual > 1 else ""
        raise CliError(
            f"--stages {num_stages}{per_gpu} does not match the profile {profile.source}, "
            f"which has {model_stages} stages; profile every stage of the pipeline"
        )
    return ScheduledProfile(profile, num_stages, virtual, derive)


def write_dag_json(path: Path, problem: FrontierProblem) -> None:
    """The solved DAG as documented JSON (:mod:`perseus_planner.dag_json`), written to
    ``path`` (a temporary name of the caller's: files are renamed in place together)."""
    from perseus_planner.dag_json import export_dag

    path.write_text(json.dumps(export_dag(problem)) + "\n")
