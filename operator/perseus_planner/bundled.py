"""Real GPU profiles shipped with the package, with the settings they were published with.

Source: the public artifact of the Perseus paper (SOSP 2024), ml-energy/zeus,
branch ``kronos``, folder ``sosp24_data/`` (Apache License 2.0; see
``profiles/LICENSE-perseus-sosp24``). GPT-3 175B and Bloom 176B, bf16, 8
pipeline stages, measured per stage on one GPU at every SM clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from perseus_api.profile import Profile, load_profile
from perseus_planner.errors import PlannerError


@dataclass(frozen=True)
class BundledProfile:
    """A shipped profile and the solver settings the artifact used for it."""

    name: str
    filename: str
    unit_time_s: float
    blocking_power_w: float

    @property
    def path(self) -> Path:
        return Path(str(resources.files("perseus_planner") / "profiles" / self.filename))

    def load(self) -> Profile:
        return load_profile(self.path)


_A100_UNIT_S, _A100_BLOCKING_W = 0.001, 83.64
_A40_UNIT_S, _A40_BLOCKING_W = 0.0001, 70.38

BUNDLED_PROFILES: dict[str, BundledProfile] = {
    p.name: p
    for p in (
        BundledProfile("gpt3-175b+a100_sxm", "gpt3-175b+a100_sxm_bf16.csv", _A100_UNIT_S,
                       _A100_BLOCKING_W),
        BundledProfile("bloom+a100_sxm", "bloom+a100_sxm_bf16.csv", _A100_UNIT_S,
                       _A100_BLOCKING_W),
        BundledProfile("gpt3-175b+a40", "gpt3-175b+a40_bf16.csv", _A40_UNIT_S, _A40_BLOCKING_W),
        BundledProfile("bloom+a40", "bloom+a40_bf16.csv", _A40_UNIT_S, _A40_BLOCKING_W),
    )
}  # fmt: skip

DEFAULT_PROFILE = "gpt3-175b+a100_sxm"


def bundled_profile(name: str) -> BundledProfile:
    """Look up a shipped profile by name (e.g. ``gpt3-175b+a100_sxm``)."""
    try:
        return BUNDLED_PROFILES[name]
    except KeyError:
        names = ", ".join(sorted(BUNDLED_PROFILES))
        raise PlannerError(f"no bundled profile {name!r}; bundled: {names}") from None
