"""Standalone mode of the node agent (``--standalone --plan-file PLAN.json``): no Kubernetes.

The file holds one NodePlan (JSON; ``perseus plan --gpus ...`` writes one); it is checked every
:data:`PLAN_POLL_S` seconds and re-applied when it changes, and its removal clears the plan.
The agent starts without the file too and applies it once it appears. A file there at start-up
that is not a valid plan for this node stops the agent with a message saying what to fix (a
pipeline plan, ``perseus plan``'s ``plan.json``, is named as such, with what to run instead);
one that turns bad later is reported, the previous plan's clocks are reset, and the agent keeps
running.

A plan that profiles (``profiling`` set) has its results written, once every profiled GPU is
done, to ``PLAN.profile.csv`` beside the plan file (``node-plan-n1.json``:
``node-plan-n1.profile.csv``): the profile CSV ``perseus plan --profile`` reads, with the
blocking power to pass it logged.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from perseus_agent.clocks.clock_owners import ClockOwnerGuard
from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.errors import PlanError
from perseus_agent.gpu.releasable import ReleasableBackend
from perseus_agent.metrics_server import Health
from perseus_agent.modes.agent_config import PLAN_POLL_S, Config
from perseus_agent.modes.agent_lifecycle import Server
from perseus_agent.profiling.profiler import profile_csv
from perseus_api.node_plan import NodePlan
from perseus_api.node_report import GpuProfilingReport, ProfileRow

__all__ = [
    "StandaloneMode",
    "StandaloneRunner",
    "file_signature",
    "load_plan",
    "merged_profile",
    "profile_path",
]

log = logging.getLogger("perseus_agent")

FileSignature = tuple[int, int, int]
"""Modification time (ns), size and inode of a file: a new value means a new version."""


def load_plan(path: Path, node_name: str) -> NodePlan:
    """Read and validate a NodePlan file. Raises PlanError with a message saying what to fix."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"cannot read plan file {path}: {exc.strerror or exc}") from None
    try:
        plan = NodePlan.model_validate_json(text)
    except ValidationError as exc:
        raise PlanError(_invalid(path, text, exc)) from None
    if plan.node != node_name:
        raise PlanError(
            f"plan file {path} is for node {plan.node!r}, but this agent runs on {node_name!r} "
            f"(--node-name; perseus plan's --node names the plan's)"
        )
    return plan


_SHOWN_ERRORS = 3
"""Validation errors named in a message; a wrong document has dozens, the first say enough."""


def _invalid(path: Path, text: bytes, exc: ValidationError) -> str:
    """What is wrong with a plan file, in a line or two: what the document is if it is not a
    node plan, else its first few errors."""
    document: Any = None
    try:
        document = json.loads(text)
    except ValueError as parse_error:
        return f"invalid plan file {path}: not JSON ({parse_error})"
    kind = document.get("kind") if isinstance(document, dict) else None
    if kind == "PipelinePlan":
        return (
            f"plan file {path} holds a pipeline plan (perseus plan's plan.json), not a node "
            "plan: write one for this node's GPUs with `perseus plan ... --gpus 0,1,... --node "
            "NODE` (or --ranks FILE.csv) and pass its node-plan-NODE.json as --plan-file"
        )
    if kind not in (None, "NodePlan"):
        return f"plan file {path} holds a {kind}, not a NodePlan"
    errors = exc.errors()
    shown = "; ".join(
        f"{'.'.join(str(part) for part in e['loc']) or 'the document'}: {e['msg']}"
        for e in errors[:_SHOWN_ERRORS]
    )
    more = f" (and {len(errors) - _SHOWN_ERRORS} more)" if len(errors) > _SHOWN_ERRORS else ""
    count = f"{len(errors)} error" + ("s" if len(errors) != 1 else "")
    return f"invalid plan file {path}, {count}: {shown}{more}"


def profile_path(plan_file: Path) -> Path:
    """Where the results of a profiling plan go: ``PLAN.profile.csv`` beside ``PLAN.json``."""
    return plan_file.with_name(f"{plan_file.stem}.profile.csv")


