"""Profiling: the energy sampler's interpolation and the stage profiler's measurements, driven
deterministically (simulated time, manual sampling) over emulated GPUs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from perseus_agent.errors import GpuLostError
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.profiling.energy_sampler import EnergySampler
from perseus_agent.profiling.profiler import ProfileRow, StageProfiler, profile_csv
from perseus_api.profile import Profile, parse_profile
from support.profile_table import BLOCKING_W, PROFILE_CSV, TABLE
from support.profiler_time import MS, SimTime, manual_sampler, ns

CLOCKS = (1410, 1200, 1005)
# 1F1B order of a stage with two microbatches.
ORDER = (("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1))


@pytest.fixture
def profile() -> Profile:
    return parse_profile(PROFILE_CSV, "test-profile")


@pytest.fixture
def sim() -> SimTime:
    return SimTime()


@pytest.fixture
def gpus(profile: Profile, sim: SimTime) -> EmulatedBackend:
    return EmulatedBackend(2, profile, blocking_power_w=BLOCKING_W, clock=sim.now_s)


class Rank:
    """Plays a training rank on GPU 0 through ``profiler``, sampling like the background thread
    (every ``sample_every_ns``) and, unless ``sample_on_change`` is off, whenever the GPU's
    power changes."""

    def __init__(
        self,
        profiler: StageProfiler,
        gpus: EmulatedBackend,
        sim: SimTime,
        *,
        sample_every_ns: int = MS,
        sample_on_change: bool = True,
    ) -> None:
        self.p = profiler
        self.gpus = gpus
        self.sim = sim
        self.sampler = profiler.sampler
        self.sample_every_ns = sample_every_ns
        self.sample_on_change = sample_on_change
        self.next_sample_ns = sim.ns

    def advance(self, duration_ns: int) -> None:
        end = self.sim.ns + duration_ns
        while self.next_sample_ns <= end:
            self.sim.ns = max(self.sim.ns, self.next_sample_ns)
            self.sampler.sample()
            self.next_sample_ns += self.sample_every_ns
        self.sim.ns = end

    def activity(self, stage: int | None, name: str | None) -> None:
        self.gpus.set_activity(0, stage, name)
        if self.sample_on_change:
            self.sampler.sample()

    def iteration(
        self, *, stage: int = 0, bubble_ns: int = 3 * MS, latency_ns: int = 0
    ) -> int | None:
        """One iteration; returns the clock the profiler asked for. ``latency_ns``: between a
        request's receipt and the GPU starting (and between the GPU stopping and the receipt
        of the end)."""
        clock = self.p.step_begin(self.sim.ns)
        if clock is not None:  # as the applier does: the nearest supported clock
            applied = self.gpus.nearest_supported_sm_clock_mhz(0, clock)
            self.gpus.lock_sm_clock(0, applied)
            self.p.clock_applied(applied)
        self.advance(bubble_ns)
        for name, _ in ORDER:
            self.p.instruction_begin(name, self.sim.ns)
            self.advance(latency_ns)
            self.activity(stage, name)
            self.advance(ns(self.gpus.instruction_time_s(0, stage, name)))
            self.activity(None, None)
            self.advance(latency_ns)
            self.p.instruction_end(name, self.sim.ns)
            self.advance(bubble_ns)
        finished = self.p.step_end(self.sim.ns)
        if finished:
            self.gpus.reset_sm_clock(0)
        return clock


def expected_rows(clocks: tuple[int, ...], samples: int, latency_s: float = 0.0) -> list[tuple]:
    return [
        (
            0,
            name,
            clock,
            pytest.approx(TABLE[(0, name)][clock][0] + 2 * latency_s, rel=1e-9),
            pytest.approx(TABLE[(0, name)][clock][1] + 2 * latency_s * BLOCKING_W, rel=1e-9),
            samples,
        )
        for clock in clocks
        for name in ("forward", "backward")
    ]


def as_tuples(rows: list[ProfileRow]) -> list[tuple]:
    return [
        (r.stage, r.instruction, r.frequency_mhz, r.time_s, r.energy_j, r.samples) for r in rows
    ]


# -- EnergySampler -------------------------------------------------------------------------------


def test_interpolation_between_coarse_samples_is_exact_for_piecewise_linear_energy() -> None:
    now = [0]

    # Power 100 W until t = 1 s, 250 W until 3 s, then 40 W: breakpoints at the samples.
    def energy_j() -> float:
        t = now[0] / 1e9
        return 100 * min(t, 1) + 250 * min(max(t - 1, 0), 2) + 40 * max(t - 3, 0) + 7.0

    sampler = EnergySampler(energy_j, interval_s=None, time_ns=lambda: now[0])
    assert sampler.energy_at(0) is None and not sampler.covers(0)
    for t_s in (0.0, 1.0, 3.0, 4.5):
        now[0] = ns(t_s)
        assert sampler.sample()

    assert sampler.span() == (0, ns(4.5))
    for t_s in (0.0, 0.25, 0.999, 1.0, 1.7, 2.5, 3.0, 3.2, 4.5):
        now[0] = ns(t_s)
        assert sampler.energy_at(ns(t_s)) == pytest.approx(energy_j(), rel=1e-12), t_s
    assert sampler.energy_at(-1) is None
    assert sampler.energy_at(ns(4.5) + 1) is None
    assert sampler.covers(ns(4.5)) and not sampler.covers(ns(4.5) + 1)


def test_a_coarsely_updated_counter_is_interpolated_between_its_updates() -> None:
    """Like NVML on some GPUs: read every 1 ms, updated every 20 ms (to the true value)."""
    now = [0]
    power_w = 200.0

    def counter_j() -> float:
        updated_ns = now[0] - now[0] % (20 * MS)
        return power_w * updated_ns / 1e9

    sampler = EnergySampler(counter_j, interval_s=None, time_ns=lambda: now[0])
    for t in range(0, 101 * MS, MS):
        now[0] = t
        sampler.sample()

    # Only the updates are kept, so in between the energy follows the true (linear) counter,
    # not the staircase a plain read would give.
    assert sampler.span() == (0, 100 * MS)
    for t in (5 * MS, 13 * MS + 17, 47 * MS, 99 * MS):
        assert sampler.energy_at(t) == pytest.approx(power_w * t / 1e9, rel=1e-12)
    assert not sampler.covers(100 * MS + 1)


def test_buffer_is_bounded_and_drops_the_oldest() -> None:
    now = [0]
    sampler = EnergySampler(
        lambda: now[0] / 1e7, interval_s=None, capacity=4, time_ns=lambda: now[0]
    )
    for t in range(1, 101):
        now[0] = t * MS
        sampler.sample()
    span = sampler.span()
    assert span is not None and span[1] == 100 * MS
    assert 100 * MS - span[0] < 8 * MS  # at most 2 * capacity points
    assert sampler.energy_at(50 * MS) is None


def test_counter_that_goes_back_restarts_the_history() -> None:
    now, value = [0], [10.0]
    sampler = EnergySampler(lambda: value[0], interval_s=None, time_ns=lambda: now[0])
    sampler.sample()
    now[0], value[0] = MS, 20.0
    sampler.sample()
    now[0], value[0] = 2 * MS, 1.0
    sampler.sample()
    assert sampler.span() == (2 * MS, 2 * MS)


def test_read_errors_are_kept_and_stop_the_thread() -> None:
    calls = [0]

    def read() -> float:
        calls[0] += 1
        if calls[0] >= 3:
            raise GpuLostError("fell off the bus", 0)
        return float(calls[0])

    sampler = EnergySampler(read, interval_s=0.001)
    sampler.start()
    deadline = time.monotonic() + 5
    while sampler.running and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not sampler.running
    assert isinstance(sampler.error, GpuLostError)
    assert calls[0] == 3
    sampler.stop()

    manual = EnergySampler(read, interval_s=None)
    assert manual.sample() is False
    assert isinstance(manual.error, GpuLostError)


class _SteppingClock:
    """One time source for the GPU and the sampler that moves 100 us per sampler reading.

    With real clocks, a thread descheduled between a read and its timestamps shifts a point by
    up to the delay, which on a loaded CI machine exceeds the few milliseconds sampled here.
    """

    def __init__(self) -> None:
        self.now_ns = 0

    def sampler_ns(self) -> int:
        self.now_ns += 100_000
        return self.now_ns

    def gpu_s(self) -> float:
        return self.now_ns / 1e9


def test_background_thread_samples_until_stopped(gpus: EmulatedBackend) -> None:
    clock = _SteppingClock()
    real = EmulatedBackend(1, gpus.profile, blocking_power_w=BLOCKING_W, clock=clock.gpu_s)
    sampler = EnergySampler(lambda: real.energy_j(0), interval_s=0.001, time_ns=clock.sampler_ns)
    sampler.start()
    sampler.start()  # idempotent
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        span = sampler.span()
        if span is not None and span[1] - span[0] >= 5 * MS:
            break
        time.sleep(0.002)
    sampler.stop()
    assert not sampler.running
    assert not any(t.name == "perseus-energy-sampler" for t in threading.enumerate())
    span = sampler.span()
    assert span is not None and span[1] - span[0] >= 5 * MS
    middle = (span[0] + span[1]) // 2
    assert sampler.energy_at(middle) == pytest.approx(
        sampler.energy_at(span[0]) + BLOCKING_W * (middle - span[0]) / 1e9,  # type: ignore[operator]
        rel=1e-9,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"interval_s": 0.0}, "interval_s"), ({"capacity": 1}, "capacity")],
)
def test_sampler_arguments_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EnergySampler(lambda: 0.0, **kwargs)  # type: ignore[arg-type]


# -- StageProfiler -------------------------------------------------------------------------------


def make_profiler(
    sampler: EnergySampler,
    clocks: tuple[int, ...] = CLOCKS,
    *,
    iterations: int = 2,
    warmup: int = 2,
) -> StageProfiler:
    return StageProfiler(
        0, clocks, iterations_per_frequency=iterations, warmup_iterations=warmup, sampler=sampler
    )


def test_profiles_each_clock_dropping_warmup(
    gpus: EmulatedBackend, sim: SimTime, profile: Profile
) -> None:
    p = make_profiler(manual_sampler(gpus, sim), iterations=3, warmup=2)
    rank = Rank(p, gpus, sim)
    asked, progress, locked = [], [], []
    for j in range(len(CLOCKS) * (2 + 3)):
        assert p.measuring and not p.done
        # Warm-up iterations look nothing like measured ones: another stage's computations
        # (other times and powers) and longer bubbles. None of it may leak into the rows.
        warmup = j % 5 < 2
        asked.append(rank.iteration(stage=1 if warmup else 0, bubble_ns=(9 if warmup else 3) * MS))
        progress.append(p.frequency_index)
        locked.append(gpus.locked_sm_clock_mhz(0))
    assert asked == [c for c in CLOCKS for _ in range(5)]
    assert progress == [0] * 4 + [1] * 5 + [2] * 5 + [3]
    assert locked == [1410] * 5 + [1200] * 5 + [1005] * 4 + [None]  # reset at the end
    assert p.applied_mhz == list(CLOCKS)

    assert p.done  # the step_end sample covers the last iteration
    assert (p.measured_iterations, p.dropped_iterations) == (9, 0)
    assert as_tuples(p.rows()) == expected_rows(CLOCKS, samples=6)
    assert p.blocking_power_w == pytest.approx(BLOCKING_W, rel=1e-9)
    assert p.step_begin(sim.ns) is None  # nothing left: the clock stays reset
    assert gpus.locked_sm_clock_mhz(0) is None

    measured = parse_profile(p.to_csv(), "measured")
    assert measured.num_stages == 1
    for name in ("forward", "backward"):
        m = measured.get(0, name)
        assert list(m.frequencies_mhz) == list(CLOCKS)
        truth = profile.get(0, name)
        assert list(m.times_s) == pytest.approx(list(truth.times_s), rel=1e-9)
        assert list(m.energies_j) == pytest.approx(list(truth.energies_j), rel=1e-9)


def test_energy_is_interpolated_at_the_request_times(gpus: EmulatedBackend, sim: SimTime) -> None:
    """Requests arrive 0.4 ms before the GPU starts and after it stops, and the counter is
    sampled every 1.7 ms and on every power change, never at a request: what the profiler
    measures is exactly the computation plus the two gaps at blocking power."""
    p = make_profiler(manual_sampler(gpus, sim), (1410, 1005), iterations=2, warmup=1)
    rank = Rank(p, gpus, sim, sample_every_ns=1_700_000)
    latency_ns = 400_000
    sim.ns += 123_457  # off the sampling grid
    while p.measuring:
        rank.iteration(latency_ns=latency_ns)
    rank.advance(2 * MS)
    p.poll()

    assert p.done
    assert as_tuples(p.rows()) == expected_rows((1410, 1005), 4, latency_s=latency_ns / 1e9)
    assert p.blocking_power_w == pytest.approx(BLOCKING_W, rel=1e-9)


def test_a_stalled_computation_does_not_move_the_profile(
    gpus: EmulatedBackend, sim: SimTime
) -> None:
    """One forward of the measured iterations at 1410 MHz runs 1.5x long (a stall): the
    profile reports the median of that clock's forwards, which the stall does not move."""
    p = make_profiler(manual_sampler(gpus, sim), (1410, 1005), iterations=3, warmup=1)
    rank = Rank(p, gpus, sim)
    stalled = False
    set_activity = gpus.set_activity

    def stall_once(index: int, stage: int | None, name: str | None) -> bool:
        nonlocal stalled
        measuring_1410 = gpus.locked_sm_clock_mhz(0) == 1410 and p.frequency_index == 0
        if name == "forward" and measuring_1410 and p._warmup_left == 0 and not stalled:
            stalled = True
            gpus.set_slowdown(0, 1.5)
        elif name is None:
            gpus.set_slowdown(0, 1.0)
        return set_activity(index, stage, name)

    gpus.set_activity = stall_once  # type: ignore[method-assign]
    while p.measuring:
        rank.iteration()
    rank.advance(2 * MS)
    p.poll()
    assert stalled and p.done
    assert as_tuples(p.rows()) == expected_rows((1410, 1005), samples=3 * 2)


