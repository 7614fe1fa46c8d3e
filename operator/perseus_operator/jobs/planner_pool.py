"""Frontiers are solved in worker processes: never on the event loop, never past a time limit."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from perseus_operator.jobs.planning import PlanningError, PlanningInput, solve_frontier
from perseus_planner import Frontier


class PoolPlanner:
    """Solves on a pool of ``workers`` processes, each solve limited to ``timeout_s``.

    A solve that runs out of time kills the pool (a running process cannot be cancelled
    otherwise) and the next solve starts a fresh one. ``observe_s`` gets every solve's
    duration (the ``perseus_planner_seconds`` histogram).
    """

    def __init__(
        self,
        workers: int,
        timeout_s: float,
        observe_s: Callable[[float], None] | None = None,
    ) -> None:
        self._workers = workers
        self._timeout_s = timeout_s
        self._observe_s = observe_s
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: forking a process that runs threads and an event loop is unsafe.
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self._workers, mp_context=context)
        return self._pool

    async def solve(self, request: PlanningInput) -> Frontier:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            future = loop.run_in_executor(self._executor(), solve_frontier, request)
            return await asyncio.wait_for(future, self._timeout_s)
        except TimeoutError:
            self._kill()
            raise PlanningError(
                f"the planner did not finish within {self._timeout_s:g} s "
                "(PERSEUS_OPERATOR_PLANNER_TIMEOUT_S); use fewer microbatches or a coarser "
                "profile (frequencyStepMHz)"
            ) from None
        except BrokenProcessPool:
            self._kill()
            raise PlanningError("the planner process died (out of memory?)") from None
        finally:
            if self._observe_s is not None:
                self._observe_s(time.monotonic() - started)

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for process in list(getattr(pool, "_processes", {}).values()):
            with contextlib.suppress(Exception):
                process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class InlinePlanner:
    """Solves in the calling thread: for tests and tools, where blocking does not matter."""

    async def solve(self, request: PlanningInput) -> Frontier:
        return solve_frontier(request)


class CachingPlanner:
    """Shares one solve among jobs with the same profile, pipeline and policy clamp: a frontier
    depends on nothing else. Keeps the ``size`` most recently used frontiers."""

    def __init__(self, inner: PoolPlanner | InlinePlanner, size: int = 16) -> None:
        self._inner = inner
        self._size = size
        self._frontiers: OrderedDict[PlanningInput, Frontier] = OrderedDict()
        self._solving: dict[PlanningInput, asyncio.Future[Frontier]] = {}

    async def solve(self, request: PlanningInput) -> Frontier:
        cached = self._frontiers.get(request)
        if cached is not None:
            self._frontiers.move_to_end(request)
            return cached
        pending = self._solving.get(request)
        if pending is not None:  # another job asked for the same frontier: wait for it
            return await asyncio.shield(pending)
        future: asyncio.Future[Frontier] = asyncio.get_running_loop().create_future()
        self._solving[request] = future
        try:
            frontier = await self._inner.solve(request)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        finally:
            self._solving.pop(request, None)
        future.set_result(frontier)
        self._frontiers[request] = frontier
        while len(self._frontiers) > self._size:
            self._frontiers.popitem(last=False)
        return frontier

    def close(self) -> None:
        if isinstance(self._inner, PoolPlanner):
            self._inner.close()
