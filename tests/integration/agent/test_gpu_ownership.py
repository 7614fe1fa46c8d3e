"""GPU ownership from the kubelet: plans bound to the GPUs the kubelet allocated, processes
bound to their pod's GPUs only. Emulated GPUs (8, with UUIDs) and a kubelet stand-in serving
the PodResources v1 gRPC API on a Unix socket."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("google.protobuf")

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.ownership.gpu_ownership import (
    KubeletOwnership,
    bind_to_allocations,
    pod_uid_of_pid,
)
from perseus_agent.ownership.pod_resources import (
    PodDevices,
    PodResourcesClient,
    decode_list_response,
)
from perseus_agent.plans.job_plans import JobPlans
from perseus_agent.serving.client_dispatch import ClientSession, RequestError
from perseus_agent.serving.local_server import LocalServer
from perseus_api.node_plan import NodePlan
from perseus_client import PerseusClient
from perseus_client.protocol import decode_reply, encode_request, hello_request
from support.agent_process import PROFILE
from support.factories import pipeline_plan_fields
from support.kubelet_pod_resources import KubeletStandIn, StandInPod

NODE = "n1"
UID_A = "0c8f6a52-1d5e-4b8e-9a0b-2f4d6c8e0a11"
UID_B = "7e3b9d10-55aa-4c21-8f3e-aa00bb11cc22"


def uuid(index: int) -> str:
    return f"GPU-emu-{NODE}-{index}"


# Job a's pod got GPUs 5 and 2 of the node's 8 (in that order, as the kubelet lists them);
# job b's pod 0 and 7; an inference pod no plan manages has GPU 1.
POD_A = StandInPod("ml", "a-0", {"pytorch": [uuid(5), uuid(2)]})
POD_B = StandInPod("team-b", "b-0", {"pytorch": [uuid(7), uuid(0)]})
INFERENCE = StandInPod("serving", "infer", {"server": [uuid(1)]})


def node_plan(
    namespace: str,
    job: str,
    pod: str,
    pod_uid: str,
    *,
    granularity: str = "Stage",
    local_ranks: tuple[int, ...] = (0, 1),
    container: str | None = "pytorch",
    first_rank: int = 0,
) -> NodePlan:
    """A plan of ``job`` for the processes ``local_ranks`` of ``pod``: stage = local rank,
    the operator's form (no GPU index or UUID)."""
    fields = pipeline_plan_fields(num_stages=2, num_microbatches=2)
    for stage in fields["stages"]:
        stage["frequency_mhz"] = (1200, 1005)[stage["stage"]]
        stage["instructions"][0]["frequency_mhz"] = (1110, 915)[stage["stage"]]
    return NodePlan.model_validate(
        {
            "node": NODE,
            "namespace": namespace,
            "job": job,
            "revision": 1,
            "granularity": granularity,
            "plans": {"tmin": fields},
            "assignments": [
                {
                    "pod": pod,
                    "pod_uid": pod_uid,
                    "container": container,
                    "local_rank": local,
                    "plan": "tmin",
                    "stage": local,
                    "rank": first_rank + local,
                }
                for local in local_ranks
            ],
        }
    )


PLAN_A = node_plan("ml", "a", "a-0", UID_A)
PLAN_B = node_plan("team-b", "b", "b-0", UID_B)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="pgo-"))  # AF_UNIX paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def backend() -> Iterator[EmulatedBackend]:
    gpus = EmulatedBackend.from_csv(8, PROFILE, blocking_power_w=83.64, node_name=NODE)
    yield gpus
    gpus.close()


@pytest.fixture
def kubelet(short_dir: Path) -> Iterator[KubeletStandIn]:
    with KubeletStandIn(short_dir / "kubelet.sock") as standin:
        standin.set_pods([POD_A, POD_B, INFERENCE])
        yield standin


@pytest.fixture
def client(kubelet: KubeletStandIn) -> Iterator[PodResourcesClient]:
    c = PodResourcesClient(str(kubelet.socket_path))
    yield c
    c.close()