def test_blocking_power_is_measured_inside_waits_away_from_the_edges(
    gpus: EmulatedBackend, sim: SimTime
) -> None:
    """Waits of 40 ms, the counter sampled every 5 ms and never at a power change: the
    interpolation across each edge puts computation energy into the waits beside it; inside
    them, away from the edges, the power is the GPU's blocking power exactly."""
    p = make_profiler(manual_sampler(gpus, sim), (1410, 1005), iterations=2, warmup=1)
    rank = Rank(p, gpus, sim, sample_every_ns=5 * MS, sample_on_change=False)
    sim.ns += 1_234_567  # off the sampling grid
    while p.measuring:
        rank.iteration(bubble_ns=40 * MS)
    rank.advance(10 * MS)
    p.poll()
    assert p.done
    assert p.blocking_power_w == pytest.approx(BLOCKING_W, rel=1e-9)


@pytest.mark.parametrize("bubble_ns", [0, 20_000])
def test_no_blocking_power_from_a_rank_that_hardly_waits(
    gpus: EmulatedBackend, sim: SimTime, bubble_ns: int
) -> None:
    """A rank that (nearly) never waits gives no blocking power: its few microseconds outside
    computations would be all interpolation error of a counter sampled every 1.7 ms."""
    p = make_profiler(manual_sampler(gpus, sim), (1410, 1005), iterations=2, warmup=1)
    rank = Rank(p, gpus, sim, sample_every_ns=1_700_000)
    while p.measuring:
        rank.iteration(bubble_ns=bubble_ns)
    rank.advance(2 * MS)
    p.poll()
    assert p.done and p.rows()
    assert p.blocking_power_w is None
    assert p.blocking_s == pytest.approx(4 * 5 * bubble_ns / 1e9, abs=1e-12)


