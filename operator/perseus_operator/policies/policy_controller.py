"""Carries out the cluster-wide policies: reads the cluster, plans a round
(:func:`perseus_operator.policies.policy_sync.get_sync_plan`), and applies it.

One controller per operator runs a round every ``interval_s`` and as soon as a PerseusPolicy
changes (:meth:`PolicyController.wake`). A round that cannot read everything it needs changes
nothing (a partial view could look like deleted workloads); one failed write is logged and
the rest of the round goes on (the next round retries it). The namespaces' pods come from the
operator's pod index once kopf has filled it (:meth:`PolicyController.read_pods_from`), until
then from the API: an index not yet filled would look like pods deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Coroutine, Mapping
from typing import Any, Final

from perseus_api.conventions import now_rfc3339
from perseus_api.job import WorkloadKind
from perseus_api.policy import MANAGED_BY_POLICY_LABEL
from perseus_api.resources import object_key
from perseus_operator.cluster.cluster_index import Index, read_all
from perseus_operator.cluster.kube.client import KubeClient, KubeError
from perseus_operator.policies.policy_sync import (
    ClusterView,
    SyncPlan,
    WorkloadEvent,
    get_listing,
    get_sync_plan,
    parse_policies,
)

__all__ = ["COMPONENT", "PolicyController", "get_event"]

COMPONENT: Final = "perseus-operator"
_MAX_REMEMBERED_EVENTS: Final = 10_000
"""Events already posted are not posted again; past this many the memory starts over."""

log = logging.getLogger("perseus_operator.policies.selection")


def get_event(event: WorkloadEvent, now: str) -> dict[str, Any]:
    """The ``v1`` Event object for ``event``, ready to create in the object's namespace."""
    involved = event.involved
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "generateName": f"{involved['name']}.",
            "namespace": involved["namespace"],
        },
        "involvedObject": dict(involved),
        "type": event.type,
        "reason": event.reason,
        "message": event.message,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
    }


class PolicyController:
    """Keeps the policy-made PerseusJobs and the policies' statuses current.

    Args:
        kube: The API client.
        interval_s: Longest time between two rounds.
        namespaces: The namespaces the operator manages; empty: all of them.
    """

    def __init__(
        self, kube: KubeClient, *, interval_s: float, namespaces: Collection[str] = ()
    ) -> None:
        self._kube = kube
        self._interval_s = interval_s
        self._namespaces = frozenset(namespaces)
        self._wake = asyncio.Event()
        self._posted: set[tuple[str, str, str]] = set()
        self._crd_missing_logged = False
        self._pods: Index | None = None

    def wake(self) -> None:
        """Run the next round now (a PerseusPolicy changed)."""
        self._wake.set()

    def read_pods_from(self, pods: Index) -> None:
        """Take the namespaces' pods from ``pods`` (by namespace, filled: kopf has run a
        handler) from now on, not from the API."""
        self._pods = pods

    async def run(self) -> None:
        """Rounds until cancelled; a failed round is logged and retried at the next one."""
        while True:
            self._wake.clear()
            try:
                await self.sync()
            except KubeError as exc:
                log.warning("policy round skipped: %s", exc)
            except Exception:
                log.exception("policy round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._interval_s)

    async def sync(self) -> SyncPlan | None:
        """One round; None when the PerseusPolicy CRD is not installed.

        Raises:
            KubeError: The cluster could not be read; nothing was changed.
        """
        view = await self._read()
        if view is None:
            return None
        plan = get_sync_plan(view, now_rfc3339())
        await self._apply(plan)
        return plan

    # -- reading --

    async def _read(self) -> ClusterView | None:
        kube = self._kube
        policies = await kube.list_policies()
        if policies is None:
            if not self._crd_missing_logged:
                log.warning("the PerseusPolicy CRD is not installed: cluster-wide policies off")
                self._crd_missing_logged = True
            return None
        self._crd_missing_logged = False
        valid, _ = parse_policies(policies)
        namespaces = []
        if valid:
            namespaces = [n for n in await kube.list_namespaces() if self._manages(n)]
        listing = get_listing(valid, namespaces)
        workloads: list[dict[str, Any]] = []
        pods: list[dict[str, Any]] = []
        jobs: list[dict[str, Any]] = []
        for namespace, kinds in sorted(listing.items()):
            for kind in sorted(kinds - {WorkloadKind.PODS}):
                workloads += await kube.list_workloads(namespace, kind)
            if self._pods is None:
                pods += await kube.list_pods(namespace, "")
            else:
                pods += read_all(self._pods.get(namespace, ()))
            jobs += await kube.list_jobs(namespace)
        jobs += await self._policy_jobs_outside(listing)
        return ClusterView(policies, namespaces, workloads, pods, jobs)

    async def _policy_jobs_outside(self, listing: Mapping[str, object]) -> list[dict[str, Any]]:
        """The policy-made jobs of the namespaces no policy selects (any more)."""
        if self._namespaces:
            found = []
            for namespace in sorted(self._namespaces - set(listing)):
                found += await self._kube.list_jobs(namespace, MANAGED_BY_POLICY_LABEL)
            return found
        everywhere = await self._kube.list_jobs(None, MANAGED_BY_POLICY_LABEL)
        return [j for j in everywhere if object_key(j)[0] not in listing]

    def _manages(self, namespace: Mapping[str, Any]) -> bool:
        return not self._namespaces or object_key(namespace)[1] in self._namespaces

    # -- writing --

    async def _apply(self, plan: SyncPlan) -> None:
        kube = self._kube
        for body in plan.creates:
            namespace, name = object_key(body)
            if await self._try(f"create PerseusJob {namespace}/{name}", kube.create_job(body)):
                log.info("created PerseusJob %s/%s", namespace, name)
        for update in plan.updates:
            what = f"update PerseusJob {update.namespace}/{update.name}"
            await self._try(what, kube.patch_job(update.namespace, update.name, update.patch))
        for deletion in plan.deletes:
            what = f"delete PerseusJob {deletion.namespace}/{deletion.name}"
            if await self._try(what, kube.delete_job(deletion.namespace, deletion.name)):
                log.info("deleted %s: %s", what.removeprefix("delete "), deletion.reason)
        for event in plan.events:
            await self._post(event)
        for name, status in plan.statuses.items():
            what = f"write the status of PerseusPolicy {name}"
            await self._try(what, kube.patch_policy_status(name, status))

    async def _post(self, event: WorkloadEvent) -> None:
        if event.key in self._posted:
            return
        if len(self._posted) >= _MAX_REMEMBERED_EVENTS:
            self._posted.clear()
        body = get_event(event, now_rfc3339())
        where = f"{event.involved['kind']} {event.involved['namespace']}/{event.involved['name']}"
        if await self._try(
            f"post event {event.reason} on {where}",
            self._kube.create_event(event.involved["namespace"], body),
        ):
            self._posted.add(event.key)

    @staticmethod
    async def _try(what: str, call: Coroutine[Any, Any, None]) -> bool:
        try:
            await call
        except KubeError as exc:
            if exc.not_found:
                return False  # gone meanwhile: the next round sees that
            log.warning("could not %s: %s", what, exc)
            return False
        return True
