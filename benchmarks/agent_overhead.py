"""Overhead of the node agent: client hook round trips and the agent's CPU and memory.

Three measurements, all on this machine without a GPU:

1. **Anchor**: a bare ``pynvml`` call (``nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM)``, and
   ``nvmlDeviceSetGpuLockedClocks`` for comparison) against the emulated ``libnvidia-ml.so.1``
   the tests use (``tests/fixtures/fake_nvml/fake_nvml.c``, built here with gcc), in a fresh
   subprocess with ``LD_LIBRARY_PATH`` pointing at it. p50/p99 in µs.
2. **Hooks**: a standalone ``perseus-node-agent`` with 8 GPUs and an ``Instruction``
   granularity plan (8-stage 1F1B, 8 microbatches); one ``perseus_client.PerseusClient`` on
   GPU 0 calls ``on_step_begin``, ``on_instruction_begin``/``on_instruction_end`` for every
   computation of stage 0 in schedule order, and ``on_step_end``, back to back. Each call is
   timed around the client method (what a training loop pays). Two plans: consecutive
   computations at *different* clocks (every ``instruction_begin`` changes the clock) and all
   computations at the *same* clock (the agent's lock is a no-op), which leaves the socket
   round trip plus the agent's bookkeeping. The agent runs with ``--gpu-backend nvml`` over
   the emulated library: the path a real node takes. Information only: the same two plans with
   the emulated backend (tests and demos; it shares its GPUs through a state file), and the
   same client against three minimal servers of the protocol (one blocking thread; an asyncio
   server answering in its event loop; an asyncio server answering from a thread pool):
   floors that separate the transport and the server's threading from the agent's own work.
   Each scenario also reports the server's CPU time per call (``/proc/<pid>/stat``).
3. **Footprint**: the agent (NVML backend over the emulated library, 8 GPUs, 1 s scrape
   interval) while idle (no training process) and while one client drives ~20
   instructions/s; ``/metrics`` is fetched once a second by a small HTTP loop that sends
   Prometheus' ``Accept`` header. Agent CPU time from ``/proc/<pid>/stat`` (utime + stime,
   all threads) over the phase; RSS from ``/proc/<pid>/status`` (``VmRSS``) once a second.
   Shorter variants, information only: the emulated backend (with the bundled profile, and
   given its profile explicitly), and the three minimal servers at the same rate.

Targets (from the issue), checked on the NVML path: p99 hook round trip with a no-op clock
under 200 µs (over all hook calls, and over ``instruction_begin`` alone); agent under 2 % of
one core in both footprint phases and under 80 MiB RSS.

Run from the repository root (about 2 minutes)::

    python benchmarks/agent_overhead.py
    python benchmarks/agent_overhead.py --iterations 100 --footprint-seconds 10 --no-variants

Exit status: 0 when every target is met, 1 when one is missed (everything is printed first),
2 when the benchmark could not run (no gcc, the agent did not start, a hook failed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = (REPO / "operator", REPO / "node_agent")
for _root, _package in zip(SOURCE_ROOTS, ("perseus_api", "perseus_client"), strict=True):
    if importlib.util.find_spec(_package) is None:
        sys.path.insert(0, str(_root))

from perseus_api.node_plan import NodePlan  # noqa: E402
from perseus_api.schedule import Schedule, stage_instruction_order  # noqa: E402
from perseus_client import PerseusClient  # noqa: E402

FAKE_NVML_SOURCE = REPO / "tests" / "fixtures" / "fake_nvml" / "fake_nvml.c"
FAKE_NVML_UUID = "GPU-fa4e0000-0000-4000-8000-{index:012d}"  # format_uuid() in fake_nvml.c
PROFILE = REPO / "operator" / "perseus_planner" / "profiles" / "gpt3-175b+a100_sxm_bf16.csv"
BLOCKING_POWER_W = 83.64  # the agent's default for the bundled profile

NODE = "bench"
NUM_GPUS = 8
NUM_STAGES = 8
NUM_MICROBATCHES = 8
FAST_MHZ, SLOW_MHZ = 1410, 1200  # supported by the bundled profile and by the fake library

TARGET_P99_US = 200.0
TARGET_CPU_PERCENT = 2.0
TARGET_RSS_MIB = 80.0
MAIN_FOOTPRINT = "nvml (fake lib)"

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
CLIENT_TIMEOUT_S = 5.0  # generous: a stalled reply must be measured, not drop the connection
SCRAPE_INTERVAL_S = 1.0
LOADED_RATE_HZ = 20.0
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
HOOKS = ("step_begin", "instruction_begin", "instruction_end", "step_end")


class BenchmarkError(RuntimeError):
    """The benchmark cannot go on (exit status 2)."""


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Stats:
    """Distribution of latencies."""

    n: int
    p50_us: float
    p99_us: float
    max_us: float

    @classmethod
    def of(cls, samples_ns: Sequence[int]) -> Stats:
        if not samples_ns:
            return cls(0, math.nan, math.nan, math.nan)
        ordered = sorted(samples_ns)
        return cls(
            len(ordered),
            _percentile(ordered, 0.50) / 1e3,
            _percentile(ordered, 0.99) / 1e3,
            ordered[-1] / 1e3,
        )


def _percentile(ordered: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of sorted samples."""
    rank = max(1, math.ceil(q * len(ordered)))
    return float(ordered[rank - 1])


