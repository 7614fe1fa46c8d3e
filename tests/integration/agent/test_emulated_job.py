"""The emulated data-parallel x pipeline-parallel job: timing against the planner, energy,
a straggler replica behind the all-reduce barrier, pipeline dependencies, stopping, errors
and the command line. No agent: every node's socket is absent, so the hooks are no-ops."""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_api.profile import Profile
from perseus_api.schedule import BACKWARD, FORWARD, stage_instruction_order
from perseus_emulation.job import (
    OVERHEADS,
    EmulatedJob,
    EmulatedJobError,
    IterationRecord,
    NodeSpec,
    RankInfo,
    main,
)
from perseus_planner import Baseline, build_pipeline_dag, build_problem, max_frequency_baseline
from support.operator_harness import cut_profile, profile_of

pytestmark = pytest.mark.timeout(30)

REPO_ROOT = Path(__file__).resolve().parents[3]
BLOCKING_W = 83.64
STAGES = 4
MICROBATCHES = 8
# The GPT-3 A100 stages take ~0.05 s forward, ~0.093 s backward: ~1.57 s an iteration at
# 4 stages x 8 microbatches, ~79 ms at this scale.
TIME_SCALE = 0.05
# For the tests that compare times: ~157 ms an iteration. Each hand-off along the pipeline's
# critical path (22 here) costs ~0.1-0.3 ms of sleep overshoot and thread wake-up; on a busy
# test machine that is several percent of a 79 ms iteration, ~1-4 % of this one.
TIMING_SCALE = 0.1
TIME_TOLERANCE = 0.10


@pytest.fixture(scope="module")
def profile() -> Profile:
    return profile_of(STAGES)


@pytest.fixture(scope="module")
def baseline(profile: Profile) -> Baseline:
    """The planner's all-max-clock iteration of one pipeline (unscaled)."""
    dag = build_pipeline_dag("1f1b", STAGES, MICROBATCHES)
    return max_frequency_baseline(build_problem(profile, dag, 0.001, BLOCKING_W))


def nodes(count: int = 2, gpus: int = 4, state_dir: Path | None = None) -> list[NodeSpec]:
    return [
        NodeSpec(
            name=f"node-{k}",
            gpus=gpus,
            state_file=None if state_dir is None else state_dir / f"node-{k}.json",
        )
        for k in range(count)
    ]


def make_job(profile: Profile, **kwargs: Any) -> EmulatedJob:
    kwargs.setdefault("blocking_power_w", BLOCKING_W)
    kwargs.setdefault("stages", STAGES)
    kwargs.setdefault("replicas", 2)
    kwargs.setdefault("microbatches", MICROBATCHES)
    kwargs.setdefault("time_scale", TIME_SCALE)
    return EmulatedJob(profile, kwargs.pop("nodes", nodes()), **kwargs)


def steady(records: Sequence[IterationRecord]) -> list[tuple[IterationRecord, IterationRecord]]:
    """Consecutive pairs of records, from the second: one iteration's counters each."""
    return list(itertools.pairwise(records[1:]))


def median_period_s(records: Sequence[IterationRecord]) -> float:
    return statistics.median(b.end_s - a.end_s for a, b in steady(records))


@dataclass(frozen=True)
class Event:
    rank: int
    kind: str  # step_begin, step_end, begin, end, close
    step: int | None
    instruction: str | None
    microbatch: int | None
    t_s: float


class RecordingClient:
    """A fake PerseusClient: every hook with its monotonic time."""

    def __init__(self, info: RankInfo, log: list[Event], fail_at: tuple[int, int] | None = None):
        self.info = info
        self.log = log
        self.step = -1
        self.fail_at = fail_at  # (step, instruction index) at which on_instruction_begin raises
        self.count = 0

    def _add(self, kind: str, instruction: str | None = None, mb: int | None = None) -> None:
        self.log.append(Event(self.info.rank, kind, self.step, instruction, mb, time.monotonic()))

    def on_step_begin(self, step: int) -> None:
        self.step = step
        self.count = 0
        self._add("step_begin")

    def on_step_end(self, step: int) -> None:
        self._add("step_end")

    def on_instruction_begin(self, name: str, microbatch: int | None = None) -> int | None:
        if self.fail_at == (self.step, self.count):
            raise RuntimeError(f"injected failure in rank {self.info.rank}")
        self.count += 1
        self._add("begin", name, microbatch)
        return None

    def on_instruction_end(self, name: str) -> None:
        self._add("end", name)

    def close(self) -> None:
        self._add("close")


