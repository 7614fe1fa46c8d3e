"""The operator tells a training process that never called in from one that did by the real
agent's profiling report (:func:`perseus_operator.jobs.profiling_watch.called_in`): this pins the
report fields it reads to what :class:`~perseus_agent.control.applier.PlanApplier` writes."""

from __future__ import annotations

from pathlib import Path

from perseus_api.node_report import GpuProfilingReport
from perseus_operator.jobs.profiling_watch import called_in, profiling_progress
from support.simulated_profiling import Profiling


def report_of(run: Profiling, index: int) -> GpuProfilingReport:
    (p,) = [p for p in run.applier.report().profiling if p.index == index]  # type: ignore[union-attr]
    return p


def test_a_gpu_is_called_in_once_its_process_begins_an_iteration(tmp_path: Path) -> None:
    run = Profiling(tmp_path)
    run.applier.apply(run.plan([(0, 0), (1, 1)], [1410, 1200], iterations=1, warmup=0))
    assert not called_in(report_of(run, 0)) and not called_in(report_of(run, 1))
    assert run.locks == []

    s = run.connect(0)  # a hello alone locks nothing and measures nothing
    assert not called_in(report_of(run, 0))
    run.iteration(s, 0, stage=0)
    assert called_in(report_of(run, 0))
    assert not called_in(report_of(run, 1))  # GPU 1's process never came


def test_the_sweep_progress_moves_at_least_once_per_warmup_and_measured_iteration(
    tmp_path: Path,
) -> None:
    """What bounds a stalled sweep (``ProfilingStalled``) reads from the real report: with one
    warm-up iteration per clock, the count moves at every iteration or every other one."""
    run = Profiling(tmp_path)
    run.applier.apply(run.plan([(0, 0)], [1410, 1200, 1005], iterations=2, warmup=1))
    s = run.connect(0)

    def progress() -> int:
        # The report as the agent writes it into the node plan's status.
        entry = report_of(run, 0).model_dump(mode="json", by_alias=True)
        return profiling_progress([{"status": {"profiling": [entry]}}])

    seen = [progress()]
    for _ in range(3 * (1 + 2)):
        run.iteration(s, 0, stage=0)
        seen.append(progress())
    assert report_of(run, 0).done
    assert seen == sorted(seen)  # never backwards
    assert all(later > earlier for earlier, later in zip(seen, seen[2:], strict=False))
