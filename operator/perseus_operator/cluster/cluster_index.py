"""Reads from what the operator watches, not from the API: pods, node plans and workload
objects kept current by kopf's indexes (:mod:`perseus_operator.handlers`), so that a reconcile
round or a policy round lists nothing and the API load does not grow with jobs times the
reconcile interval.

An index maps a key to the objects filed under it (a ``kopf.Index``: key -> ``kopf.Store``,
one value per object); kopf fills every index from its initial listing before any handler
runs, then keeps it current from its watch. Here an index is any such mapping, so that the
operator's logic (and ``benchmarks/operator_scale.py``) runs without kopf. Writes still go
to the API.

The one read an index cannot answer is a job's own write of a moment ago, whose watch event
has not arrived yet: a reconcile that has just written its node plans must read those, not
the ones they replace (to delete what it no longer wants, to see the revision it wrote). So
each job keeps its writes the index has not shown yet (:class:`PlanWrites`), and until the
index shows them all, that job's node plans come from the API. A workload the index does not
hold is asked of the API too: its kind may not be watched (a CRD installed after the operator
started, or none), and a missing workload is a job's problem to report, not a fast path.

A step's reads from the indexes are recorded (:meth:`IndexedJobIO.snapshot`): the next step
can ask whether the same reads would return the same objects now
(:meth:`IndexedJobIO.changes_since`, by the indexed bytes, without parsing anything), which
is what lets a reconcile whose inputs have not changed reuse what its last step decided
(:mod:`perseus_operator.jobs.quiet_steps`).
"""

from __future__ import annotations

import functools
import json
import marshal
from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from perseus_api import resources
from perseus_api.job import WorkloadKind
from perseus_operator.jobs.job_observation import JobIO, ReadChanges, ReadSnapshots
from perseus_operator.jobs.node_status import PlanReport, plan_report
from perseus_operator.workloads.selectors import matches, parse_selector

__all__ = [
    "Index",
    "IndexedJobIO",
    "IndexedObject",
    "PlanWrites",
    "ReadSnapshot",
    "indexed",
    "job_key",
    "node_key",
    "node_plan_entries",
    "pod_entries",
    "read_all",
    "workload_entries",
]


@dataclass(frozen=True, slots=True)
class IndexedObject:
    """One object as an index keeps it: what lookups compare, and the object, marshalled
    (unmarshalled afresh on every read, as an API response is parsed, so no reader shares a
    dict)."""

    name: str
    labels: Mapping[str, str]
    revision: int
    """``spec.revision`` of a node plan (0 for other objects)."""
    owners: frozenset[str]
    """UIDs of its owner references."""
    data: bytes
    """:func:`marshal.dumps` of the object: every reconcile reads its job's node plans whole,
    and a fresh copy from marshal's bytes costs well under half of parsing the JSON (and
    writing them, at every watch event, a third), by ``benchmarks/operator_scale.py``'s
    profile. Kept in memory only, by the process that wrote it (marshal's format is the
    interpreter's)."""

    report: list[PlanReport] = field(default_factory=list, compare=False, repr=False)
    """A node plan's :class:`~perseus_operator.jobs.node_status.PlanReport`, once read (at
    most one; kept with the object, so it goes when the index replaces the object)."""

    def read(self) -> dict[str, Any]:
        copied: dict[str, Any] = marshal.loads(self.data)
        return copied


Index: TypeAlias = Mapping[Any, Collection[IndexedObject]]
"""Key -> the objects filed under it (a ``kopf.Index`` of :class:`IndexedObject`)."""


def indexed(obj: Mapping[str, Any]) -> IndexedObject:
    """``obj`` (as the API shows it) for an index; its ``managedFields`` are left out (no
    reader needs them, and they are often most of a pod)."""
    metadata = dict(obj.get("metadata") or {})
    metadata.pop("managedFields", None)
    labels = metadata.get("labels") or {}
    spec = obj.get("spec") or {}
    try:
        revision = int(spec.get("revision") or 0) if isinstance(spec, Mapping) else 0
    except (TypeError, ValueError):
        revision = 0
    return IndexedObject(
        name=str(metadata.get("name") or ""),
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {},
        revision=revision,
        owners=frozenset(
            str(ref.get("uid"))
            for ref in metadata.get("ownerReferences") or ()
            if isinstance(ref, Mapping) and ref.get("uid")
        ),
        data=_marshalled({**obj, "metadata": metadata}),
    )


