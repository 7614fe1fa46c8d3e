"""Standalone mode of the node agent (``--standalone --plan-file PLAN.json``): no Kubernetes.

The file holds one NodePlan (JSON); it is checked every :data:`PLAN_POLL_S` seconds and
re-applied when it changes, and its removal clears the plan. A plan that cannot be read or
applied is reported and the previous plan's clocks are reset; the agent keeps running.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from pydantic import ValidationError

from perseus_agent.clocks.clock_owners import ClockOwnerGuard
from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.errors import PlanError
from perseus_agent.exporter import Health
from perseus_agent.gpu.releasable import ReleasableBackend
from perseus_agent.modes.agent_config import PLAN_POLL_S, Config
from perseus_agent.modes.agent_lifecycle import Server
from perseus_api.node_plan import NodePlan

__all__ = ["StandaloneMode", "StandaloneRunner", "file_signature", "load_plan"]

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
        raise PlanError(f"invalid plan file {path}: {exc}") from None
    if plan.node != node_name:
        raise PlanError(
            f"plan file {path} is for node {plan.node!r}, but this agent runs on {node_name!r}"
        )
    return plan


def file_signature(path: Path) -> FileSignature | None:
    """The version of the file at ``path``; ``None`` if there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class StandaloneMode:
    """The plan file, read before the agent starts (:meth:`load`)."""

    def __init__(
        self, config: Config, path: Path, plan: NodePlan, signature: FileSignature | None
    ) -> None:
        self._config = config
        self._path = path
        self._plan = plan
        self._signature = signature  # of the version ``plan`` was read from

    @classmethod
    def load(cls, config: Config, path: Path) -> StandaloneMode:
        """Read the plan file. Raises PlanError if it cannot be read or is not valid."""
        signature = file_signature(path)
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
        initial_plan: NodePlan,
        signature: FileSignature | None,
    ) -> None:
        self._config = config
        self._path = path
        self._applier = applier
        self._initial_plan = initial_plan
        self._signature = signature

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
        self._apply(self._initial_plan)
        while not stop.is_set():
            health.beat()
            stop.wait(PLAN_POLL_S)
            if not stop.is_set():
                self._poll_plan()

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
        self._applier.metrics.count_error("invalid_plan")
        self._applier.clear()