def rank_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("emulated-rank-")]


# -- timing and energy ----------------------------------------------------------------------------


def test_iteration_time_at_max_clocks_is_the_planners(profile: Profile, baseline: Baseline) -> None:
    expected_s = baseline.time_s * TIMING_SCALE
    # The planner's critical path, by hand for identical stages: (M + S - 1) (f + b).
    f = profile.get(0, FORWARD).times_s[0]
    b = profile.get(0, BACKWARD).times_s[0]
    assert baseline.time_s == pytest.approx((MICROBATCHES + STAGES - 1) * (f + b), rel=1e-9)

    result = make_job(profile, time_scale=TIMING_SCALE).run(6)
    assert result.iterations == 6 and not result.stopped
    replicas_s = [
        statistics.median(r.replica_times_s[d] for r in result.records[1:]) for d in (0, 1)
    ]
    period_s = median_period_s(result.records)
    print(
        f"all-max iteration: planner {expected_s * 1e3:.2f} ms, replicas (median) "
        + ", ".join(f"{t * 1e3:.2f} ms (+{(t / expected_s - 1) * 100:.1f} %)" for t in replicas_s)
        + f", record period (median) {period_s * 1e3:.2f} ms "
        f"(+{(period_s / expected_s - 1) * 100:.1f} %)"
    )
    for measured_s in replicas_s:
        assert expected_s * 0.97 <= measured_s <= expected_s * (1 + TIME_TOLERANCE)
    # The job runs one iteration (and one all-reduce) per period.
    assert expected_s * 0.97 <= period_s <= expected_s * (1 + 1.5 * TIME_TOLERANCE)


def test_iteration_energy_is_busy_plus_blocking_energy(
    profile: Profile, baseline: Baseline
) -> None:
    result = make_job(profile).run(6)
    busy_power_w = baseline.busy_energy_j / baseline.busy_time_s
    num_gpus = 2 * STAGES
    # Iterations 2..5 (the first one's start is not recorded), both replicas.
    first, last = result.records[1], result.records[-1]
    iterations = last.iteration - first.iteration
    energy_j = last.energy_j - first.energy_j
    busy_s = last.busy_s - first.busy_s
    wall_s = last.end_s - first.end_s
    # The GPUs computed for about the profiled time (plus sleep overshoot, which a busy test
    # machine makes large) ...
    profiled_s = iterations * 2 * baseline.busy_time_s * TIME_SCALE
    assert 0.97 * profiled_s <= busy_s <= 1.3 * profiled_s
    # ... and waited at blocking power for the rest of each iteration.
    expected_j = busy_power_w * busy_s + BLOCKING_W * (num_gpus * wall_s - busy_s)
    assert energy_j == pytest.approx(expected_j, rel=0.05)
    compute_j = iterations * 2 * baseline.busy_energy_j * TIME_SCALE
    assert energy_j > compute_j  # pipeline bubbles cost blocking energy on top
    for record in result.records:
        assert sum(record.node_energy_j.values()) == pytest.approx(record.energy_j)
        assert sum(record.node_busy_s.values()) == pytest.approx(record.busy_s)
    assert result.energy_j is not None and result.start_energy_j is not None
    assert result.energy_j >= result.records[-1].energy_j > result.start_energy_j


