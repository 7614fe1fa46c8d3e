"""The emulated job itself: one thread per rank, the pipeline's waits, the all-reduce
barrier, and a record after every iteration (see the package docstring)."""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence

from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_api.profile import Profile
from perseus_api.schedule import BACKWARD, FORWARD, Schedule, stage_instruction_order
from perseus_emulation.job.clients import (
    ClientFactory,
    RankClient,
    TimedClient,
    default_client,
)
from perseus_emulation.job.handoffs import AbortedError, DepKey, HandOffs, sleep_until
from perseus_emulation.job.records import (
    OVERHEADS,
    EmulatedJobError,
    IterationRecord,
    JobResult,
    NodeSpec,
    RankInfo,
)

__all__ = ["DEFAULT_CLOCK_POLL_S", "EmulatedJob"]

DEFAULT_CLOCK_POLL_S = 0.005
# The first re-read of an instruction's rate: the agent applies the clock the instruction's
# hook asked for about a millisecond after it (or had it in place already, from the previous
# computation's end), so the reads start fast and back off to ``clock_poll_s``; reading only
# every 5 ms ran many instructions 5 ms at the previous clock, time the agent did not cause.
_FIRST_POLL_S = 0.0005


class EmulatedJob:
    """A ``replicas`` x ``stages`` training job on emulated GPUs, one thread per rank.

    Args:
        profile: Time and energy per (stage, instruction) and SM clock; stage ``s`` of the
            pipeline runs the profile's stage ``s`` (the profile needs at least ``stages``).
        nodes: The nodes, in node-rank order (see the package docstring for the layout).
        blocking_power_w: Power of an idle or waiting GPU.
        stages, replicas, microbatches: Pipeline stages, data-parallel replicas and
            microbatches per iteration.
        schedule: Pipeline schedule.
        time_scale: Factor on every instruction's profiled time.
        clock_poll_s: While an instruction runs, how often its rate is read again from the
            GPU's clock and slowdown (seconds of wall time; its last stretch, up to twice
            that, runs at the rate read last).
        client_factory: Makes each rank's client; default :func:`default_client`.
        on_iteration: Called with each :class:`IterationRecord` as it is made, while every
            rank waits; an exception in it fails the job.

    Raises:
        ValueError: an argument is invalid, or a node's state file is unusable.
    """

    def __init__(
        self,
        profile: Profile,
        nodes: Sequence[NodeSpec],
        *,
        blocking_power_w: float,
        stages: int,
        replicas: int,
        microbatches: int,
        schedule: Schedule | str = Schedule.ONE_F_ONE_B,
        time_scale: float = 1.0,
        clock_poll_s: float = DEFAULT_CLOCK_POLL_S,
        client_factory: ClientFactory = default_client,
        on_iteration: Callable[[IterationRecord], None] | None = None,
    ) -> None:
        for what, value in (
            ("stages", stages),
            ("replicas", replicas),
            ("microbatches", microbatches),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
        for what, number in (("time_scale", time_scale), ("clock_poll_s", clock_poll_s)):
            if (
                isinstance(number, bool)
                or not isinstance(number, int | float)
                or not math.isfinite(number)
                or number <= 0
            ):
                raise ValueError(f"{what} must be a positive finite number, got {number!r}")
        if profile.num_stages < stages:
            raise ValueError(
                f"the profile {profile.source} has {profile.num_stages} stages, "
                f"the pipeline {stages}"
            )
        nodes = list(nodes)
        if not nodes:
            raise ValueError("at least one node is needed")
        names = [n.name for n in nodes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"node names must be unique; repeated: {', '.join(duplicates)}")
        gpus_per_node = {n.gpus for n in nodes}
        if len(gpus_per_node) != 1:
            raise ValueError(
                f"every node must have the same number of GPUs, got {[n.gpus for n in nodes]}"
            )
        num_ranks = stages * replicas
        gpus = nodes[0].gpus
        if len(nodes) * gpus != num_ranks:
            raise ValueError(
                f"{len(nodes)} nodes x {gpus} GPUs = {len(nodes) * gpus} GPUs, but "
                f"{stages} stages x {replicas} replicas = {num_ranks} ranks"
            )

        self._profile = profile
        self._nodes = nodes
        self._stages = stages
        self._replicas = replicas
        self._schedule = Schedule.parse(schedule)
        self._time_scale = float(time_scale)
        self._clock_poll_s = float(clock_poll_s)
        self._client_factory = client_factory
        self._on_iteration = on_iteration
        self._gpus_per_node = gpus
        self._num_ranks = num_ranks
        # One backend per node, shared by its ranks' threads: it serializes its own calls, and
        # a shared instance keeps its decoded state across its ranks' writes.
        self._backends = [
            EmulatedBackend(
                n.gpus,
                profile,
                blocking_power_w=blocking_power_w,
                node_name=n.name,
                state_file=n.state_file,
            )
            for n in nodes
        ]
        self._orders = [
            stage_instruction_order(self._schedule, stages, microbatches, s) for s in range(stages)
        ]

        self._started = False
        self._steps: int | None = None
        self._stop_requested = False  # a plain flag: stop() may run in a signal handler
        self._continue = True
        self._records: list[IterationRecord] = []
        self._begin_s = [0.0] * num_ranks
        self._end_s = [0.0] * num_ranks
        # Per rank, this iteration's overheads (OVERHEADS): each rank adds to its own.
        self._overheads = [dict.fromkeys(OVERHEADS, 0.0) for _ in range(num_ranks)]
        self._handoffs = HandOffs()
        self._barrier = threading.Barrier(num_ranks, action=self._iteration_done)
        self._error: tuple[int | None, str, BaseException] | None = None
        self._bookkeeping_error: BaseException | None = None

    # -- public -------------------------------------------------------------------------------

    @property
    def backends(self) -> list[EmulatedBackend]:
        """Each node's emulated GPUs, in node-rank order (e.g. to set a slowdown)."""
        return list(self._backends)

    @property
    def nodes(self) -> list[NodeSpec]:
        return list(self._nodes)

    @property
    def records(self) -> list[IterationRecord]:
        """The iterations completed so far."""
        return list(self._records)

    def rank_info(self, rank: int) -> RankInfo:
        """Where global rank ``rank`` sits."""
        if not 0 <= rank < self._num_ranks:
            raise ValueError(f"no rank {rank} in a job of {self._num_ranks} ranks")
        node_rank, gpu_index = divmod(rank, self._gpus_per_node)
        return RankInfo(
            rank=rank,
            replica=rank // self._stages,
            stage=rank % self._stages,
            node_rank=node_rank,
            node=self._nodes[node_rank],
            gpu_index=gpu_index,
            gpu_uuid=self._backends[node_rank].devices()[gpu_index].uuid,
        )

    def stop(self) -> None:
        """End the run after the current iteration. Safe from any thread or a signal handler."""
        self._stop_requested = True

    def run(self, steps: int | None = None) -> JobResult:
        """Run ``steps`` iterations (``None``: until :meth:`stop`); once per job.

        Raises:
            EmulatedJobError: a rank or the bookkeeping failed; every rank has exited.
            ValueError: ``steps`` is not ``None`` or an integer >= 1.
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
            raise ValueError(f"steps must be an integer >= 1 or None, got {steps!r}")
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be an integer >= 1 or None, got {steps!r}")
        if self._started:
            raise RuntimeError("an EmulatedJob runs once")
        self._started = True
        self._steps = steps
        start_s = time.monotonic()
        start_energy_j: float | None = None
        threads = [
            threading.Thread(
                target=self._rank_main, args=(rank,), name=f"emulated-rank-{rank}", daemon=True
            )
            for rank in range(self._num_ranks)
        ]
        try:
            for backend in self._backends:
                for index in range(backend.num_gpus):
                    backend.set_activity(index, None, None)  # e.g. left busy by a killed run
            start_energy_j = sum(self._node_energy_j().values())
        except Exception as exc:  # an unusable state file
            self._fail(None, exc, "preparing the GPUs")
            threads = []
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        except BaseException as exc:  # e.g. KeyboardInterrupt: tear down, then re-raise
            self._fail(None, exc, "the run")
            for thread in threads:
                if thread.ident is not None:
                    thread.join()
            raise
        node_energy_j: dict[str, float] = {}
        energy_j: float | None = None
        try:
            node_energy_j = self._node_energy_j()
            energy_j = sum(node_energy_j.values())
        except Exception as exc:
            self._fail(None, exc, "reading the energy counters")
        result = JobResult(
            records=tuple(self._records),
            stopped=self._steps is None or len(self._records) < self._steps,
            wall_s=time.monotonic() - start_s,
            start_energy_j=start_energy_j,
            energy_j=energy_j,
            node_energy_j=node_energy_j,
        )
        if self._error is not None:
            rank, where, error = self._error
            raise EmulatedJobError(
                f"emulated job failed in {where}: {type(error).__name__}: {error}", rank, result
            ) from error
        return result

    # -- ranks --------------------------------------------------------------------------------

    def _rank_main(self, rank: int) -> None:
        error: BaseException | None = None
        info = self.rank_info(rank)
        backend = self._backends[info.node_rank]
        client: RankClient | None = None
        try:
            client = self._client_factory(info)
            self._rank_loop(info, backend, client)
        except BaseException as exc:
            error = exc
        # Leave the GPU idle and the agent told, whatever happened; the first error counts.
        try:
            backend.set_activity(info.gpu_index, None, None)
        except BaseException as exc:
            error = error or exc
        if client is not None:
            try:
                client.close()
            except BaseException as exc:
                error = error or exc
        if error is None or isinstance(error, AbortedError):
            return
        if error is self._bookkeeping_error:
            self._fail(None, error, "the iteration bookkeeping")
        elif isinstance(error, threading.BrokenBarrierError):
            # Broken by abort() (an error elsewhere) or by a failed barrier action: both are
            # reported by the thread that saw the error.
            if not self._handoffs.aborted and self._bookkeeping_error is None:  # not expected
                self._fail(rank, RuntimeError("the all-reduce barrier broke"))
        else:
            self._fail(rank, error)

    def _rank_loop(self, info: RankInfo, backend: EmulatedBackend, client: RankClient) -> None:
        rank, replica, stage, index = info.rank, info.replica, info.stage, info.gpu_index
        last_stage = self._stages - 1
        overheads = self._overheads[rank]
        hooks = TimedClient(client, overheads)
        slack_s = 0.0
        step = 0
        while True:
            self._begin_s[rank] = time.monotonic()
            hooks.on_step_begin(step)
            busy = False  # the GPU is still marked busy with the previous instruction
            for instruction, microbatch in self._orders[stage]:
                if self._handoffs.aborted:
                    raise AbortedError
                dependency: DepKey | None = None
                if instruction == FORWARD and stage > 0:
                    dependency = (step, replica, stage - 1, FORWARD, microbatch)
                elif instruction == BACKWARD and stage < last_stage:
                    dependency = (step, replica, stage + 1, BACKWARD, microbatch)
                if dependency is not None:
                    event = self._handoffs.event(dependency)
                    if busy and not self._handoffs.ready(dependency, event):
                        backend.set_activity(index, None, None)  # it waits idle
                        busy = False
                    slack_s = self._handoffs.wait(dependency, event, slack_s, overheads)
                announce: Callable[[float], None] | None = None
                if (instruction == FORWARD and stage < last_stage) or (
                    instruction == BACKWARD and stage > 0
                ):
                    announce = functools.partial(
                        self._handoffs.signal, (step, replica, stage, instruction, microbatch)
                    )
                hooks.on_instruction_begin(instruction, microbatch)
                slack_s = self._compute(
                    backend, index, stage, instruction, slack_s, overheads, announce
                )
                busy = True
                hooks.on_instruction_end(instruction)
            backend.set_activity(index, None, None)  # idle through the all-reduce
            hooks.on_step_end(step)
            self._end_s[rank] = time.monotonic()
            self._barrier.wait()  # the gradient all-reduce; its action records the iteration
            if not self._continue:
                return
            step += 1

    def _compute(
        self,
        backend: EmulatedBackend,
        index: int,
        stage: int,
        instruction: str,
        slack_s: float,
        overheads: dict[str, float],
        announce: Callable[[float], None] | None = None,
    ) -> float:
        """Run one instruction: busy for its time, re-reading the rate as it runs.

        The time starts before the GPU is marked busy, so that marking it (a state file
        write) is part of the instruction rather than added to it. The GPU stays marked busy
        after it: the caller marks it idle only when it has to wait. The rate is read again
        after :data:`_FIRST_POLL_S`, then at doubling intervals up to ``clock_poll_s``; a
        change applies from when the GPU changed (not when it was seen) and counts in
        ``overheads`` (how long the computation ran before it). ``slack_s``
        is how much earlier than its end the last sleep wakes up, to make up for the usual
        oversleep of ``time.sleep``; returns it updated with this instruction's oversleep.
        ``announce`` is called with the end time once it is final (the last stretch reads no
        rate), so that the rank waiting on this computation can wake up before it ends and
        start on time (:meth:`HandOffs.wait`).
        """
        start_s = last_s = time.monotonic()
        backend.set_activity(index, stage, instruction)
        duration_s = backend.instruction_time_s(index, stage, instruction) * self._time_scale
        remaining = 1.0  # fraction of the work still to do
        poll_s = min(_FIRST_POLL_S, self._clock_poll_s)
        while True:
            end_s = last_s + remaining * duration_s
            now_s = time.monotonic()
            # The last stretch is at least one poll long, so that the oversleep correction
            # always has room (a sleep of a few microseconds cannot wake up early).
            if end_s - now_s <= 2 * poll_s:
                if announce is not None:
                    announce(end_s)
                slack_s = sleep_until(end_s, slack_s)
                break
            time.sleep(poll_s)
            poll_s = min(2 * poll_s, self._clock_poll_s)
            now_s = time.monotonic()
            rate_s, age_s = backend.instruction_rate(index, stage, instruction)
            rate_s *= self._time_scale
            if rate_s != duration_s:
                # The work since the change went at the new rate: the GPU changed then, not
                # when this rank looked (a slowdown is not timed: it counts from the last look).
                changed_s = min(max(now_s - age_s, last_s), now_s)
                remaining -= (changed_s - last_s) / duration_s + (now_s - changed_s) / rate_s
                duration_s = rate_s
                overheads["clock_changes"] += 1
                overheads["clock_lag_s"] += changed_s - start_s
            else:
                remaining -= (now_s - last_s) / duration_s
            last_s = now_s
        return slack_s

    def _fail(self, rank: int | None, error: BaseException, where: str | None = None) -> None:
        """Record the first error and make every rank exit: wake every waiter."""

        def record_first() -> None:
            if self._error is None:
                self._error = (rank, where or f"rank {rank}", error)

        self._handoffs.abort(record_first)
        self._barrier.abort()

    # -- bookkeeping --------------------------------------------------------------------------

    def _iteration_done(self) -> None:
        """The barrier's action: every rank is waiting in it, every GPU idle."""
        try:
            end_s = time.monotonic()
            replica_times_s = []
            for replica in range(self._replicas):
                ranks = range(replica * self._stages, (replica + 1) * self._stages)
                begin = min(self._begin_s[r] for r in ranks)
                end = max(self._end_s[r] for r in ranks)
                replica_times_s.append(end - begin)
            node_energy_j = self._node_energy_j()
            node_busy_s = {
                node.name: sum(backend.busy_s(i) for i in range(backend.num_gpus))
                for node, backend in zip(self._nodes, self._backends, strict=True)
            }
            overheads = {k: sum(o[k] for o in self._overheads) for k in OVERHEADS}
            for per_rank in self._overheads:
                per_rank.update(dict.fromkeys(OVERHEADS, 0.0))
            record = IterationRecord(
                iteration=len(self._records),
                end_s=end_s,
                replica_times_s=tuple(replica_times_s),
                energy_j=sum(node_energy_j.values()),
                node_energy_j=node_energy_j,
                busy_s=sum(node_busy_s.values()),
                node_busy_s=node_busy_s,
                overheads=overheads,
            )
            self._records.append(record)
            if self._on_iteration is not None:
                self._on_iteration(record)
            self._continue = not self._stop_requested and (
                self._steps is None or len(self._records) < self._steps
            )
        except BaseException as exc:
            # Raised out of the barrier in this thread (the others see it broken): the rank
            # reports it as the bookkeeping's error, not its own.
            self._bookkeeping_error = exc
            raise

    def _node_energy_j(self) -> dict[str, float]:
        return {
            node.name: sum(backend.metered_energy_j(i) for i in range(backend.num_gpus))
            for node, backend in zip(self._nodes, self._backends, strict=True)
        }
