"""A kubelet stand-in: the PodResources v1 gRPC API on a Unix socket, as the kubelet serves it.

The messages are built with the official protobuf runtime (PyPI ``protobuf``) from a
descriptor written here after the published API definition
(``k8s.io/kubelet/pkg/apis/podresources/v1/api.proto``, package ``v1``), not with the agent's
own codec: the agent's decoder is checked against real protobuf encoding, including the
fields it skips (CPU ids, NUMA topology, memory). Only what Perseus reads and what the
kubelet sends beside it is declared.

    with KubeletStandIn(tmp_path / "kubelet.sock") as kubelet:
        kubelet.set_pods([StandInPod("ml", "trainer-0", {"pytorch": ["GPU-5", "GPU-2"]})])
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_T = descriptor_pb2.FieldDescriptorProto
_OPTIONAL, _REPEATED = _T.LABEL_OPTIONAL, _T.LABEL_REPEATED


def _message(
    file: descriptor_pb2.FileDescriptorProto,
    name: str,
    fields: Sequence[tuple[str, int, int, int, str]],
) -> None:
    message = file.message_type.add(name=name)
    for field_name, number, label, kind, type_name in fields:
        f = message.field.add(name=field_name, number=number, label=label, type=kind)
        if type_name:
            f.type_name = f".v1.{type_name}"


def _descriptor() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="perseus_tests/podresources_v1.proto", package="v1", syntax="proto3"
    )
    msg, string, int64, uint64 = _T.TYPE_MESSAGE, _T.TYPE_STRING, _T.TYPE_INT64, _T.TYPE_UINT64
    _message(file, "ListPodResourcesRequest", [])
    _message(
        file, "ListPodResourcesResponse", [("pod_resources", 1, _REPEATED, msg, "PodResources")]
    )
    _message(
        file,
        "PodResources",
        [
            ("name", 1, _OPTIONAL, string, ""),
            ("namespace", 2, _OPTIONAL, string, ""),
            ("containers", 3, _REPEATED, msg, "ContainerResources"),
        ],
    )
    _message(
        file,
        "ContainerResources",
        [
            ("name", 1, _OPTIONAL, string, ""),
            ("devices", 2, _REPEATED, msg, "ContainerDevices"),
            ("cpu_ids", 3, _REPEATED, int64, ""),
            ("memory", 4, _REPEATED, msg, "ContainerMemory"),
        ],
    )
    _message(
        file,
        "ContainerMemory",
        [
            ("memory_type", 1, _OPTIONAL, string, ""),
            ("size", 2, _OPTIONAL, uint64, ""),
            ("topology", 3, _OPTIONAL, msg, "TopologyInfo"),
        ],
    )
    _message(
        file,
        "ContainerDevices",
        [
            ("resource_name", 1, _OPTIONAL, string, ""),
            ("device_ids", 2, _REPEATED, string, ""),
            ("topology", 3, _OPTIONAL, msg, "TopologyInfo"),
        ],
    )
    _message(file, "TopologyInfo", [("nodes", 1, _REPEATED, msg, "NUMANode")])
    _message(file, "NUMANode", [("ID", 1, _OPTIONAL, int64, "")])
    _message(
        file,
        "GetPodResourcesRequest",
        [("pod_name", 1, _OPTIONAL, string, ""), ("pod_namespace", 2, _OPTIONAL, string, "")],
    )
    _message(
        file, "GetPodResourcesResponse", [("pod_resources", 1, _OPTIONAL, msg, "PodResources")]
    )
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_descriptor())


def message_class(name: str) -> Any:
    """The protobuf message class ``v1.<name>``."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"v1.{name}"))


@dataclass(frozen=True)
class StandInPod:
    """A pod as the kubelet reports it: container -> ``nvidia.com/gpu`` device ids (other
    resources: ``other``, container -> resource -> ids)."""

    namespace: str
    name: str
    gpus: Mapping[str, Sequence[str]] = field(default_factory=dict)
    other: Mapping[str, Mapping[str, Sequence[str]]] = field(default_factory=dict)


def pod_message(pod: StandInPod) -> Any:
    """``v1.PodResources`` for ``pod``, with CPU ids, NUMA topology and memory filled in, as a
    kubelet with the CPU and memory managers sends them."""
    message = message_class("PodResources")(name=pod.name, namespace=pod.namespace)
    names = list(dict.fromkeys([*pod.gpus, *pod.other]))
    for name in names:
        container = message.containers.add(name=name)
        container.cpu_ids.extend([2, 3, 66])
        memory = container.memory.add(memory_type="memory", size=1 << 30)
        memory.topology.nodes.add(ID=0)
        resources = {"nvidia.com/gpu": pod.gpus.get(name, ()), **pod.other.get(name, {})}
        for resource, ids in resources.items():
            if ids:
                devices = container.devices.add(resource_name=resource)
                devices.device_ids.extend(ids)
                devices.topology.nodes.add(ID=1)
    return message


class KubeletStandIn:
    """Serves ``v1.PodResourcesLister`` (List, GetAllocatableResources is not needed, Get) on
    ``socket_path``. ``serve_get=False`` answers Get as a kubelet with the
    ``KubeletPodResourcesGet`` gate off does. ``calls`` counts the calls by method."""

    def __init__(self, socket_path: Path, *, serve_get: bool = True) -> None:
        self.socket_path = socket_path
        self.serve_get = serve_get
        self.calls: dict[str, int] = {"List": 0, "Get": 0}
        self._pods: list[StandInPod] = []
        self._lock = threading.Lock()
        self._server: Any = None

    def set_pods(self, pods: Sequence[StandInPod]) -> None:
        with self._lock:
            self._pods = list(pods)

    def _list(self, request: Any, context: Any) -> Any:
        with self._lock:
            self.calls["List"] += 1
            pods = list(self._pods)
        response = message_class("ListPodResourcesResponse")()
        for pod in pods:
            response.pod_resources.append(pod_message(pod))
        return response

    def _get(self, request: Any, context: Any) -> Any:
        with self._lock:
            self.calls["Get"] += 1
            pods = list(self._pods)
        # The kubelet's own answers (pkg/kubelet/apis/podresources/server_v1.go): plain
        # errors, so gRPC code Unknown, for a disabled method and for an unknown pod.
        if not self.serve_get:
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        for pod in pods:
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return message_class("GetPodResourcesResponse")(pod_resources=pod_message(pod))
        context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def start(self) -> KubeletStandIn:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers = {
            "List": grpc.unary_unary_rpc_method_handler(
                self._list,
                request_deserializer=message_class("ListPodResourcesRequest").FromString,
                response_serializer=lambda m: m.SerializeToString(),
            ),
            "Get": grpc.unary_unary_rpc_method_handler(
                self._get,
                request_deserializer=message_class("GetPodResourcesRequest").FromString,
                response_serializer=lambda m: m.SerializeToString(),
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1.PodResourcesLister", handlers),)
        )
        if server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise RuntimeError(f"cannot bind {self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None

    def __enter__(self) -> KubeletStandIn:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