def test_an_iteration_waits_for_a_sample_after_its_end(gpus: EmulatedBackend, sim: SimTime) -> None:
    p = make_profiler(manual_sampler(gpus, sim), (1410, 1200), iterations=1, warmup=0)
    rank = Rank(p, gpus, sim, sample_every_ns=50 * MS, sample_on_change=False)
    rank.iteration()
    assert not p.rows()  # not covered yet
    rank.iteration()
    assert not p.measuring and not p.done
    assert p.rows() and {r.frequency_mhz for r in p.rows()} == {1410}

    sim.ns += 50 * MS
    p.sampler.sample()
    p.poll()
    assert p.done
    assert [r.frequency_mhz for r in p.rows()] == [1410, 1410, 1200, 1200]


def test_incomplete_iterations_are_dropped(gpus: EmulatedBackend, sim: SimTime) -> None:
    p = make_profiler(manual_sampler(gpus, sim), (1410, 1200), iterations=2, warmup=0)
    rank = Rank(p, gpus, sim)

    # A step that never ends is not counted; the next one replaces it.
    p.step_begin(sim.ns)
    rank.advance(5 * MS)
    rank.iteration()
    # An instruction without its end spoils the iteration, which counts as measured.
    p.step_begin(sim.ns)
    p.instruction_begin("forward", sim.ns)
    rank.advance(5 * MS)
    p.instruction_begin("backward", sim.ns)
    rank.advance(5 * MS)
    p.instruction_end("backward", sim.ns)
    p.step_end(sim.ns)
    assert p.frequency_index == 1
    assert (p.measured_iterations, p.dropped_iterations) == (1, 2)

    while p.measuring:
        rank.iteration()
    assert p.done
    # Per computation (2 microbatches an iteration): 1 iteration at 1410, 2 at 1200.
    assert [(r.frequency_mhz, r.samples) for r in p.rows()] == [
        (1410, 2),
        (1410, 2),
        (1200, 4),
        (1200, 4),
    ]