def locked(backend: EmulatedBackend) -> dict[int, int]:
    clocks = {i: backend.locked_sm_clock_mhz(i) for i in range(8)}
    return {i: c for i, c in clocks.items() if c is not None}


def proc_root_for(tmp_path: Path, pid: int, cgroup: str) -> Path:
    """A /proc with ``pid``'s cgroup file only."""
    root = tmp_path / "proc"
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "cgroup").write_text(cgroup)
    return root


def session(cid: int, pid: int | None = None, **hello: Any) -> ClientSession:
    fields = {
        "rank": None,
        "local_rank": None,
        "gpu_uuids": [],
        "pid": 1,
        "job": None,
        "namespace": None,
        "pod": None,
        **hello,
    }
    return ClientSession(cid, pid, 0, 0, 0, hello=hello_request(**fields))


def gpus_of(reply: dict[str, Any]) -> list[int]:
    return [g["index"] for g in reply["gpus"]]


# -- binding plans -----------------------------------------------------------------------------


def test_a_node_shared_by_two_jobs_locks_each_pods_own_gpus_only(
    backend: EmulatedBackend, client: PodResourcesClient, tmp_path: Path
) -> None:
    jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=KubeletOwnership(client))
    jobs.set_plan(("ml", "a"), PLAN_A)
    jobs.set_plan(("team-b", "b"), PLAN_B)
    # Local rank r runs on the r-th of the pod's GPUs in the node's order: a-0 got 5 and 2,
    # so rank 0 is GPU 2 and rank 1 GPU 5; b-0 got 7 and 0. GPUs 1, 3, 4, 6 stay untouched.
    assert locked(backend) == {2: 1200, 5: 1005, 0: 1200, 7: 1005}
    report = jobs.report(("ml", "a"))
    assert report is not None
    assert [(g.index, g.uuid, g.status) for g in report.gpus] == [
        (2, uuid(2), "Applied"),
        (5, uuid(5), "Applied"),
    ]
    jobs.remove(("ml", "a"))
    assert locked(backend) == {0: 1200, 7: 1005}
    jobs.clear()
    assert locked(backend) == {}


@pytest.mark.parametrize(
    ("pods", "reason", "says"),
    [
        ([StandInPod("ml", "a-0", {"pytorch": ["MIG-3f0c", "MIG-77aa"]})], "mig_device", "MIG"),
        (
            [StandInPod("ml", "a-0", {"pytorch": [f"{uuid(2)}::0", f"{uuid(2)}::1"]})],
            "shared_gpu",
            "time-slicing replica",
        ),
        (
            [
                StandInPod("ml", "a-0", {"pytorch": [uuid(2), uuid(5)]}),
                StandInPod("other", "x", {"main": [uuid(5)]}),
            ],
            "shared_gpu",
            "other/x",
        ),
        ([StandInPod("ml", "a-0", {"pytorch": [uuid(2)]})], "gpu_not_allocated", "not one of"),
        ([StandInPod("ml", "a-0", {"init": [uuid(2), uuid(5)]})], "gpu_not_allocated", "container"),
        (
            [StandInPod("ml", "a-0", {"pytorch": ["GPU-elsewhere", uuid(2)]})],
            "gpu_not_allocated",
            "GPU-elsewhere",
        ),
        ([POD_B], "gpu_not_allocated", "is not running"),
    ],
    ids=["mig", "time-slicing", "two-pods", "too-few", "no-container", "foreign-id", "no-pod"],
)
def test_gpus_perseus_cannot_own_alone_are_refused_with_the_reason(
    backend: EmulatedBackend,
    kubelet: KubeletStandIn,
    client: PodResourcesClient,
    tmp_path: Path,
    pods: list[StandInPod],
    reason: str,
    says: str,
) -> None:
    kubelet.set_pods(pods)
    jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=KubeletOwnership(client))
    jobs.set_plan(("ml", "a"), PLAN_A)
    status = jobs.status(("ml", "a"))
    assert status is not None
    condition = status["conditions"][0]
    assert (condition["status"], condition["reason"]) == ("False", "Failed")
    refused = [g for g in status["gpus"] if g["status"] == "Failed"]
    assert refused and all(g["message"].startswith(f"{reason}: ") for g in refused)
    assert says in condition["message"]
    assert jobs.metrics.error_count(reason) >= 1
    if reason != "gpu_not_allocated" or says == "is not running":
        assert locked(backend) == {}  # the pod's GPUs are not its own alone: none is touched
    else:
        assert set(locked(backend)) <= {2, 5}  # never a GPU outside the pod's allocation


