"""The agent's PodResources client against a kubelet stand-in serving the v1 gRPC API."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc")
pytest.importorskip("google.protobuf")

from perseus_agent.ownership.pod_resources import (
    ContainerDevices,
    PodDevices,
    PodResourcesClient,
    PodResourcesError,
    decode_get_response,
    decode_list_response,
    encode_get_request,
    encode_list_response,
)
from support.kubelet_pod_resources import (
    KubeletStandIn,
    StandInPod,
    message_class,
    pod_message,
)

TRAINER = StandInPod(
    "ml",
    "trainer-0",
    {"pytorch": ["GPU-5", "GPU-2"], "sidecar": []},
    other={"sidecar": {"example.com/nic": ["nic-1"]}},
)
OTHER = StandInPod("team-b", "infer-7", {"server": ["GPU-0"]})


def test_decodes_what_the_protobuf_runtime_encodes() -> None:
    response = message_class("ListPodResourcesResponse")()
    response.pod_resources.append(pod_message(TRAINER))
    response.pod_resources.append(pod_message(OTHER))
    pods = decode_list_response(response.SerializeToString())
    trainer, other = pods
    assert (trainer.namespace, trainer.name) == ("ml", "trainer-0")
    # The kubelet's order is kept; CPU ids, memory and NUMA topology are skipped.
    assert trainer.device_ids("nvidia.com/gpu") == ("GPU-5", "GPU-2")
    assert trainer.device_ids("nvidia.com/gpu", "pytorch") == ("GPU-5", "GPU-2")
    assert trainer.device_ids("nvidia.com/gpu", "sidecar") == ()
    assert trainer.device_ids("example.com/nic") == ("nic-1",)
    assert other.device_ids("nvidia.com/gpu") == ("GPU-0",)
    assert decode_list_response(b"") == []


def test_its_encoding_is_what_the_protobuf_runtime_decodes() -> None:
    pod = PodDevices(
        "ml", "trainer-0", {"pytorch": (ContainerDevices("nvidia.com/gpu", ("a", "b")),)}
    )
    parsed = message_class("ListPodResourcesResponse").FromString(encode_list_response([pod]))
    (message,) = parsed.pod_resources
    assert (message.namespace, message.name) == ("ml", "trainer-0")
    assert [
        (c.name, [(d.resource_name, list(d.device_ids)) for d in c.devices])
        for c in message.containers
    ] == [("pytorch", [("nvidia.com/gpu", ["a", "b"])])]
    request = message_class("GetPodResourcesRequest").FromString(encode_get_request("ml", "p"))
    assert (request.pod_namespace, request.pod_name) == ("ml", "p")
    response = message_class("GetPodResourcesResponse")(pod_resources=pod_message(OTHER))
    decoded = decode_get_response(response.SerializeToString())
    assert decoded is not None and decoded.device_ids("nvidia.com/gpu") == ("GPU-0",)


@pytest.mark.parametrize(
    "data",
    [b"\x0a\x05ab", b"\x0a", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b", b"\x00"],
    ids=["truncated-field", "truncated-length", "long-varint", "group-wire-type", "field-0"],
)
def test_malformed_messages_are_errors(data: bytes) -> None:
    with pytest.raises(PodResourcesError):
        decode_list_response(data)


def test_list_and_get_over_the_kubelet_socket(socket_dir: Path) -> None:
    path = socket_dir / "kubelet.sock"
    with KubeletStandIn(path) as kubelet:
        kubelet.set_pods([TRAINER, OTHER])
        client = PodResourcesClient(str(path))
        try:
            pods = client.list()
            assert [(p.namespace, p.name) for p in pods] == [
                ("ml", "trainer-0"),
                ("team-b", "infer-7"),
            ]
            pod = client.get("ml", "trainer-0")
            assert pod is not None and pod.device_ids("nvidia.com/gpu") == ("GPU-5", "GPU-2")
            assert kubelet.calls == {"List": 1, "Get": 1}
            # An unknown pod: the kubelet answers an error; List confirms it is not there.
            assert client.get("ml", "gone") is None
            assert client.get("ml", "trainer-0") is not None
            assert kubelet.calls["Get"] == 3
        finally:
            client.close()


def test_get_falls_back_to_list_where_the_kubelet_does_not_serve_it(socket_dir: Path) -> None:
    path = socket_dir / "kubelet.sock"
    with KubeletStandIn(path, serve_get=False) as kubelet:
        kubelet.set_pods([TRAINER])
        client = PodResourcesClient(str(path))
        try:
            for _ in range(3):
                pod = client.get("ml", "trainer-0")
                assert pod is not None and pod.device_ids("nvidia.com/gpu") == ("GPU-5", "GPU-2")
            assert kubelet.calls == {"Get": 1, "List": 3}  # Get tried once only
        finally:
            client.close()


def test_an_absent_socket_is_an_error_that_names_it(socket_dir: Path) -> None:
    client = PodResourcesClient(str(socket_dir / "missing.sock"), timeout_s=1.0)
    try:
        with pytest.raises(PodResourcesError, match=r"missing\.sock"):
            client.list()
    finally:
        client.close()


def _repeated(names: int) -> bytes:
    """A pod listing one container name ``names`` times, one GPU each (a broken kubelet)."""
    message = message_class("ListPodResourcesResponse")()
    pod = message.pod_resources.add(name="p", namespace="ml")
    for i in range(names):
        container = pod.containers.add(name="pytorch")
        container.devices.add(resource_name="nvidia.com/gpu", device_ids=[f"GPU-{i}"])
    return message.SerializeToString()


def test_repeated_container_names_are_merged_in_order_up_to_a_bound() -> None:
    """Issue 30, case 7: 80,000 repeats of one container name (101 s to decode before) are
    refused by their count, before any is decoded; up to the bound, repeats are merged in the
    kubelet's order (a linear merge: each entry appended once)."""
    from perseus_agent.ownership.pod_resources import MAX_CONTAINERS_PER_POD

    with pytest.raises(PodResourcesError, match="lists 80000 containers, more than any pod"):
        decode_list_response(_repeated(80_000))
    (pod,) = decode_list_response(_repeated(MAX_CONTAINERS_PER_POD))
    assert list(pod.containers) == ["pytorch"]
    assert pod.device_ids("nvidia.com/gpu") == tuple(
        f"GPU-{i}" for i in range(MAX_CONTAINERS_PER_POD)
    )