def _marshalled(obj: dict[str, Any]) -> bytes:
    try:
        return marshal.dumps(obj)
    except ValueError:
        # A mapping or list type of the watcher's own somewhere inside: plain JSON data first.
        return marshal.dumps(json.loads(json.dumps(obj, default=_plain)))


def _plain(value: object) -> object:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return list(value)
    raise TypeError(f"not JSON data: {type(value).__name__}")


def pod_entries(obj: Mapping[str, Any]) -> dict[Hashable, IndexedObject]:
    """A pod's entries in the pod index: under its namespace, and under ``(namespace, key,
    value)`` for each of its labels (a job's selector names one: its pods are found without
    looking at every pod of the namespace)."""
    namespace, _ = resources.object_key(obj)
    entry = indexed(obj)
    entries: dict[Hashable, IndexedObject] = {namespace: entry}
    for key, value in entry.labels.items():
        entries[(namespace, key, value)] = entry
    return entries


def job_key(namespace: str, job: str) -> tuple[str, str]:
    """The node plan index's key of a job's plans."""
    return (namespace, resources.label_value(job))


def node_key(namespace: str, node: str) -> tuple[str, str, str]:
    """The node plan index's key of the plans (of every job) on a node."""
    return (namespace, resources.NODE_LABEL, resources.label_value(node))


def node_plan_entries(obj: Mapping[str, Any]) -> dict[Hashable, IndexedObject]:
    """A node plan's entries in the node plan index: its job's plans (:func:`job_key`), whole,
    and the plans on its node (:func:`node_key`) as far as they claim GPUs: without the
    pipeline plans (``spec.plans``, most of a plan) and the status, which every job reads at
    every step of the plans on its nodes (are its GPUs claimed?)."""
    namespace, _ = resources.object_key(obj)
    entry = indexed(obj)
    spec = obj.get("spec")
    claim = entry
    if isinstance(spec, Mapping):
        rest = {k: v for k, v in obj.items() if k not in ("spec", "status", "metadata")}
        # Nor its resourceVersion, which every report changes: a claim changes with its spec
        # only, and so does what a job's quiet steps compare (quiet_steps).
        metadata = obj.get("metadata") or {}
        rest["metadata"] = {k: v for k, v in metadata.items() if k != "resourceVersion"}
        claim = indexed({**rest, "spec": {k: v for k, v in spec.items() if k != "plans"}})
    labels = entry.labels
    return {
        (namespace, labels.get(resources.JOB_LABEL)): entry,
        (namespace, resources.NODE_LABEL, labels.get(resources.NODE_LABEL)): claim,
    }


def workload_entries(kind: WorkloadKind, obj: Mapping[str, Any]) -> dict[Hashable, IndexedObject]:
    """A workload object's entry in the workload index: under ``(namespace, kind, name)``."""
    namespace, name = resources.object_key(obj)
    return {(namespace, kind, name): indexed(obj)}


def read_all(objects: Iterable[IndexedObject]) -> list[dict[str, Any]]:
    """The objects parsed, by name (the order of an API list)."""
    return [o.read() for o in sorted(objects, key=lambda o: o.name)]


@dataclass
class PlanWrites:
    """One job's node plan writes that its index has not shown yet: name -> (revision, owner
    UID) written, or None for a deletion."""

    pending: dict[str, tuple[int, str] | None] = field(default_factory=dict)

    def wrote(self, name: str, revision: int, owner_uid: str) -> None:
        self.pending[name] = (revision, owner_uid)

    def deleted(self, name: str) -> None:
        self.pending[name] = None

    def shown_in(self, plans: Collection[IndexedObject]) -> bool:
        """Whether ``plans`` (the job's plans in the index) show every write; those shown are
        forgotten. A plan shows a write at its revision or a later one, by the same owner (a
        plan of an earlier job of the same name is not this job's)."""
        if not self.pending:
            return True
        by_name = {p.name: p for p in plans}
        for name, written in list(self.pending.items()):
            found = by_name.get(name)
            if written is None:
                shown = found is None
            else:
                revision, owner = written
                shown = found is not None and found.revision >= revision and owner in found.owners
            if shown:
                del self.pending[name]
        return not self.pending