def test_a_pod_that_starts_after_its_plan_is_bound_at_the_next_refresh(
    backend: EmulatedBackend, kubelet: KubeletStandIn, client: PodResourcesClient, tmp_path: Path
) -> None:
    kubelet.set_pods([])
    jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=KubeletOwnership(client))
    jobs.set_plan(("ml", "a"), PLAN_A)
    assert locked(backend) == {}
    assert jobs.refresh_ownership() == []  # nothing changed: nothing to report
    kubelet.set_pods([POD_A])
    assert jobs.refresh_ownership() == [("ml", "a")]
    assert locked(backend) == {2: 1200, 5: 1005}
    # The pod is replaced by one with other GPUs: the old ones are reset first.
    kubelet.set_pods([StandInPod("ml", "a-0", {"pytorch": [uuid(6), uuid(3)]})])
    assert jobs.refresh_ownership() == [("ml", "a")]
    assert locked(backend) == {3: 1200, 6: 1005}
    jobs.clear()


def test_without_the_kubelet_socket_no_gpu_is_touched(
    backend: EmulatedBackend, short_dir: Path, tmp_path: Path
) -> None:
    path = short_dir / "later.sock"
    client = PodResourcesClient(str(path), timeout_s=1.0)
    try:
        jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=KubeletOwnership(client))
        jobs.set_plan(("ml", "a"), PLAN_A)
        status = jobs.status(("ml", "a"))
        assert status is not None and locked(backend) == {}
        assert all(g["message"].startswith("pod_resources_unavailable: ") for g in status["gpus"])
        assert "--gpu-ownership=local-rank-index" in status["conditions"][0]["message"]
        with KubeletStandIn(path) as kubelet:  # the kubelet comes up
            kubelet.set_pods([POD_A])
            assert jobs.refresh_ownership() == [("ml", "a")]
            assert locked(backend) == {2: 1200, 5: 1005}
            jobs.clear()
    finally:
        client.close()


def test_binding_is_pure_over_the_kubelets_answer(backend: EmulatedBackend) -> None:
    pods = [PodDevices("ml", "a-0", {})]
    binding = bind_to_allocations(PLAN_A, pods, backend.devices())
    assert binding.plan.assignments == [] and binding.pending
    listed = decode_list_response(b"")
    assert bind_to_allocations(PLAN_A, listed, backend.devices()).pending


# -- binding training processes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "cgroup",
    [
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/cri-containerd-abc.scope\n",
        f"12:memory:/kubepods/besteffort/pod{UID_A}/0123abcd\n0::/\n",
    ],
    ids=["systemd", "cgroupfs"],
)
def test_the_pod_uid_is_read_from_the_process_cgroup(tmp_path: Path, cgroup: str) -> None:
    root = proc_root_for(tmp_path, 4242, cgroup)
    assert pod_uid_of_pid(4242, root) == UID_A
    assert pod_uid_of_pid(4243, root) is None
    (root / "4242" / "cgroup").write_text("0::/\n")  # a cgroup namespace hides the path
    assert pod_uid_of_pid(4242, root) is None