def test_interrupt_warms_up_again(gpus: EmulatedBackend, sim: SimTime) -> None:
    p = make_profiler(manual_sampler(gpus, sim), (1410, 1200), iterations=2, warmup=1)
    rank = Rank(p, gpus, sim)
    rank.iteration()  # warm-up
    rank.iteration()  # measured 1 of 2
    p.step_begin(sim.ns)
    p.interrupt()  # e.g. the training process restarted; its clock was reset
    assert p.dropped_iterations == 1
    rank.iteration()  # warm-up again
    assert (p.frequency_index, p.measured_iterations) == (0, 1)
    rank.iteration()  # measured 2 of 2
    assert p.frequency_index == 1


def test_clamped_clocks_are_measured_as_applied(gpus: EmulatedBackend, sim: SimTime) -> None:
    """Two scheduled clocks that the GPU runs at the same one are reported once, merged."""
    p = make_profiler(manual_sampler(gpus, sim), (1410, 1100, 1005), iterations=1, warmup=0)
    rank = Rank(p, gpus, sim)
    while p.measuring:
        rank.iteration()
    assert p.applied_mhz == [1410, 1005, 1005]
    assert [(r.frequency_mhz, r.samples) for r in p.rows()] == [
        (1410, 2),
        (1410, 2),
        (1005, 4),
        (1005, 4),
    ]
    for r in p.rows():
        assert (r.time_s, r.energy_j) == pytest.approx(TABLE[(0, r.instruction)][r.frequency_mhz])