def test_straggler_replica_is_slower_and_the_barrier_makes_the_other_wait(
    profile: Profile,
) -> None:
    job = make_job(profile, time_scale=TIMING_SCALE)  # 2 nodes x 4 GPUs: node k is replica k
    for index in range(4):
        job.backends[1].set_slowdown(index, 1.2)
    result = job.run(5)
    fast = statistics.median(r.replica_times_s[0] for r in result.records[1:])
    slow = statistics.median(r.replica_times_s[1] for r in result.records[1:])
    assert 1.1 <= slow / fast <= 1.3
    # An iteration of the job lasts as long as its slowest replica's.
    assert median_period_s(result.records) >= slow * 0.97
    first, last = result.records[1], result.records[-1]
    wall_s = last.end_s - first.end_s
    busy = {n: last.node_busy_s[n] - first.node_busy_s[n] for n in last.node_busy_s}
    idle = {n: 4 * wall_s - busy[n] for n in busy}
    assert busy["node-1"] / busy["node-0"] == pytest.approx(1.2, rel=0.08)
    # The fast replica's GPUs idle at blocking power while the slow one finishes.
    assert idle["node-0"] > idle["node-1"] + 0.5 * (busy["node-1"] - busy["node-0"])
    energy = {n: last.node_energy_j[n] - first.node_energy_j[n] for n in busy}
    assert energy["node-1"] > energy["node-0"]


def test_state_files_are_the_gpus_the_agent_would_read(profile: Profile, tmp_path: Path) -> None:
    job = make_job(profile, nodes=nodes(state_dir=tmp_path), time_scale=0.02)
    result = job.run(2)
    ended_s = time.monotonic()
    assert result.iterations == 2
    for k in range(2):
        agent_view = EmulatedBackend(
            4,
            profile,
            blocking_power_w=BLOCKING_W,
            node_name=f"node-{k}",
            state_file=tmp_path / f"node-{k}.json",
        )
        assert [agent_view.activity(i) for i in range(4)] == [None] * 4
        assert sum(agent_view.busy_s(i) for i in range(4)) == pytest.approx(
            result.records[-1].node_busy_s[f"node-{k}"]
        )
        energy_j = sum(agent_view.energy_j(i) for i in range(4))
        # Since the run read them, the idle GPUs drew blocking power (0.1 s: the time between
        # that reading and ended_s, on a busy test machine).
        since_end_j = 4 * BLOCKING_W * (time.monotonic() - ended_s + 0.1)
        at_end_j = result.node_energy_j[f"node-{k}"]
        assert at_end_j <= energy_j <= at_end_j + since_end_j


# -- dependencies and layout ----------------------------------------------------------------------