def test_processes_are_bound_to_their_own_pods_gpus_only(
    backend: EmulatedBackend, client: PodResourcesClient, tmp_path: Path
) -> None:
    root = proc_root_for(tmp_path, 777, f"0::/kubepods/pod{UID_A}/c1\n")
    ownership = KubeletOwnership(client, proc_root=root)
    jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=ownership)
    jobs.set_plan(("ml", "a"), node_plan("ml", "a", "a-0", UID_A, granularity="Instruction"))
    jobs.set_plan(
        ("team-b", "b"), node_plan("team-b", "b", "b-0", UID_B, granularity="Instruction")
    )

    # By cgroup (pid 777 is in pod a-0): a process that sees every GPU and claims them all
    # is refused, and one claiming b-0's GPU too.
    every = session(1, pid=777, gpu_uuids=[uuid(i) for i in range(8)], rank=0)
    with pytest.raises(RequestError, match=r"not allocated to pod ml/a-0"):
        jobs.hello(every, every.hello, 0)
    # Rank 0 is in both plans; by its cgroup it is a-0's, whose rank 0 runs on GPU 2.
    rank0 = session(2, pid=777, rank=0)
    assert gpus_of(jobs.hello(rank0, rank0.hello, 0)) == [2]
    begin = {"op": "instruction_begin", "name": "forward", "microbatch": 0}
    jobs.step_begin(rank0, {"op": "step_begin", "step": 0}, 0)
    assert jobs.instruction_begin(rank0, begin, 0)["sm_clock_mhz"] == 1110
    assert locked(backend) == {2: 1110}
    # A process whose cgroup says a-0 but says it is b-0 is refused.
    liar = session(3, pid=777, pod="b-0", gpu_uuids=[uuid(0)])
    with pytest.raises(RequestError, match="cgroup"):
        jobs.hello(liar, liar.hello, 0)

    # No pid (an agent outside the host PID namespace): the pod it names, checked.
    named = session(4, pod="b-0", namespace="team-b", gpu_uuids=[uuid(7)])
    assert gpus_of(jobs.hello(named, named.hello, 0)) == [7]
    stolen = session(5, pod="b-0", gpu_uuids=[uuid(2)])
    with pytest.raises(
        RequestError, match=r"GPU\(s\) GPU-emu-n1-2 are not allocated to pod team-b/b-0"
    ):
        jobs.hello(stolen, stolen.hello, 0)
    # Neither pid nor pod: the managed pod allocated every GPU it claims.
    anonymous = session(6, gpu_uuids=[uuid(0)])
    assert gpus_of(jobs.hello(anonymous, anonymous.hello, 0)) == [0]
    greedy = session(7, gpu_uuids=[uuid(0), uuid(7), uuid(2)])  # b-0's and one of a-0's
    with pytest.raises(RequestError, match=r"cannot tell which pod.*ml/a-0, team-b/b-0"):
        jobs.hello(greedy, greedy.hello, 0)
    unowned = session(9, gpu_uuids=[uuid(1)])  # the inference pod's: not managed
    assert jobs.hello(unowned, unowned.hello, 0)["managed"] is False
    # An unmanaged pod (by cgroup) gets no GPU, whatever it claims.
    root_other = proc_root_for(
        tmp_path, 778, "0::/kubepods/pod11111111-2222-3333-4444-555555555555/x\n"
    )
    assert root_other == root
    stranger = session(8, pid=778, gpu_uuids=[uuid(5)], rank=1)
    assert jobs.hello(stranger, stranger.hello, 0)["managed"] is False
    assert locked(backend) == {2: 1110}
    jobs.clear()