def test_profile_csv_of_several_stages_round_trips() -> None:
    rows = [
        ProfileRow(
            stage=s, instruction=i, frequency_mhz=f, time_s=0.1 / 3 * (s + 1), energy_j=e, samples=1
        )
        for s in (1, 0)
        for f, e in ((1410, 10.0 / 3), (1005, 7.1))
        for i in ("forward", "backward")
    ]
    text = profile_csv(rows)
    assert text.splitlines()[0] == "stage,instruction,frequency,time,energy"
    parsed = parse_profile(text, "rows")
    assert parsed.num_stages == 2
    m = parsed.get(1, "backward")
    assert list(m.frequencies_mhz) == [1410, 1005]
    assert list(m.times_s) == [0.1 / 3 * 2] * 2  # exact: repr round-trips
    assert list(m.energies_j) == [10.0 / 3, 7.1]


@pytest.mark.parametrize(
    "make",
    [
        lambda s: StageProfiler(
            -1, [1410], iterations_per_frequency=1, warmup_iterations=0, sampler=s
        ),
        lambda s: StageProfiler(0, [], iterations_per_frequency=1, warmup_iterations=0, sampler=s),
        lambda s: StageProfiler(0, [0], iterations_per_frequency=1, warmup_iterations=0, sampler=s),
        lambda s: StageProfiler(
            0, [1410], iterations_per_frequency=0, warmup_iterations=0, sampler=s
        ),
        lambda s: StageProfiler(
            0, [1410], iterations_per_frequency=1, warmup_iterations=-1, sampler=s
        ),
    ],
)
def test_profiler_arguments_are_checked(make: Callable[[EnergySampler], StageProfiler]) -> None:
    with pytest.raises(ValueError):
        make(EnergySampler(lambda: 0.0, interval_s=None))
