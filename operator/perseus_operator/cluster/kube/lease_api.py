"""The Lease the operator's replicas elect their leader with: read, created and replaced here.

Blocking, in the elector's own thread: :mod:`perseus_operator.cluster.leader_election`
decides, this module only speaks ``coordination.k8s.io/v1`` and turns a Lease as the API
returns it into a :class:`~perseus_operator.cluster.leader_election.LeaseRecord` and back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC
from http import HTTPStatus
from typing import Any, Final

from perseus_api.conventions import parse_rfc3339
from perseus_api.kube_client import describe_api_error
from perseus_operator.cluster.kube.client import KubeError, response_json
from perseus_operator.cluster.leader_election import LeaseRecord


class LeaseApi:
    """One ``coordination.k8s.io/v1`` Lease, for leader election
    (:class:`perseus_operator.cluster.leader_election.LeaseStore`). Blocking: it runs in the
    elector's own thread, apart from the event loop, so a busy loop never delays a renewal."""

    def __init__(self, api_client: Any, namespace: str, name: str) -> None:
        from kubernetes import client

        self._api = client.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.name = name

    def get(self) -> LeaseRecord | None:
        from kubernetes.client.exceptions import ApiException

        try:
            response = self._api.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False, _request_timeout=LEASE_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status == HTTPStatus.NOT_FOUND:
                return None
            raise KubeError(describe_api_error(exc), exc.status) from None
        return lease_record(response_json(response))

    def create(self, record: LeaseRecord) -> bool:
        return self._write(
            lambda body: self._api.create_namespaced_lease(
                self.namespace, body, _preload_content=False, _request_timeout=LEASE_TIMEOUT_S
            ),
            record,
        )

    def update(self, record: LeaseRecord) -> bool:
        return self._write(
            lambda body: self._api.replace_namespaced_lease(
                self.name,
                self.namespace,
                body,
                _preload_content=False,
                _request_timeout=LEASE_TIMEOUT_S,
            ),
            record,
        )

    def _write(self, call: Callable[[dict[str, Any]], Any], record: LeaseRecord) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            call(lease_object(self.namespace, self.name, record))
        except ApiException as exc:
            if exc.status == 409:  # changed (or created) by another replica since read
                return False
            raise KubeError(describe_api_error(exc), exc.status) from None
        return True


LEASE_TIMEOUT_S: Final = 5.0
"""A Lease call must fail well within the renew deadline, to be retried."""


def lease_object(namespace: str, name: str, record: LeaseRecord) -> dict[str, Any]:
    """The Lease for ``record``; its resource version makes a replace conditional."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if record.resource_version:
        metadata["resourceVersion"] = record.resource_version
    spec: dict[str, Any] = {
        "holderIdentity": record.holder,
        "leaseDurationSeconds": record.lease_duration_s,
        "leaseTransitions": record.transitions,
    }
    for key, stamp in (("acquireTime", record.acquire_time), ("renewTime", record.renew_time)):
        if stamp is not None:
            spec[key] = stamp.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": spec,
    }


def lease_record(lease: Mapping[str, Any]) -> LeaseRecord:
    """The record of a Lease as the API returns it."""
    spec = lease.get("spec") or {}
    metadata = lease.get("metadata") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        lease_duration_s=int(spec.get("leaseDurationSeconds") or 1),
        acquire_time=parse_rfc3339(spec.get("acquireTime")),
        renew_time=parse_rfc3339(spec.get("renewTime")),
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=str(metadata.get("resourceVersion") or ""),
    )
