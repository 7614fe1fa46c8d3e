"""The chart's Helm hooks, run as ``perseus-operator --hook ...`` in a hook pod.

- ``before-uninstall`` (``helm.sh/hook: pre-delete``): while the operator and the agents still
  run, delete every PerseusPolicy (which takes its jobs along) and every PerseusJob, and wait
  until they are gone, i.e. until the operator has had the agents reset each job's GPUs and
  removed its finalizer. Without it ``helm uninstall`` removes the operator first and leaves
  each PerseusJob with a finalizer no one will remove: its namespace would hang in
  ``Terminating``.
- ``test`` (``helm test``): the release works: the CRDs are served and established, and (with
  leader election) an operator replica holds the Lease and keeps renewing it.

The decisions (:func:`missing_crds`, :func:`lease_renewed`, :func:`remaining`) are pure;
:func:`run_hook` does the I/O through
:class:`perseus_operator.cluster.kube.blocking_clients.HookApi`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from perseus_api import resources
from perseus_api.job import JOB_PLURAL
from perseus_api.policy import POLICY_PLURAL
from perseus_operator.cluster.leader_election import LeaseRecord, LeaseStore
from perseus_operator.config import OperatorConfig

CRDS: Final = tuple(
    f"{plural}.{resources.GROUP}"
    for plural in (JOB_PLURAL, resources.NODE_PLAN_PLURAL, POLICY_PLURAL)
)
POLL_S: Final = 1.0


def missing_crds(crds: Iterable[Mapping[str, Any]], version: str = resources.VERSION) -> list[str]:
    """What is wrong with the Perseus CRDs: absent, not Established, or not serving
    ``version`` (empty: all good)."""
    by_name = {str((c.get("metadata") or {}).get("name")): c for c in crds}
    problems = []
    for name in CRDS:
        crd = by_name.get(name)
        if crd is None:
            problems.append(f"CRD {name} is not installed")
            continue
        conditions = (crd.get("status") or {}).get("conditions") or []
        if not any(
            c.get("type") == "Established" and c.get("status") == "True" for c in conditions
        ):
            problems.append(f"CRD {name} is not Established")
        served = [
            v.get("name") for v in (crd.get("spec") or {}).get("versions") or [] if v.get("served")
        ]
        if version not in served:
            problems.append(f"CRD {name} does not serve {version} (serves {served})")
    return problems


def lease_renewed(first: LeaseRecord | None, second: LeaseRecord | None) -> str:
    """Why two reads of the Lease, a renewal period apart, do not show a leader renewing it
    (empty: they do). Clock-free: a renewal is a new version of the record by the same or a
    new holder, never a timestamp compared with this pod's clock."""
    if first is None or second is None:
        return "no operator replica has ever held the leader Lease"
    if not second.holder:
        return "the leader Lease is released: no operator replica is leading"
    if second.resource_version == first.resource_version:
        return f"the leader Lease held by {second.holder!r} was not renewed"
    return ""


def remaining(jobs: Iterable[Mapping[str, Any]]) -> list[str]:
    """``namespace/name`` of the PerseusJobs still there."""
    return sorted(f"{namespace}/{name}" for namespace, name in map(resources.object_key, jobs))


def before_uninstall(
    api: Any,
    namespaces: Sequence[str],
    *,
    timeout_s: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Delete the policies and jobs and wait until the jobs are gone; False on timeout."""
    for policy in api.policies():
        name = str((policy.get("metadata") or {}).get("name"))
        say(f"deleting PerseusPolicy {name}")
        api.delete_policy(name)
    scopes: list[str | None] = list(namespaces) or [None]
    deadline = clock() + timeout_s
    asked: set[str] = set()
    while True:
        jobs = [job for scope in scopes for job in api.jobs(scope)]
        left = remaining(jobs)
        if not left:
            say("no PerseusJob left: every job's GPUs were reset")
            return True
        for job in jobs:
            namespace, name = resources.object_key(job)
            if f"{namespace}/{name}" not in asked:
                say(f"deleting PerseusJob {namespace}/{name}")
                api.delete_job(namespace, name)
                asked.add(f"{namespace}/{name}")
        if clock() >= deadline:
            say(
                f"{len(left)} PerseusJob(s) still there after {timeout_s:g} s: {', '.join(left)}. "
                "Is the operator running (kubectl get lease -n <release namespace>)? Fix it and "
                "uninstall again, or uninstall with --no-hooks and remove the finalizer "
                f"{resources.GROUP}/reset-gpus by hand (the agents reset the GPUs when they stop)."
            )
            return False
        sleep(POLL_S)


def release_test(
    api: Any,
    lease: LeaseStore | None,
    *,
    retry_period_s: float,
    say: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    problems = missing_crds(api.crds())
    if not problems:
        say(f"CRDs served and established: {', '.join(CRDS)}")
    if lease is not None:
        first = lease.get()
        sleep(retry_period_s + 1.0)
        second = lease.get()
        why = lease_renewed(first, second)
        if why:
            problems.append(why)
        elif second is not None:
            say(f"operator leading and renewing: {second.holder}")
    for problem in problems:
        say(f"FAIL: {problem}")
    return not problems


def run_hook(
    hook: str, config: OperatorConfig, namespaces: Sequence[str], *, timeout_s: float
) -> int:
    """Run ``hook``; the process exit code (0: passed)."""
    from perseus_operator.cluster.kube.blocking_clients import HookApi
    from perseus_operator.cluster.kube.client import KubeError, load_api_client
    from perseus_operator.cluster.kube.lease_api import LeaseApi

    def say(line: str) -> None:
        print(f"perseus-operator --hook {hook}: {line}", file=sys.stderr, flush=True)

    kubeconfig = config.kubeconfig or os.environ.get("KUBECONFIG", "")
    try:
        client = load_api_client(kubeconfig)
        api = HookApi(client)
        if hook == "before-uninstall":
            ok = before_uninstall(api, namespaces, timeout_s=timeout_s, say=say)
        else:
            lease = None
            if config.leader_election_namespace:
                lease = LeaseApi(
                    client, config.leader_election_namespace, config.leader_election_lease
                )
            ok = release_test(api, lease, retry_period_s=config.retry_period_s, say=say)
    except KubeError as exc:
        say(f"FAIL: {exc}")
        return 1
    return 0 if ok else 1