# --------------------------------------------------------------------------- anchor: bare NVML


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile the emulated NVML library into ``out_dir/libnvidia-ml.so.1``; return ``out_dir``."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise BenchmarkError("no C compiler (gcc) to build the emulated libnvidia-ml.so.1")
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
    command += ["-o", str(out_dir / "libnvidia-ml.so.1"), str(FAKE_NVML_SOURCE), "-lpthread"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BenchmarkError(f"cannot build the emulated NVML library:\n{result.stderr}")
    return out_dir


def fake_nvml_env(lib_dir: Path, state_file: Path | None = None) -> dict[str, str]:
    """Environment of a process that loads the emulated library (``NUM_GPUS`` GPUs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML")}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(lib_dir), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    )
    env["FAKE_NVML_GPUS"] = str(NUM_GPUS)
    if state_file is not None:
        env["FAKE_NVML_STATE"] = str(state_file)
    return env


_ANCHOR_CODE = """
import json, sys, time
import pynvml

calls, warmup, fast, slow = map(int, sys.argv[1:5])
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
clock = time.perf_counter_ns
get = pynvml.nvmlDeviceGetClockInfo
lock = pynvml.nvmlDeviceSetGpuLockedClocks
sm = pynvml.NVML_CLOCK_SM
clocks = (fast, slow)
out = {"get": [], "set": []}
for i in range(warmup + calls):
    t = clock()
    get(handle, sm)
    dt = clock() - t
    if i >= warmup:
        out["get"].append(dt)
for i in range(warmup + calls):
    mhz = clocks[i % 2]  # every call changes the lock
    t = clock()
    lock(handle, mhz, mhz)
    dt = clock() - t
    if i >= warmup:
        out["set"].append(dt)
pynvml.nvmlDeviceResetGpuLockedClocks(handle)
pynvml.nvmlShutdown()
json.dump(out, sys.stdout)
"""


def measure_bare_nvml(lib_dir: Path, calls: int, state_file: Path | None) -> dict[str, Stats]:
    """Bare pynvml calls against the emulated library, in a fresh interpreter."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _ANCHOR_CODE,
            *map(str, (calls, max(100, calls // 10), FAST_MHZ, SLOW_MHZ)),
        ],
        env=fake_nvml_env(lib_dir, state_file),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise BenchmarkError(f"bare NVML calls failed:\n{result.stderr}")
    samples = json.loads(result.stdout)
    return {kind: Stats.of(samples[kind]) for kind in ("get", "set")}


# --------------------------------------------------------------------------- plans


def stage_order(stage: int) -> list[tuple[str, int]]:
    return stage_instruction_order(Schedule.ONE_F_ONE_B, NUM_STAGES, NUM_MICROBATCHES, stage)


def clock_at(position: int, *, alternate: bool) -> int:
    """Clock of the computation at ``position`` of a stage's schedule."""
    return (FAST_MHZ if position % 2 == 0 else SLOW_MHZ) if alternate else SLOW_MHZ


def node_plan_document(*, alternate: bool) -> dict[str, Any]:
    """An ``Instruction`` NodePlan for all GPUs: GPU i runs stage i of an 8-stage 1F1B pipeline.

    ``alternate``: consecutive computations alternate between two clocks (each instruction
    changes the clock; 16 computations per stage, so also across iterations); otherwise all
    run at one clock (after the first, every lock is a no-op).
    """
    estimate = {"iteration_time_s": 1.0, "energy_j": 100.0, "savings_ratio": 0.1}
    stages = [
        {
            "stage": s,
            "frequency_mhz": FAST_MHZ,
            "instructions": [
                {
                    "instruction": kind,
                    "microbatch": mb,
                    "frequency_mhz": clock_at(p, alternate=alternate),
                }
                for p, (kind, mb) in enumerate(stage_order(s))
            ],
        }
        for s in range(NUM_STAGES)
    ]
    pipeline = {
        "schedule": "1f1b",
        "num_stages": NUM_STAGES,
        "num_microbatches": NUM_MICROBATCHES,
        "granularity": "Instruction",
        "objective": "MinTime",
        "unit_time_s": 0.001,
        "blocking_power_w": BLOCKING_POWER_W,
        "t_min_s": 1.0,
        "t_star_s": 1.2,
        "baseline_iteration_time_s": 1.01,
        "instruction_estimate": estimate,
        "stage_estimate": estimate,
        "stages": stages,
    }
    document = {
        "node": NODE,
        "namespace": "bench",
        "job": "agent-overhead",
        "revision": 1,
        "granularity": "Instruction",
        "plans": {"p": pipeline},
        # By index, so the same plan fits the emulated and the NVML backend.
        "assignments": [
            {"gpu_index": i, "plan": "p", "stage": i, "rank": i} for i in range(NUM_GPUS)
        ],
    }
    NodePlan.model_validate(document)  # fail here, not in the agent
    return document


# --------------------------------------------------------------------------- the agent process


def _source_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, SOURCE_ROOTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.pop("NODE_NAME", None)
    return env


class ServerProcess:
    """A server process the benchmark starts in ``root/name``; its CPU and memory from /proc."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.socket_path = self.dir / "run" / "agent.sock"
        self.log_file = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.command: list[str] = []
        self.env = _source_env()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def gpu_uuid(self, index: int) -> str:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        """Start the process and wait until it is ready."""
        self.socket_path.parent.mkdir(exist_ok=True)
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.dir,
                start_new_session=True,  # Ctrl-C reaches the benchmark, which stops the server
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchmarkError(
                    f"{self.name} exited ({self.proc.returncode}) at start:\n{self.log}"
                )
            if self._ready():
                return
            time.sleep(0.05)
        raise BenchmarkError(f"{self.name} did not start in {START_TIMEOUT_S:.0f} s:\n{self.log}")

    def stop(self) -> None:
        """SIGTERM (an agent resets its clocks), SIGKILL if it does not exit in time."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"{self.name} did not stop after SIGTERM; killing it", file=sys.stderr)
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)

    def cpu_seconds(self) -> float:
        """User + system CPU time of every thread of the process so far."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def status_kib(self, key: str) -> int:
        """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) or ``Threads``."""
        match = re.search(rf"^{key}:\s+(\d+)", Path(f"/proc/{self.pid}/status").read_text(), re.M)
        if match is None:
            raise BenchmarkError(f"no {key} in /proc/{self.pid}/status")
        return int(match.group(1))


class AgentProcess(ServerProcess):
    """One ``perseus-node-agent --standalone`` process with ``NUM_GPUS`` GPUs."""

    def __init__(
        self,
        root: Path,
        name: str,
        plan: dict[str, Any],
        *,
        backend: str = "emulated",
        fake_nvml_dir: Path | None = None,
        explicit_profile: bool = False,
    ) -> None:
        super().__init__(root, name)
        self.backend = backend
        self.plan_file = self.dir / "plan.json"
        self.plan_file.write_text(json.dumps(plan))
        self.port: int | None = None
        self.command = [
            sys.executable,
            "-m",
            "perseus_agent.main",
            "--standalone",
            f"--plan-file={self.plan_file}",
            f"--gpu-backend={backend}",
            f"--node-name={NODE}",
            "--metrics-port=0",
            "--metrics-address=127.0.0.1",
            f"--socket-dir={self.socket_path.parent}",
            f"--state-dir={self.dir / 'state'}",
        ]
        if backend == "emulated":
            self.command += [
                f"--emulated-gpus={NUM_GPUS}",
                f"--emulated-state-file={self.dir / 'gpus.json'}",
            ]
            if explicit_profile:
                self.command += [
                    f"--emulated-profile={PROFILE}",
                    f"--emulated-blocking-power={BLOCKING_POWER_W}",
                ]
        else:
            assert fake_nvml_dir is not None
            self.env.update(fake_nvml_env(fake_nvml_dir))

    def gpu_uuid(self, index: int) -> str:
        if self.backend == "emulated":
            return f"GPU-emu-{NODE}-{index}"
        return FAKE_NVML_UUID.format(index=index)

    def _ready(self) -> bool:
        """Serving metrics and the socket, and the plan applied."""
        text = self.log
        match = re.search(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics", text)
        if match is None or "applied plan bench/agent-overhead revision 1" not in text:
            return False
        if not self.socket_path.exists():
            return False
        self.port = int(match.group(1))
        try:
            return self.get("/healthz") == b"ok\n"
        except OSError:
            return False

    def get(self, path: str, headers: dict[str, str] | None = None) -> bytes:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", headers=headers or {}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body: bytes = response.read()
            return body

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` with ``labels`` (0 when there is none)."""
        total = 0.0
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


# A minimal server of the client protocol, to separate the cost of the transport (client, kernel,
# JSON and validation on both sides) from the agent's: the same requests are decoded and the
# replies encoded with perseus_client.protocol, and instruction_begin always answers one clock.
# blocking: one thread, blocking socket; asyncio: an asyncio Unix server answering in the event
# loop; asyncio+executor: the handler in a thread pool (run_in_executor), as LocalServer once did.
_FLOOR_CODE = """
import asyncio, socket, sys
from concurrent.futures import ThreadPoolExecutor
from perseus_client.protocol import decode_request, encode_reply

path, mode, clock = sys.argv[1], sys.argv[2], int(sys.argv[3])

def handle(line):
    msg = decode_request(line)
    reply = {"ok": True}
    if msg["op"] == "instruction_begin":
        reply["sm_clock_mhz"] = clock
    return encode_reply(reply, msg["op"])

if mode == "blocking":
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                conn.sendall(handle(line))
else:
    executor = ThreadPoolExecutor(16) if mode == "asyncio+executor" else None

    async def serve(reader, writer):
        loop = asyncio.get_running_loop()
        while True:
            try:
                line = await reader.readuntil(b"\\n")
            except asyncio.IncompleteReadError:
                break
            if executor is None:
                data = handle(line)
            else:
                data = await loop.run_in_executor(executor, handle, line)
            writer.write(data)
            await writer.drain()
        writer.close()

    async def main():
        await asyncio.start_unix_server(serve, path)
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
"""


class FloorServer(ServerProcess):
    """A minimal protocol server (``mode``: blocking, asyncio, asyncio+executor)."""

    MODES = ("blocking", "asyncio", "asyncio+executor")

    def __init__(self, root: Path, name: str, mode: str) -> None:
        super().__init__(root, name)
        self.mode = mode
        self.command = [
            sys.executable,
            "-c",
            _FLOOR_CODE,
            str(self.socket_path),
            mode,
            str(SLOW_MHZ),
        ]

    def gpu_uuid(self, index: int) -> str:
        return f"GPU-floor-{index}"

    def _ready(self) -> bool:
        return self.socket_path.exists() and "ready" in self.log


# --------------------------------------------------------------------------- hooks


def new_client(server: ServerProcess, *, pipelined: bool = False) -> PerseusClient:
    return PerseusClient(
        server.socket_path,
        rank=0,
        local_rank=0,
        gpu_uuids=[server.gpu_uuid(0)],
        job="agent-overhead",
        connect_timeout_s=CLIENT_TIMEOUT_S,
        reply_timeout_s=CLIENT_TIMEOUT_S,
        retry_interval_s=1.0,
        pipelined=pipelined,
    )


@dataclass
class HookRun:
    samples_ns: dict[str, list[int]] = field(default_factory=lambda: {h: [] for h in HOOKS})
    wrong_clock: int = 0
    instructions: int = 0


def drive_hooks(
    client: PerseusClient,
    iterations: int,
    *,
    alternate: bool,
    run: HookRun | None = None,
    period_s: float | None = None,
    stop: threading.Event | None = None,
) -> HookRun:
    """Play stage 0's schedule ``iterations`` times (until ``stop``), timing every hook.

    ``period_s``: pace instructions one per period (``instruction_end`` at 80 % of it);
    ``None``: back to back.
    """
    run = run or HookRun()
    order = stage_order(0)
    expected = [clock_at(p, alternate=alternate) for p in range(len(order))]
    now = time.perf_counter_ns
    samples = run.samples_ns
    next_s = time.monotonic()
    for step in range(iterations):
        if stop is not None and stop.is_set():
            break
        t = now()
        client.on_step_begin(step)
        samples["step_begin"].append(now() - t)
        for position, (kind, microbatch) in enumerate(order):
            t = now()
            clock = client.on_instruction_begin(kind, microbatch)
            samples["instruction_begin"].append(now() - t)
            run.instructions += 1
            if clock != expected[position] and not client.pipelined:
                run.wrong_clock += 1
            if period_s is not None:
                _sleep_until(next_s + 0.8 * period_s)
            t = now()
            client.on_instruction_end(kind)
            samples["instruction_end"].append(now() - t)
            if period_s is not None:
                next_s += period_s
                _sleep_until(next_s)
        t = now()
        client.on_step_end(step)
        samples["step_end"].append(now() - t)
    return run


def _sleep_until(monotonic_s: float) -> None:
    delay = monotonic_s - time.monotonic()
    if delay > 0:
        time.sleep(delay)


@dataclass(frozen=True)
class HookResult:
    scenario: str
    backend: str
    alternate: bool
    pipelined: bool
    stats: dict[str, Stats]  # by hook, plus "all"
    clock_changes: float
    server_cpu_us_per_call: float  # server CPU time (all threads) over the run / hook calls
    wall_s: float


def measure_hooks(
    server: ServerProcess,
    label: str,
    *,
    alternate: bool,
    iterations: int,
    warmup: int,
    stack: contextlib.ExitStack,
    pipelined: bool = False,
) -> HookResult:
    """Start ``server``, time ``iterations`` iterations of hooks after ``warmup``, stop it.

    A pipelined client is flushed (every reply received) before the server's CPU time and
    metrics are read, so they cover all the work of the timed hooks.
    """
    agent = server if isinstance(server, AgentProcess) else None
    stack.callback(server.stop)
    server.start()
    client = new_client(server, pipelined=pipelined)
    changes = mismatches = math.nan
    try:
        drive_hooks(client, warmup, alternate=alternate)  # connects; first lock is recorded
        flushed = client.flush()
        if agent is not None:
            changes = -agent.metric("perseus_gpu_clock_changes_total", gpu="0")
        cpu_before, wall_before = server.cpu_seconds(), time.monotonic()
        run = drive_hooks(client, iterations, alternate=alternate)
        flushed = client.flush() and flushed
        cpu_s, wall_s = server.cpu_seconds() - cpu_before, time.monotonic() - wall_before
        if agent is not None:
            changes += agent.metric("perseus_gpu_clock_changes_total", gpu="0")
            mismatches = agent.metric(
                "perseus_agent_apply_errors_total", reason="schedule_mismatch"
            )
        connections = client.connections
    finally:
        client.close()
    if connections != 1 or not flushed or run.wrong_clock or mismatches > 0:
        raise BenchmarkError(
            f"{server.name}: hooks misbehaved (connections {connections}, flushed {flushed}, "
            f"{run.wrong_clock} replies with an unexpected clock, {mismatches:.0f} schedule "
            f"mismatches):\n"
            f"{server.log}"
        )
    server.stop()
    stats = {hook: Stats.of(run.samples_ns[hook]) for hook in HOOKS}
    stats["all"] = Stats.of([s for hook in HOOKS for s in run.samples_ns[hook]])
    kind = agent.backend if agent is not None else "floor"
    cpu_per_call_us = 1e6 * cpu_s / stats["all"].n
    return HookResult(label, kind, alternate, pipelined, stats, changes, cpu_per_call_us, wall_s)


# --------------------------------------------------------------------------- footprint


@dataclass(frozen=True)
class Phase:
    config: str
    phase: str
    wall_s: float
    cpu_percent: float
    rss_mean_mib: float
    rss_max_mib: float
    hwm_mib: float
    threads: int
    scrapes: int
    scrape_p50_ms: float
    scrape_max_ms: float
    scrape_kib: float
    instructions_per_s: float


def sample_phase(
    server: ServerProcess, config: str, phase: str, duration_s: float, run: HookRun | None
) -> Phase:
    """CPU and RSS of ``server`` over ``duration_s``; an agent's ``/metrics`` scraped every second.

    RSS is sampled once a second; CPU is the difference of the process's CPU time.
    """
    agent = server if isinstance(server, AgentProcess) else None
    headers = {"Accept": PROMETHEUS_ACCEPT}
    rss: list[int] = []
    scrape_ns: list[int] = []
    size = math.nan
    instructions_before = run.instructions if run is not None else 0
    t0 = time.monotonic()
    cpu0 = server.cpu_seconds()
    tick = 0
    while True:
        if agent is not None:
            t = time.perf_counter_ns()
            size = len(agent.get("/metrics", headers))
            scrape_ns.append(time.perf_counter_ns() - t)
        rss.append(server.status_kib("VmRSS"))
        tick += 1
        if tick * SCRAPE_INTERVAL_S >= duration_s:
            _sleep_until(t0 + duration_s)
            break
        _sleep_until(t0 + tick * SCRAPE_INTERVAL_S)
    cpu1 = server.cpu_seconds()
    wall = time.monotonic() - t0
    instructions = (run.instructions if run is not None else 0) - instructions_before
    scrapes = Stats.of(scrape_ns)
    return Phase(
        config=config,
        phase=phase,
        wall_s=wall,
        cpu_percent=100.0 * (cpu1 - cpu0) / wall,
        rss_mean_mib=sum(rss) / len(rss) / 1024,
        rss_max_mib=max(rss) / 1024,
        hwm_mib=server.status_kib("VmHWM") / 1024,
        threads=server.status_kib("Threads"),
        scrapes=scrapes.n,
        scrape_p50_ms=scrapes.p50_us / 1e3,
        scrape_max_ms=scrapes.max_us / 1e3,
        scrape_kib=size / 1024,
        instructions_per_s=instructions / wall,
    )


@contextlib.contextmanager
def paced_hooks(server: ServerProcess, *, alternate: bool) -> Iterator[HookRun]:
    """One client driving ~``LOADED_RATE_HZ`` instructions/s in a thread while the body runs."""
    client = new_client(server)
    stop = threading.Event()
    run = HookRun()
    errors: list[BaseException] = []

    def driver() -> None:
        try:
            drive_hooks(
                client,
                10**9,
                alternate=alternate,
                run=run,
                period_s=1.0 / LOADED_RATE_HZ,
                stop=stop,
            )
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=driver, name="hook-driver", daemon=True)
    thread.start()
    try:
        time.sleep(1.0)  # connected, clocks switching
        yield run
    finally:
        stop.set()
        thread.join(timeout=10)
        client.close()
    if errors:
        raise BenchmarkError(f"{server.name}: the hook driver failed: {errors[0]!r}")
    if run.wrong_clock or client.connections != 1:
        raise BenchmarkError(
            f"{server.name}: hooks misbehaved (connections {client.connections}, "
            f"{run.wrong_clock} unexpected clocks):\n{server.log}"
        )