class IndexedJobIO(ReadSnapshots):
    """The :class:`~perseus_operator.jobs.job_observation.JobIO` of one job's reconcile step
    (``job``: namespace and name) whose pods and node plans come from the indexes.

    Args:
        api: Everything else, and the job's node plans while ``writes`` has some the index
            has not shown.
        pods: Pods by namespace and by label (:func:`pod_entries`).
        node_plans: Node plans by job and, what they claim, by node
            (:func:`node_plan_entries`).
        workloads: Workload objects by ``(namespace, kind, name)`` (:func:`workload_entries`).
        writes: The job's node plan writes not shown yet; kept by the caller between steps.
    """

    def __init__(
        self,
        api: JobIO,
        *,
        job: tuple[str, str],
        pods: Index,
        node_plans: Index,
        workloads: Index,
        writes: PlanWrites,
    ) -> None:
        self._api = api
        self._job = job
        self._pods = pods
        self._node_plans = node_plans
        self._workloads = workloads
        self._writes = writes
        self._reads: list[_Read] = []
        self._shown: list[tuple[IndexedObject, ...]] = []
        self._off_index = False
        """Something was read from the API, or written: no snapshot of this step's reads."""
        self._unchanged: list[tuple[_Read, tuple[IndexedObject, ...]]] = []
        """The reads :meth:`changes_since` found unchanged (but the job's own node plans)."""

    # -- from the indexes --

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return read_all(self._record(("pods", namespace, selector)))

    async def list_node_plans(self, namespace: str, job: str) -> list[dict[str, Any]]:
        if (namespace, job) == self._job and not self._writes.shown_in(
            self._node_plans.get(job_key(namespace, job), ())
        ):
            self._off_index = True
            return await self._api.list_node_plans(namespace, job)
        return read_all(self._record(("plans", namespace, job)))

    async def node_plan_reports(self, namespace: str, job: str) -> list[PlanReport]:
        if (namespace, job) == self._job and not self._writes.shown_in(
            self._node_plans.get(job_key(namespace, job), ())
        ):
            self._off_index = True
            return [plan_report(p) for p in await self._api.list_node_plans(namespace, job)]
        return [_report(o) for o in _by_name(self._record(("plans", namespace, job)))]

    async def list_node_plans_on(
        self, namespace: str, nodes: Collection[str]
    ) -> list[dict[str, Any]]:
        # Read for the other jobs' plans: this job's own writes do not matter there.
        return read_all(self._record(("plans on", namespace, frozenset(nodes))))

    async def get_workload(
        self, namespace: str, kind: WorkloadKind, name: str
    ) -> dict[str, Any] | None:
        for found in self._record(("workload", namespace, kind, name)):
            return found.read()
        self._off_index = True
        return await self._api.get_workload(namespace, kind, name)

    # -- what this step read, and whether it still reads the same --

    def _record(self, read: _Read) -> tuple[IndexedObject, ...]:
        found = self._lookup(read)
        self._reads.append(read)
        self._shown.append(found)
        return found

    def _lookup(self, read: _Read) -> tuple[IndexedObject, ...]:
        """The index entries that ``read`` returns (parsed only by the caller)."""
        match read:
            case ("pods", str(namespace), str(selector)):
                wanted = _selector(selector)
                if wanted is None:
                    return tuple(self._pods.get(namespace, ()))
                candidates = self._pods.get(namespace, ())
                for key, value in sorted(wanted.match_labels.items())[:1]:
                    candidates = self._pods.get((namespace, key, value), ())
                return tuple(p for p in candidates if matches(wanted, p.labels))
            case ("plans", str(namespace), str(job)):
                return tuple(self._node_plans.get(job_key(namespace, job), ()))
            case ("plans on", str(namespace), frozenset() as nodes):
                plans = self._node_plans
                return tuple(p for n in nodes for p in plans.get(node_key(namespace, n), ()))
            case ("workload", str(namespace), kind, str(name)):
                return tuple(self._workloads.get((namespace, kind, name), ()))[:1]
        raise ValueError(f"not a read of the indexes: {read!r}")

    def snapshot(self) -> ReadSnapshot | None:
        """This step's reads and what they returned, if all came from the indexes and the
        step wrote nothing (None otherwise: the next step cannot tell what changed)."""
        if self._off_index:
            return None
        return ReadSnapshot(tuple(self._reads), tuple(map(_by_name, self._shown)))

    def changes_since(self, snapshot: object) -> ReadChanges:
        """What the reads of ``snapshot`` (:meth:`snapshot` of an earlier step of this job)
        would return differently now, object by object, byte for byte; the job's own node
        plans count as changed while some of its writes are not shown."""
        self._unchanged.clear()
        if not isinstance(snapshot, ReadSnapshot):
            return ReadChanges.OTHER
        own = ("plans", *self._job)
        own_changed = False
        for read, shown in zip(snapshot.reads, snapshot.shown, strict=True):
            found = _by_name(self._lookup(read))
            if read == own:
                own_changed = found != shown
            elif found == shown:
                self._unchanged.append((read, found))
            else:
                self._unchanged.clear()
                return ReadChanges.OTHER
        if own_changed or not self._writes.shown_in(self._node_plans.get(job_key(*self._job), ())):
            return ReadChanges.OWN_PLANS
        return ReadChanges.NONE

    def adopt(self, snapshot: object) -> None:
        for read, found in self._unchanged:
            self._reads.append(read)
            self._shown.append(found)
        self._unchanged.clear()

    # -- writes, noted until the index shows them --

    async def put_node_plan(self, body: Mapping[str, Any], owner: Mapping[str, Any]) -> None:
        self._off_index = True
        await self._api.put_node_plan(body, owner)
        _, name = resources.object_key(body)
        revision = int((body.get("spec") or {}).get("revision") or 0)
        self._writes.wrote(name, revision, str(owner.get("uid") or ""))

    async def delete_node_plan(self, namespace: str, name: str) -> None:
        self._off_index = True
        await self._api.delete_node_plan(namespace, name)
        self._writes.deleted(name)

    # -- from the API --

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._off_index = True
        return await self._api.get_config_map(namespace, name)

    async def list_config_maps(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self._off_index = True
        return await self._api.list_config_maps(namespace, selector)

    async def put_config_map(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        owner: Mapping[str, Any],
        annotations: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self._off_index = True
        await self._api.put_config_map(namespace, name, data, owner, annotations, labels)

    async def get_node(self, name: str) -> dict[str, Any] | None:
        self._off_index = True
        return await self._api.get_node(name)

    async def list_jobs(self, namespace: str | None, selector: str = "") -> list[dict[str, Any]]:
        self._off_index = True
        return await self._api.list_jobs(namespace, selector)


_Read: TypeAlias = tuple[Hashable, ...]
"""One read of the indexes: its kind and arguments (see :meth:`IndexedJobIO._lookup`)."""


@dataclass(frozen=True, slots=True)
class ReadSnapshot:
    """What one step read from the indexes: each read, and the objects it returned."""

    reads: tuple[_Read, ...]
    shown: tuple[tuple[IndexedObject, ...], ...]


def _by_name(found: Iterable[IndexedObject]) -> tuple[IndexedObject, ...]:
    """What a read returned, in a fixed order: two compare equal when they hold the same
    objects, byte for byte (by identity, most often: the index's own objects)."""
    return tuple(sorted(found, key=_name))


def _name(obj: IndexedObject) -> str:
    return obj.name


_selector = functools.lru_cache(maxsize=4096)(parse_selector)
"""Selectors parsed once: every step of every job parses its own again."""


def _report(obj: IndexedObject) -> PlanReport:
    """The :class:`PlanReport` of an indexed node plan, made once per indexed version: a
    Running job's step reads its plans every time, and most have not changed since the last."""
    if not obj.report:
        obj.report.append(plan_report(obj.read()))
    return obj.report[0]


"""Selectors parsed once: every step of every job parses its own again."""