def test_the_peer_is_told_by_so_peercred_over_the_agent_socket(
    backend: EmulatedBackend, client: PodResourcesClient, tmp_path: Path, short_dir: Path
) -> None:
    # This test process plays the training process: its real pid (SO_PEERCRED) is in pod a-0.
    root = proc_root_for(tmp_path, os.getpid(), f"0::/kubepods/burstable/pod{UID_A}/c1\n")
    jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=KubeletOwnership(client, root))
    jobs.set_plan(("ml", "a"), node_plan("ml", "a", "a-0", UID_A, granularity="Instruction"))
    jobs.set_plan(
        ("team-b", "b"), node_plan("team-b", "b", "b-0", UID_B, granularity="Instruction")
    )
    path = short_dir / "agent.sock"
    with LocalServer(path, jobs):
        # Claims b-0's GPU: refused with the reason, and nothing locked.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(str(path))
            hello = hello_request(
                rank=1, local_rank=1, gpu_uuids=[uuid(0)], pid=1, job=None, namespace=None, pod=None
            )
            raw.sendall(encode_request(hello))
            reply = decode_reply(raw.makefile("rb").readline())
        assert reply["ok"] is False and "not allocated to pod ml/a-0" in json.dumps(reply)
        # Its own GPU 5 (local rank 1): driven.
        perseus = PerseusClient(path, rank=1, local_rank=1, gpu_uuids=[uuid(5)])
        try:
            perseus.on_step_begin(0)
            assert perseus.on_instruction_begin("forward", 0) == 915
            assert locked(backend) == {5: 915}
        finally:
            perseus.close()
    jobs.clear()


def test_the_peer_is_told_by_its_address_over_the_agent_tcp_listener(
    backend: EmulatedBackend, client: PodResourcesClient, tmp_path: Path
) -> None:
    # This test process plays pod a-0's training process, whose pod IP is 127.0.0.1 in the
    # node's pod list (the listener binds loopback); no cgroup, no pid: the address decides.
    from perseus_agent.ownership.node_pods import NodePods
    from perseus_agent.serving.tcp_server import CLIENT_LABEL, TcpServer

    pod = {
        "metadata": {
            "namespace": "ml",
            "name": "a-0",
            "uid": UID_A,
            "labels": {CLIENT_LABEL: "true"},
        },
        "spec": {},
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }
    jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=KubeletOwnership(client))
    jobs.set_plan(("ml", "a"), node_plan("ml", "a", "a-0", UID_A, granularity="Instruction"))
    jobs.set_plan(
        ("team-b", "b"), node_plan("team-b", "b", "b-0", UID_B, granularity="Instruction")
    )
    book = NodePods(NODE)
    book.listed([pod])
    server = TcpServer("127.0.0.1", 0, jobs, book.resolve, book.holds)
    with server:
        address = f"tcp://127.0.0.1:{server.port}"
        # Speaking for b-0 (its name and GPU): refused, nothing locked.
        impostor = PerseusClient(address, rank=1, local_rank=1, gpu_uuids=[uuid(0)], pod="b-0")
        try:
            impostor.on_step_begin(0)
            assert not impostor.connected
        finally:
            impostor.close()
        # b-0's GPU, naming no pod: the address says a-0, which was not allocated it.
        greedy = PerseusClient(address, rank=1, local_rank=1, gpu_uuids=[uuid(0)])
        try:
            greedy.on_step_begin(0)
            assert not greedy.connected
        finally:
            greedy.close()
        assert locked(backend) == {}
        perseus = PerseusClient(address, rank=1, local_rank=1, gpu_uuids=[uuid(5)])
        try:
            perseus.on_step_begin(0)
            assert perseus.on_instruction_begin("forward", 0) == 915
            assert locked(backend) == {5: 915}
        finally:
            perseus.close()
    jobs.clear()


def test_a_standalone_agent_refuses_gpus_named_by_process_only(
    backend: EmulatedBackend, tmp_path: Path
) -> None:
    # Without a kubelet nothing says which GPU a pod's local rank is: never guessed.
    from perseus_agent.control.applier import PlanApplier

    applier = PlanApplier(backend, ResetState(tmp_path), NODE)
    report = applier.apply(PLAN_A)
    assert [g.status for g in report.gpus] == ["Failed", "Failed"]
    assert "named by its process only" in report.gpus[0].message
    assert locked(backend) == {}


# -- tenancy (issue 30) ----------------------------------------------------------------------------


def _api_pod(namespace: str, name: str, uid: str) -> dict[str, Any]:
    """A pod as the API server lists it (what the agent's pod watch keeps)."""
    return {
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"nodeName": NODE},
        "status": {"phase": "Running"},
    }