def test_ranks_follow_the_pipeline_dependencies_and_the_layout(profile: Profile) -> None:
    log: list[Event] = []
    infos: dict[int, RankInfo] = {}

    def factory(info: RankInfo) -> RecordingClient:
        infos[info.rank] = info
        return RecordingClient(info, log)

    steps = 3
    # 4 nodes x 2 GPUs: node k hosts ranks 2k and 2k+1.
    job = make_job(profile, nodes=nodes(4, 2), client_factory=factory, time_scale=0.02)
    result = job.run(steps)  # time scale 0.02: computed_by() below
    assert result.iterations == steps

    assert sorted(infos) == list(range(8))
    for rank, info in infos.items():
        assert (info.replica, info.stage) == divmod(rank, STAGES)
        assert (info.node_rank, info.gpu_index) == divmod(rank, 2)
        assert info.node.name == f"node-{rank // 2}"
        assert info.gpu_uuid == f"GPU-emu-node-{rank // 2}-{rank % 2}"

    by_rank: dict[int, list[Event]] = {r: [e for e in log if e.rank == r] for r in range(8)}
    for rank, events in by_rank.items():
        order = stage_instruction_order("1f1b", STAGES, MICROBATCHES, rank % STAGES)
        assert [e.kind for e in events][-1] == "close"
        for step in range(steps):
            mine = [e for e in events if e.step == step and e.kind != "close"]
            assert mine[0].kind == "step_begin" and mine[-1].kind == "step_end"
            begun = [(e.instruction, e.microbatch) for e in mine if e.kind == "begin"]
            assert begun == order

    def end_of(rank: int, step: int, instruction: str, mb: int) -> float:
        events = [e for e in by_rank[rank] if e.step == step]
        i = next(
            i
            for i, e in enumerate(events)
            if e.kind == "begin" and (e.instruction, e.microbatch) == (instruction, mb)
        )
        assert events[i + 1].kind == "end"
        return events[i + 1].t_s

    def begin_of(rank: int, step: int, instruction: str, mb: int) -> float:
        return next(
            e.t_s
            for e in by_rank[rank]
            if e.step == step
            and e.kind == "begin"
            and (e.instruction, e.microbatch) == (instruction, mb)
        )

    def computed_by(rank: int, step: int, instruction: str, mb: int) -> float:
        # The computation starts after its begin hook and runs its time at the max clock (no
        # clock changes here); the rank waiting on it starts then, before the producer's end
        # hook, which comes after the producer's own wake-up.
        backend = job.backends[infos[rank].node_rank]
        duration_s = backend.instruction_time_s(infos[rank].gpu_index, rank % STAGES, instruction)
        assert end_of(rank, step, instruction, mb) >= begin_of(rank, step, instruction, mb)
        return begin_of(rank, step, instruction, mb) + duration_s * 0.02

    checked = 0
    for step in range(steps):
        for replica in range(2):
            base = replica * STAGES
            for mb in range(MICROBATCHES):
                for stage in range(1, STAGES):
                    r = base + stage
                    assert begin_of(r, step, FORWARD, mb) >= computed_by(r - 1, step, FORWARD, mb)
                    checked += 1
                for stage in range(STAGES - 1):
                    r = base + stage
                    assert begin_of(r, step, BACKWARD, mb) >= computed_by(r + 1, step, BACKWARD, mb)
                    checked += 1
        # The all-reduce: no rank begins the next step before every rank ended this one.
        if step + 1 < steps:
            last_end = max(e.t_s for e in log if e.step == step and e.kind == "step_end")
            first_begin = min(e.t_s for e in log if e.step == step + 1 and e.kind == "step_begin")
            assert first_begin >= last_end
    assert checked == steps * 2 * MICROBATCHES * 2 * (STAGES - 1)


# -- stopping and errors --------------------------------------------------------------------------


class LateAgentClient(RecordingClient):
    """Hooks that take ``hook_s`` each, and lock the GPU at another clock ``lag_s`` after each
    computation begins, as an agent too slow to have the clock in place would."""

    hook_s = 0.0005
    lag_s = 0.003

    def __init__(self, info: RankInfo, log: list[Event], backend: EmulatedBackend) -> None:
        super().__init__(info, log)
        self.backend = backend
        self.clocks = backend.supported_sm_clocks_mhz(info.gpu_index)[:2]
        self.timers: list[threading.Timer] = []

    def on_instruction_begin(self, name: str, microbatch: int | None = None) -> int | None:
        time.sleep(self.hook_s)
        clock = self.clocks[self.count % 2]
        timer = threading.Timer(
            self.lag_s, self.backend.lock_sm_clock, (self.info.gpu_index, clock)
        )
        timer.start()
        self.timers.append(timer)
        return super().on_instruction_begin(name, microbatch)

    def close(self) -> None:
        for timer in self.timers:
            timer.join()
        super().close()


def test_records_carry_the_emulations_own_costs(profile: Profile) -> None:
    log: list[Event] = []
    backends: list[EmulatedBackend] = []

    def client(info: RankInfo) -> LateAgentClient:
        return LateAgentClient(info, log, backends[info.node_rank])

    # Slower than the other tests: computations must outlast the agent's lag.
    job = make_job(profile, client_factory=client, time_scale=0.2)
    backends.extend(job.backends)
    records = job.run(3).records
    instructions = STAGES * 2 * MICROBATCHES * 2  # per iteration: ranks x computations each
    for record in records[1:]:  # the first iteration's clocks start in place
        o = record.overheads
        assert o["hook_s"] >= instructions * LateAgentClient.hook_s
        # Computations see their clock change (to the other of two) while they run, timed when
        # the GPU changed, ``lag_s`` after the hook (most of them: on a loaded machine a timer
        # can fire after a short computation has ended).
        assert o["clock_changes"] >= 0.5 * instructions
        per_change_s = o["clock_lag_s"] / o["clock_changes"]
        assert 0.9 * LateAgentClient.lag_s <= per_change_s < LateAgentClient.lag_s + 0.005
        # Stages wait on each other: every forward but stage 0's and every backward but the
        # last stage's (when it has to wait at all).
        assert 0 < o["handoffs"] <= 2 * 2 * (STAGES - 1) * MICROBATCHES
        assert o["handoff_s"] > 0