LOADED = f"{LOADED_RATE_HZ:.0f} instr/s"


def measure_footprint(
    root: Path,
    name: str,
    config: str,
    *,
    seconds: float,
    backend: str = "emulated",
    fake_nvml_dir: Path | None = None,
    explicit_profile: bool = False,
    stack: contextlib.ExitStack,
) -> list[Phase]:
    """Idle, then one client at ~20 instructions/s (alternating clocks), scraped once a second."""
    plan = node_plan_document(alternate=True)
    agent = AgentProcess(
        root,
        name,
        plan,
        backend=backend,
        fake_nvml_dir=fake_nvml_dir,
        explicit_profile=explicit_profile,
    )
    stack.callback(agent.stop)
    agent.start()
    agent.get("/metrics", {"Accept": PROMETHEUS_ACCEPT})  # first scrape's lazy work: not counted
    time.sleep(1.0)
    phases = [sample_phase(agent, config, "idle", seconds, None)]
    with paced_hooks(agent, alternate=True) as run:
        phases.append(sample_phase(agent, config, LOADED, seconds, run))
    agent.stop()
    return phases


def measure_floor_footprint(
    root: Path, mode: str, *, seconds: float, stack: contextlib.ExitStack
) -> Phase:
    """A minimal protocol server's CPU at ~20 instructions/s (no /metrics)."""
    server = FloorServer(root, f"footprint-floor-{FloorServer.MODES.index(mode)}", mode)
    stack.callback(server.stop)
    server.start()
    with paced_hooks(server, alternate=False) as run:
        phase = sample_phase(server, f"floor: {mode} server", LOADED, seconds, run)
    server.stop()
    return phase


