"""The profile the agent's emulated GPUs follow in the profiler and applier tests: two stages,
three clocks, a time and energy per instruction and clock."""

from __future__ import annotations

BLOCKING_W = 80.0
# (stage, instruction) -> clock -> (seconds, joules). Stage 1 only serves to make warm-up
# iterations look different from measured ones.
TABLE: dict[tuple[int, str], dict[int, tuple[float, float]]] = {
    (0, "forward"): {1410: (0.020, 6.0), 1200: (0.024, 5.52), 1005: (0.030, 5.1)},
    (0, "backward"): {1410: (0.040, 12.4), 1200: (0.048, 11.04), 1005: (0.060, 10.2)},
    (1, "forward"): {1410: (0.035, 14.0), 1200: (0.041, 12.3), 1005: (0.050, 11.0)},
    (1, "backward"): {1410: (0.070, 28.0), 1200: (0.082, 24.6), 1005: (0.100, 22.0)},
}
PROFILE_CSV = "stage,instruction,frequency,time,energy\n" + "".join(
    f"{stage},{name},{clock},{t},{e}\n"
    for (stage, name), rows in TABLE.items()
    for clock, (t, e) in rows.items()
)
