"""Kubernetes mode: the agent lets go of the GPUs while the node's GPU driver is upgraded.

The thin executor of :func:`perseus_agent.modes.driver_upgrade.releases_gpus`. On a release it keeps
every plan, resets every clock the plans locked (an administrator's clocks are left as
:mod:`perseus_agent.clocks.clock_owners` says), closes the GPU library
(:class:`~perseus_agent.gpu.releasable.ReleasableBackend`: ``nvmlShutdown``), sets
``perseus_agent_driver_upgrade_released`` to 1 and writes a ``DriverUpgrade`` condition into
every plan's status. Plans that arrive or go meanwhile are only recorded. When the upgrade is
over it opens the library again (retried on every call of :meth:`DriverUpgradeGate.retry`
until it works: the new driver may still be loading), surveys the clocks again (a driver
reload resets them all, an administrator's included) and applies the latest plans.
"""

from __future__ import annotations

import logging
from typing import Any

from perseus_agent.clocks.clock_owners import ClockOwnerGuard
from perseus_agent.exporter import AgentMetrics, driver_upgrade_released_gauge
from perseus_agent.gpu.releasable import ReleasableBackend
from perseus_agent.kube import ObjectKey
from perseus_agent.kube.report_writer import ReportWriter
from perseus_agent.modes.driver_upgrade import UPGRADE_STATE_LABEL, releases_gpus
from perseus_agent.plans.job_plans import JobPlans
from perseus_agent.plans.plan_status import invalid_status
from perseus_api import resources
from perseus_api.node_plan import NodePlan

__all__ = ["DriverUpgradeGate"]

log = logging.getLogger(__name__)


class DriverUpgradeGate:
    """Releases and takes back the GPUs of ``jobs`` as the node's upgrade state says.

    Not thread-safe: call it from the agent loop only (as :class:`JobPlans` changes are).
    """

    def __init__(
        self,
        jobs: JobPlans,
        backend: ReleasableBackend,
        guard: ClockOwnerGuard,
        metrics: AgentMetrics,
    ) -> None:
        self._jobs = jobs
        self._backend = backend
        self._guard = guard
        self._node = metrics.node
        self.state: str | None = None
        self._plans: dict[ObjectKey, NodePlan] = {}  # while released: the latest of each
        self._released = False
        self._gauge = driver_upgrade_released_gauge(metrics)
        self._gauge.labels(node=self._node).set(0)

    @property
    def released(self) -> bool:
        return self._released

    def on_state(self, state: str | None) -> list[ObjectKey]:
        """The node's upgrade state is ``state`` (``None``: no label). Returns the plans whose
        status changed (:meth:`status` while released, the plans' own otherwise)."""
        self.state = state
        if releases_gpus(state) and not self._released:
            return self._release()
        return self.retry()

    def handle(
        self,
        kind: str,
        key: ObjectKey,
        plan: NodePlan | None,
        message: str,
        writer: ReportWriter,
    ) -> bool:
        """An event of the agent loop: ``driver`` (the node's upgrade state is ``message``, empty
        for none), or a ``plan``/``delete``/``invalid`` event of plan ``key``. Returns whether
        it was handled here (the upgrade state; plan events while released) and writes the
        statuses that changed; ``False``: the plans take it as usual."""
        if kind == "driver":
            for changed in self.on_state(message or None):
                status = self.status(changed) if self._released else self._jobs.status(changed)
                if status is not None:
                    writer.submit(*changed, status)
            return True
        if not self._released:
            return False
        self.hold(key, plan if kind == "plan" else None)
        if kind == "plan":
            status = self.status(key)
            if status is not None:
                writer.submit(*key, status)
            return True
        if kind == "delete":
            writer.forget(*key)
            return True
        return False  # an invalid spec: reported as usual

    def retry(self) -> list[ObjectKey]:
        """Take the GPUs back if the upgrade is over and they are still released."""
        if not self._released or releases_gpus(self.state):
            return []
        try:
            self._backend.reopen()
        except Exception as exc:
            log.warning("cannot open the GPU library again yet (retrying): %s", exc)
            return []
        self._released = False
        self._gauge.labels(node=self._node).set(0)
        self._guard.survey(self._backend.devices())
        plans, self._plans = self._plans, {}
        log.info(
            "GPU driver upgrade of node %s over (%s=%s); applying %d plan(s) again",
            self._node,
            UPGRADE_STATE_LABEL,
            self.state or "",
            len(plans),
        )
        changed: set[ObjectKey] = set(plans)
        for key, plan in plans.items():
            changed.update(self._jobs.set_plan(key, plan))
        return sorted(changed)

    def hold(self, key: ObjectKey, plan: NodePlan | None) -> None:
        """While released: the latest spec of plan ``key`` (``None``: it was deleted)."""
        if plan is None:
            self._plans.pop(key, None)
        else:
            self._plans[key] = plan

    def keys(self) -> list[ObjectKey]:
        """The plans held while released."""
        return list(self._plans)

    def status(self, key: ObjectKey) -> dict[str, Any] | None:
        """The status of plan ``key`` while released; ``None`` for one not held."""
        plan = self._plans.get(key)
        if plan is None:
            return None
        message = (
            f"the GPU driver of node {self._node} is being upgraded ({UPGRADE_STATE_LABEL}="
            f"{self.state}): the agent reset this plan's clocks and released NVML so that the "
            "driver can be reloaded; it applies the plan again when the upgrade is done"
        )
        return invalid_status(message, plan.revision, reason=resources.REASON_DRIVER_UPGRADE)

    def _release(self) -> list[ObjectKey]:
        self._plans = self._jobs.plans()
        log.warning(
            "GPU driver upgrade of node %s (%s=%s): resetting the clocks of %d plan(s) and "
            "releasing NVML until it is done",
            self._node,
            UPGRADE_STATE_LABEL,
            self.state,
            len(self._plans),
        )
        self._jobs.clear()
        locked = self._jobs.locked_gpus()
        if locked:
            log.error("GPUs %s could not be reset before releasing NVML", locked)
        self._backend.release()
        self._released = True
        self._gauge.labels(node=self._node).set(1)
        return sorted(self._plans)