# --------------------------------------------------------------------------- report


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def print_anchor(anchor: dict[str, dict[str, Stats]]) -> None:
    rows = []
    for label, by_kind in anchor.items():
        for kind, call in (
            ("get", "nvmlDeviceGetClockInfo(SM)"),
            ("set", "nvmlDeviceSetGpuLockedClocks"),
        ):
            s = by_kind[kind]
            rows.append([f"{call}, {label}", s.n, s.p50_us, s.p99_us, s.max_us])
    print("\n== Anchor: bare pynvml call on the emulated libnvidia-ml.so.1 (µs)")
    print(table(["call", "n", "p50", "p99", "max"], rows))


def print_hooks(results: Sequence[HookResult], bare: Stats) -> None:
    print(
        f"\n== Hook cost in the training process (µs; synchronous: the round trip through the "
        f"socket; pipelined: sending), client on GPU 0, stage 0 of "
        f"{NUM_STAGES}-stage 1F1B x {NUM_MICROBATCHES} microbatches; ratio = p99 / p99 of the "
        f"bare nvmlDeviceGetClockInfo ({bare.p99_us:.2f} µs)"
    )
    rows = []
    for r in results:
        clocks = "changes every instr." if r.alternate else "same clock (no-op)"
        for hook in (*HOOKS, "all"):
            s = r.stats[hook]
            rows.append(
                [
                    f"{r.scenario}" if hook == HOOKS[0] else "",
                    clocks if hook == HOOKS[0] else "",
                    hook,
                    s.n,
                    s.p50_us,
                    s.p99_us,
                    s.max_us,
                    f"{s.p99_us / bare.p99_us:.0f}x",
                ]
            )
        if not math.isnan(r.clock_changes):
            rows.append(["", f"clock changes: {r.clock_changes:.0f}", *[""] * 6])
        rows.append(
            [
                "",
                f"server CPU: {r.server_cpu_us_per_call:.0f} µs/call",
                f"({r.stats['all'].n / r.wall_s:.0f} calls/s)",
                *[""] * 5,
            ]
        )
    print(table(["scenario", "plan", "hook", "n", "p50", "p99", "max", "p99 ratio"], rows))