def merged_profile(
    reports: Sequence[GpuProfilingReport],
) -> tuple[list[ProfileRow], float | None]:
    """The rows of every GPU's report merged, per (stage, instruction, clock) the mean over the
    GPUs that measured it weighted by samples, and the blocking power weighted by each GPU's
    blocking time (``None`` if no GPU measured one)."""
    merged: dict[tuple[int, str, int], list[ProfileRow]] = {}
    for report in reports:
        for row in report.rows:
            merged.setdefault((row.stage, row.instruction, row.frequency_mhz), []).append(row)
    rows = []
    # Stage by stage, each instruction's clocks highest first (the order the agent logs).
    for _, same in sorted(merged.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        samples = sum(r.samples for r in same)
        rows.append(
            same[0].model_copy(
                update={
                    "time_s": sum(r.time_s * r.samples for r in same) / samples,
                    "energy_j": sum(r.energy_j * r.samples for r in same) / samples,
                    "samples": samples,
                }
            )
        )
    weighted = [(r.blocking_power_w, r.blocking_s) for r in reports if r.blocking_power_w]
    blocking_s = sum(s for _, s in weighted)
    if not weighted:
        return rows, None
    if blocking_s <= 0:
        return rows, sum(w for w, _ in weighted) / len(weighted)
    return rows, sum(w * s for w, s in weighted) / blocking_s


def file_signature(path: Path) -> FileSignature | None:
    """The version of the file at ``path``; ``None`` if there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class StandaloneMode:
    """The plan file, read before the agent starts (:meth:`load`), if it is there yet."""

    def __init__(
        self, config: Config, path: Path, plan: NodePlan | None, signature: FileSignature | None
    ) -> None:
        self._config = config
        self._path = path
        self._plan = plan
        self._signature = signature  # of the version ``plan`` was read from

    @classmethod
    def load(cls, config: Config, path: Path) -> StandaloneMode:
        """Read the plan file, if there is one. Raises PlanError if it is there but cannot be
        read or is not valid."""
        signature = file_signature(path)
        if signature is None:
            return cls(config, path, None, None)
        return cls(config, path, load_plan(path, config.node_name), signature)

    def open(
        self, gpus: ReleasableBackend, guard: ClockOwnerGuard, reset_state: ResetState
    ) -> StandaloneRunner:
        applier = PlanApplier(guard, reset_state, self._config.node_name)
        return StandaloneRunner(self._config, self._path, applier, self._plan, self._signature)

    def close(self) -> None:
        pass


class StandaloneRunner:
    """Applies the plan file with one applier, and again whenever the file changes."""

    def __init__(
        self,
        config: Config,
        path: Path,
        applier: PlanApplier,
        initial_plan: NodePlan | None,
        signature: FileSignature | None,
    ) -> None:
        self._config = config
        self._path = path
        self._applier = applier
        self._initial_plan = initial_plan
        self._signature = signature
        self._profile_pending = False  # the plan profiles and its results are not written yet

    @property
    def plans(self) -> PlanApplier:
        return self._applier

    def start_servers(self) -> list[Server]:
        return []

    def run(self, stop: threading.Event, health: Health) -> None:
        config = self._config
        log.info(
            "node %s: %d GPU(s) via %s; plan file %s",
            config.node_name,
            len(self._applier.devices),
            config.backend,
            self._path,
        )
        if self._initial_plan is None:
            log.info(
                "plan file %s does not exist yet: waiting for it (write it whole, to a "
                "temporary name then renamed, so that it is never read half written)",
                self._path,
            )
        else:
            self._apply(self._initial_plan)
        while not stop.is_set():
            health.beat()
            stop.wait(PLAN_POLL_S)
            if not stop.is_set():
                self._poll_plan()
                self._poll_profile()

    def stopping(self) -> None:
        pass

    def stopped(self, reset_ok: bool) -> None:
        pass

    def _poll_plan(self) -> None:
        path = self._path
        signature = file_signature(path)
        if signature == self._signature:
            return
        self._signature = signature
        if signature is None:
            log.info("plan file %s removed; clearing the plan", path)
            self._profile_pending = False
            self._applier.clear()
            return
        try:
            plan = load_plan(path, self._config.node_name)
        except PlanError as exc:
            self._reject(str(exc))
            return
        self._apply(plan)

    def _apply(self, plan: NodePlan) -> None:
        applier = self._applier
        self._profile_pending = plan.profiling is not None
        try:
            report = applier.apply(plan)
        except PlanError as exc:
            self._reject(str(exc))
        except Exception:  # never crash on a plan
            log.exception("cannot apply the plan in %s; clocks reset", self._path)
            applier.metrics.count_error("invalid_plan")
            applier.clear()
        else:
            log.debug("report: %s", report.model_dump_json())

    def _reject(self, message: str) -> None:
        log.error("%s; clocks reset, waiting for a valid plan", message)
        self._profile_pending = False
        self._applier.metrics.count_error("invalid_plan")
        self._applier.clear()

    def _poll_profile(self) -> None:
        """Once every profiled GPU is done, write the merged profile beside the plan file."""
        if not self._profile_pending:
            return
        report = self._applier.report()
        if report is None or not report.profiling:
            return
        if not all(r.done for r in report.profiling):
            return
        self._profile_pending = False
        rows, blocking_power_w = merged_profile(report.profiling)
        path = profile_path(self._path)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(profile_csv(rows))
            tmp.replace(path)
        except OSError as exc:
            log.error("cannot write the profile to %s: %s", path, exc.strerror or exc)
            return
        stages = sorted({r.stage for r in rows})
        power = "unknown" if blocking_power_w is None else f"{blocking_power_w:.2f}"
        log.info(
            "profile of stage(s) %s written to %s (%d rows); blocking power %s W: plan with "
            "`perseus plan --profile %s --blocking-power %s --microbatches M` (the stages of "
            "other nodes' files appended first)",
            ",".join(str(s) for s in stages),
            path,
            len(rows),
            power,
            path,
            power,
        )