def test_stop_ends_every_rank_after_the_current_iteration(profile: Profile) -> None:
    log: list[Event] = []
    two = threading.Event()
    job = make_job(
        profile,
        client_factory=lambda info: RecordingClient(info, log),
        on_iteration=lambda record: two.set() if record.iteration >= 1 else None,
    )
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.append(job.run()))
    runner.start()
    assert two.wait(10)
    stopped_at = time.monotonic()
    job.stop()
    runner.join(10)
    assert not runner.is_alive()
    # Promptly: within about one iteration (~80 ms here), generously.
    assert time.monotonic() - stopped_at < 1.0
    (result,) = results
    assert result.stopped and result.iterations >= 2
    assert rank_threads() == []
    assert sum(e.kind == "close" for e in log) == 8
    for backend in job.backends:
        assert [backend.activity(i) for i in range(4)] == [None] * 4
    with pytest.raises(RuntimeError, match="runs once"):
        job.run(1)


def test_an_error_in_one_rank_stops_the_job(profile: Profile) -> None:
    log: list[Event] = []

    def factory(info: RankInfo) -> RecordingClient:
        return RecordingClient(info, log, fail_at=(1, 5) if info.rank == 6 else None)

    job = make_job(profile, client_factory=factory)
    with pytest.raises(EmulatedJobError, match=r"rank 6.*injected failure") as info:
        job.run(50)
    assert info.value.rank == 6
    assert info.value.result.iterations == 1
    assert rank_threads() == []
    assert sum(e.kind == "close" for e in log) == 8
    for backend in job.backends:
        assert [backend.activity(i) for i in range(4)] == [None] * 4


def test_a_corrupted_state_file_stops_the_job(profile: Profile, tmp_path: Path) -> None:
    state_file = tmp_path / "node-1.json"

    def corrupt(record: IterationRecord) -> None:
        if record.iteration == 0:
            state_file.write_text("{not json")

    job = make_job(profile, nodes=nodes(state_dir=tmp_path), on_iteration=corrupt)
    with pytest.raises(EmulatedJobError, match=r"emulated GPU state file .* is invalid") as info:
        job.run(50)
    assert info.value.rank in range(4, 8)  # the ranks of node 1
    assert info.value.result.iterations == 1
    assert info.value.result.energy_j is None  # node 1's counters are unreadable
    assert rank_threads() == []


def test_a_failing_callback_stops_the_job(profile: Profile) -> None:
    def boom(record: IterationRecord) -> None:
        raise OSError("disk full")

    with pytest.raises(EmulatedJobError, match="bookkeeping: OSError: disk full") as info:
        make_job(profile, on_iteration=boom).run(5)
    assert info.value.rank is None
    assert info.value.result.iterations == 1
    assert rank_threads() == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 0}, "stages must be an integer >= 1"),
        ({"replicas": True}, "replicas must be an integer >= 1"),
        ({"time_scale": 0.0}, "time_scale must be a positive finite number"),
        ({"stages": 5, "replicas": 1}, "has 4 stages, the pipeline 5"),
        ({"replicas": 3}, "2 nodes x 4 GPUs = 8 GPUs, but 4 stages x 3 replicas = 12 ranks"),
        ({"nodes": []}, "at least one node"),
        ({"nodes": [NodeSpec("a", 4), NodeSpec("a", 4)]}, "repeated: a"),
        ({"nodes": [NodeSpec("a", 4), NodeSpec("b", 2), NodeSpec("c", 2)]}, "same number"),
        ({"schedule": "zigzag"}, "unknown schedule"),
    ],
)
def test_invalid_jobs_are_rejected(profile: Profile, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_job(profile, **kwargs)


def test_invalid_steps_are_rejected(profile: Profile) -> None:
    job = make_job(profile)
    for steps in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="steps must be"):
            job.run(steps)  # type: ignore[arg-type]