def print_footprint(phases: Sequence[Phase]) -> None:
    print(
        f"\n== Footprint, agent with {NUM_GPUS} GPUs, /metrics every {SCRAPE_INTERVAL_S:g} s "
        "(minimal servers: not scraped); CPU: % of one core; RSS, HWM: MiB"
    )
    rows = [
        [
            p.config,
            p.phase,
            p.wall_s,
            p.instructions_per_s,
            p.cpu_percent,
            p.rss_mean_mib,
            p.rss_max_mib,
            p.hwm_mib,
            p.threads,
            p.scrapes,
            p.scrape_p50_ms,
            p.scrape_max_ms,
            p.scrape_kib,
        ]
        for p in phases
    ]
    headers = [
        "config",
        "phase",
        "wall s",
        "instr/s",
        "CPU %",
        "RSS mean",
        "RSS max",
        "HWM",
        "threads",
        "scrapes",
        "scrape p50 ms",
        "max ms",
        "KiB",
    ]
    print(table(headers, rows))


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--iterations",
        type=int,
        default=300,
        help="training iterations per hook scenario; 34 hook calls each (default: 300)",
    )
    parser.add_argument(
        "--bare-calls", type=int, default=20000, help="bare NVML calls per kind (default: 20000)"
    )
    parser.add_argument(
        "--footprint-seconds",
        type=float,
        default=30.0,
        help="length of each footprint phase (default: 30)",
    )
    parser.add_argument(
        "--variant-seconds",
        type=float,
        default=5.0,
        help="length of each phase of the informational variants (default: 5)",
    )
    parser.add_argument(
        "--no-variants",
        action="store_true",
        help="skip the informational scenarios (emulated backend, minimal servers)",
    )
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def workspace() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes: keep the directory short.
    root = Path(tempfile.mkdtemp(prefix="pab-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path, stack: contextlib.ExitStack) -> bool:
    started = time.monotonic()
    print(
        f"perseus node agent overhead: {NUM_GPUS} GPUs, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs"
    )
    lib_dir = build_fake_nvml(root / "fake_nvml")
    anchor = {
        "in memory": measure_bare_nvml(lib_dir, args.bare_calls, None),
        "state file": measure_bare_nvml(
            lib_dir, max(1000, args.bare_calls // 10), root / "fake_nvml" / "state"
        ),
    }
    bare = anchor["in memory"]["get"]
    print_anchor(anchor)

    warmup = max(3, args.iterations // 50)

    def agent(backend: str, alternate: bool) -> Callable[[str], ServerProcess]:
        plan = node_plan_document(alternate=alternate)
        return lambda name: AgentProcess(root, name, plan, backend=backend, fake_nvml_dir=lib_dir)

    def floor(mode: str) -> Callable[[str], ServerProcess]:
        return lambda name: FloorServer(root, name, mode)

    # The targets are checked on the path a real node takes: the NVML backend (here over the
    # emulated library). The emulated backend (tests, demos) is reported beside it.
    nvml = "agent, nvml (fake lib)"
    scenarios: list[tuple[str, Callable[[str], ServerProcess], bool, bool]] = [
        (f"{nvml}, pipelined", agent("nvml", True), True, True),
        (f"{nvml}, pipelined", agent("nvml", False), False, True),
        (nvml, agent("nvml", True), True, False),
        (nvml, agent("nvml", False), False, False),
    ]
    if not args.no_variants:
        scenarios += [
            ("agent, emulated", agent("emulated", True), True, False),
            ("agent, emulated", agent("emulated", False), False, False),
            *((f"floor: {mode} server", floor(mode), False, False) for mode in FloorServer.MODES),
        ]
    hooks = [
        measure_hooks(
            make(f"hooks-{index}"),
            label,
            alternate=alternate,
            pipelined=pipelined,
            iterations=args.iterations,
            warmup=warmup,
            stack=stack,
        )
        for index, (label, make, alternate, pipelined) in enumerate(scenarios)
    ]
    print_hooks(hooks, bare)

    phases = measure_footprint(
        root,
        "footprint-nvml",
        MAIN_FOOTPRINT,
        seconds=args.footprint_seconds,
        backend="nvml",
        fake_nvml_dir=lib_dir,
        stack=stack,
    )
    if not args.no_variants:
        phases += measure_footprint(
            root, "footprint", "emulated", seconds=args.variant_seconds, stack=stack
        )
        phases += measure_footprint(
            root,
            "footprint-profile",
            "emulated, --emulated-profile",
            seconds=args.variant_seconds,
            explicit_profile=True,
            stack=stack,
        )
        phases += [
            measure_floor_footprint(root, mode, seconds=args.variant_seconds, stack=stack)
            for mode in FloorServer.MODES
        ]
    print_footprint(phases)

    pipelined = hooks[0]  # the agent, NVML backend, pipelined client, clock changes
    noop = hooks[3]  # the agent, NVML backend, synchronous client, no-op clock
    main_phases = [p for p in phases if p.config == MAIN_FOOTPRINT]
    checks = [
        (
            f"p99 hook, pipelined, clock changes, all {pipelined.stats['all'].n} calls, µs",
            pipelined.stats["all"].p99_us,
            TARGET_P99_US,
        ),
        (
            "p99 hook, pipelined, clock changes, instruction_begin only, µs",
            pipelined.stats["instruction_begin"].p99_us,
            TARGET_P99_US,
        ),
        *(
            (f"agent CPU, {p.phase}, % of one core", p.cpu_percent, TARGET_CPU_PERCENT)
            for p in main_phases
        ),
        (
            "agent RSS (max of the samples), MiB",
            max(p.rss_max_mib for p in main_phases),
            TARGET_RSS_MIB,
        ),
    ]
    print(f"\n== Targets (NVML backend over the emulated library, {NUM_GPUS} GPUs)")
    rows = [
        [what, value, f"< {limit:g}", "PASS" if value < limit else "FAIL"]
        for what, value, limit in checks
    ]
    print(table(["target", "measured", "limit", "result"], rows))
    print(
        f"\np99 hook / p99 bare nvmlDeviceGetClockInfo: pipelined, clock changes "
        f"{pipelined.stats['all'].p99_us / bare.p99_us:.1f}x; synchronous round trip, no-op "
        f"clock {noop.stats['all'].p99_us / bare.p99_us:.0f}x (information: "
        f"{noop.stats['all'].p99_us:.0f} µs p99); total time {time.monotonic() - started:.0f} s"
    )
    return all(value < limit for _, value, limit in checks)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with workspace() as root, contextlib.ExitStack() as stack:
            ok = run(args, root, stack)
    except BenchmarkError as exc:
        print(f"\nagent_overhead: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "\nagent_overhead: interrupted; agents stopped, temporary files removed",
            file=sys.stderr,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