def test_a_plan_naming_another_namespaces_pod_touches_no_gpu(
    backend: EmulatedBackend, client: PodResourcesClient, tmp_path: Path
) -> None:
    """Case 1: a plan object in team-b whose spec names namespace serving and its inference
    pod (no job manages it) is refused whole; the victim's GPU is not locked and its UUID does
    not appear in team-b's status."""
    jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=KubeletOwnership(client))
    rogue = node_plan("serving", "steal", "infer", UID_B, container="server", local_ranks=(0,))
    jobs.set_plan(("team-b", "steal-n1"), rogue)
    assert locked(backend) == {}
    status = jobs.status(("team-b", "steal-n1"))
    assert status is not None and status["conditions"][0]["reason"] == "InvalidSpec"
    assert uuid(1) not in json.dumps(status)
    jobs.clear()


def test_a_recreated_pod_is_its_jobs_by_its_current_uid(
    backend: EmulatedBackend, client: PodResourcesClient, tmp_path: Path
) -> None:
    """Case 3: a PyTorchJob retry recreates pod ml/a-0 with a new UID; the plan still carries
    the old one. The pod's process (cgroup: the new UID) is managed, as the API says the UID
    is ml/a-0's; without the pod list it is unmanaged, and the log says why."""
    from perseus_agent.ownership.node_pods import NodePods

    new_uid = "99999999-1d5e-4b8e-9a0b-2f4d6c8e0a11"
    root = proc_root_for(tmp_path, 777, f"0::/kubepods/pod{new_uid}/c1\n")
    pods = NodePods(NODE)
    pods.listed([_api_pod("ml", "a-0", new_uid), _api_pod("team-b", "b-0", UID_B)])
    plan = node_plan("ml", "a", "a-0", UID_A, granularity="Instruction")  # the old UID
    for ownership, managed in (
        (KubeletOwnership(client, proc_root=root, pods=pods), True),
        (KubeletOwnership(client, proc_root=root), False),
    ):
        jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=ownership)
        jobs.set_plan(("ml", "a"), plan)
        rank1 = session(1, pid=777, rank=1, local_rank=1, pod="a-0", namespace="ml")
        reply = jobs.hello(rank1, rank1.hello, 0)
        assert reply["managed"] is managed
        if managed:
            assert gpus_of(reply) == [5]
            jobs.step_begin(rank1, {"op": "step_begin", "step": 0}, 0)
            begin = {"op": "instruction_begin", "name": "forward", "microbatch": 0}
            assert jobs.instruction_begin(rank1, begin, 0)["sm_clock_mhz"] == 915
            assert locked(backend) == {5: 915}
        jobs.clear()


def test_a_plan_claiming_another_tenants_pod_uid_locks_nobody_out(
    backend: EmulatedBackend, client: PodResourcesClient, tmp_path: Path
) -> None:
    """Case 6: a hand-edited plan of team-b claims ml/a-0's UID for a pod of its own. The
    plans used to share one UID map (the later plan won) and a-0's process was refused. The
    pod list says whose the UID is; without it, each plan speaks for its own namespace and the
    process's own namespace decides between them."""
    from perseus_agent.ownership.node_pods import NodePods

    root = proc_root_for(tmp_path, 777, f"0::/kubepods/pod{UID_A}/c1\n")
    pods = NodePods(NODE)
    pods.listed([_api_pod("ml", "a-0", UID_A), _api_pod("team-b", "b-0", UID_B)])
    for ownership in (
        KubeletOwnership(client, proc_root=root, pods=pods),
        KubeletOwnership(client, proc_root=root),
    ):
        jobs = JobPlans(backend, ResetState(tmp_path), NODE, ownership=ownership)
        jobs.set_plan(("ml", "a"), node_plan("ml", "a", "a-0", UID_A, granularity="Instruction"))
        jobs.set_plan(
            ("team-b", "b"), node_plan("team-b", "b", "b-0", UID_A, granularity="Instruction")
        )
        rank0 = session(1, pid=777, rank=0, local_rank=0, namespace="ml")
        assert gpus_of(jobs.hello(rank0, rank0.hello, 0)) == [2]
        jobs.clear()