# -- command line ---------------------------------------------------------------------------------


@pytest.fixture
def profile_csv(tmp_path: Path) -> Path:
    path = tmp_path / "gpt3-4stages.csv"
    path.write_text(cut_profile(STAGES))
    return path


def cli_args(profile_csv: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--profile",
        str(profile_csv),
        "--blocking-power",
        str(BLOCKING_W),
        "--stages",
        str(STAGES),
        "--replicas",
        "2",
        "--microbatches",
        str(MICROBATCHES),
        "--time-scale",
        "0.02",
        "--node",
        f"name=a,gpus=4,state={tmp_path / 'a.json'},socket={tmp_path / 'absent.sock'}",
        "--node",
        "gpus=4",
        *extra,
    ]


def test_cli_appends_records_and_prints_a_summary(
    profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "iterations.jsonl"
    log.write_text('{"earlier": true}\n')
    assert main(cli_args(profile_csv, tmp_path, "--steps", "3", "--log", str(log))) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0] == {"earlier": True}  # appended
    records = lines[1:]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for r in records:
        assert set(r) == {
            "iteration",
            "end_s",
            "replica_times_s",
            "energy_j",
            "node_energy_j",
            "busy_s",
            "node_busy_s",
            "overheads",
        }
        assert set(r["overheads"]) == set(OVERHEADS)
        assert len(r["replica_times_s"]) == 2
        assert set(r["node_energy_j"]) == {"a", "node-1"}  # default names by node rank
    assert records[0]["energy_j"] < records[1]["energy_j"] < records[2]["energy_j"]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["iterations"] == 3 and summary["stopped"] is False
    assert summary["energy_j"] >= records[-1]["energy_j"]
    assert summary["energy_used_j"] > 0
    assert len(summary["mean_replica_times_s"]) == 2
    assert (tmp_path / "a.json").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--node", "gpus=0"], "expected an integer >= 1"),
        (["--node", "gpus=4,colour=red"], "unknown key 'colour'"),
        (["--node", "name=x"], "gpus=N is required"),
        (["--node", "gpus=4,name"], "expected KEY=VALUE"),
        (["--time-scale", "-1"], "expected a positive finite number"),
        (["--steps", "0"], "expected an integer >= 1"),
        (["--replicas", "3"], "2 nodes x 4 GPUs = 8 GPUs"),
        (["--schedule", "zigzag"], "unknown schedule"),
        (["--profile", "/nonexistent/profile.csv"], "cannot read profile"),
    ],
)
def test_cli_rejects_bad_arguments(
    profile_csv: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: list[str],
    message: str,
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*cli_args(profile_csv, tmp_path), *change])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "perseus-emulated-job: error:" in err and message in err


def test_cli_needs_a_node(profile_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--profile", str(profile_csv), "--blocking-power", "80", "--stages", "4"])
    assert info.value.code == 2
    assert "--node" in capsys.readouterr().err


@pytest.fixture
def process_env() -> Iterator[dict[str, str]]:
    yield {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "operator"), str(REPO_ROOT / "node_agent")]),
    }


def test_cli_runs_until_sigterm_while_the_log_is_tailed(
    profile_csv: Path, tmp_path: Path, process_env: dict[str, str]
) -> None:
    log = tmp_path / "iterations.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "perseus_emulation.job",
            *cli_args(profile_csv, tmp_path, "--log", str(log)),
        ],
        env=process_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and len(log.read_text().splitlines()) >= 2:
                break
            time.sleep(0.02)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(records) >= 2, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped"] is True
    assert summary["iterations"] == len(log.read_text().splitlines()) >= 2
