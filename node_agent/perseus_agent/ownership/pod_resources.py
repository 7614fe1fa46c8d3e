"""The kubelet's PodResources v1 API: which devices the kubelet allocated to which container.

The kubelet serves ``v1.PodResourcesLister`` (gRPC) on a Unix socket, by default
:data:`DEFAULT_SOCKET`; dcgm-exporter and Intel's power manager read it the same way. This
module is the agent's only client of it: :class:`PodResourcesClient` calls ``List`` (every
pod of the node) and ``Get`` (one pod; served from Kubernetes 1.27 behind the
``KubeletPodResourcesGet`` gate, beta and on by default from 1.34) and decodes the answers
into :class:`PodDevices`.

Transport and codec. ``grpcio`` carries the calls (HTTP/2 and gRPC framing are not worth
writing by hand). The messages are decoded and encoded here, by a protobuf wire-format codec
of ~80 lines written from the published API definition
(``k8s.io/kubelet/pkg/apis/podresources/v1/api.proto``), rather than with generated code:
the agent reads five fields of four messages, generated code would need ``protoc`` in the
build and the upstream ``.proto`` in the repository, and the decoder skips every field it does
not know (CPU ids, memory, dynamic resources, fields added later), as a protobuf runtime
would. The tests check it against messages built with the official protobuf runtime.

Field numbers used (proto3, package ``v1``)::

    ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
    GetPodResourcesRequest   { string pod_name = 1; string pod_namespace = 2; }
    GetPodResourcesResponse  { PodResources pod_resources = 1; }
    PodResources             { string name = 1; string namespace = 2;
                               repeated ContainerResources containers = 3; }
    ContainerResources       { string name = 1; repeated ContainerDevices devices = 2; ... }
    ContainerDevices         { string resource_name = 1; repeated string device_ids = 2; ... }
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from perseus_agent.errors import AgentError

__all__ = [
    "DEFAULT_SOCKET",
    "ContainerDevices",
    "PodDevices",
    "PodResourcesClient",
    "PodResourcesError",
    "decode_get_response",
    "decode_list_response",
    "encode_get_request",
    "encode_list_response",
    "encode_pod",
]

DEFAULT_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
SERVICE: Final = "v1.PodResourcesLister"
LIST_METHOD: Final = f"/{SERVICE}/List"
GET_METHOD: Final = f"/{SERVICE}/Get"
DEFAULT_TIMEOUT_S: Final = 5.0
"""The kubelet answers from memory; a call this slow means it is in trouble."""
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
"""What the kubelet's own client allows (``podresources.DefaultMaxMsgSize``)."""

MAX_CONTAINERS_PER_POD: Final = 1024
"""Container entries of one pod the decoder takes: a pod has a few (init, sidecar, ephemeral
containers included); more is a broken kubelet, refused rather than decoded."""

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class PodResourcesError(AgentError):
    """The PodResources API cannot be read, or sent something that is not its message."""


@dataclass(frozen=True)
class ContainerDevices:
    """Devices of one resource allocated to one container."""

    resource_name: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class PodDevices:
    """One pod the kubelet runs, with the devices of each of its containers."""

    namespace: str
    name: str
    containers: Mapping[str, tuple[ContainerDevices, ...]] = field(default_factory=dict)

    def device_ids(self, resource: str, container: str | None = None) -> tuple[str, ...]:
        """Ids of ``resource`` allocated to ``container`` (every container: ``None``), in the
        kubelet's order."""
        names = self.containers if container is None else (container,)
        return tuple(
            device_id
            for name in names
            for devices in self.containers.get(name, ())
            if devices.resource_name == resource
            for device_id in devices.device_ids
        )


# -- wire format -------------------------------------------------------------------------------


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise PodResourcesError("truncated varint in a PodResources message")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            raise PodResourcesError("varint longer than 64 bits in a PodResources message")


def _fields(data: bytes) -> Iterator[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` of each field; length-delimited values as bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise PodResourcesError("field number 0 in a PodResources message")
        value: Any
        if wire == _VARINT:
            value, pos = _read_varint(data, pos)
        elif wire == _LEN:
            size, pos = _read_varint(data, pos)
            if pos + size > len(data):
                raise PodResourcesError("truncated field in a PodResources message")
            value, pos = data[pos : pos + size], pos + size
        elif wire in (_I64, _I32):
            width = 8 if wire == _I64 else 4
            if pos + width > len(data):
                raise PodResourcesError("truncated field in a PodResources message")
            value, pos = data[pos : pos + width], pos + width
        else:
            raise PodResourcesError(f"unsupported wire type {wire} in a PodResources message")
        yield number, wire, value


def _text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PodResourcesError(f"a string of a PodResources message is not UTF-8: {exc}") from None


def _strings(data: bytes, wanted: Mapping[int, str]) -> dict[str, list[Any]]:
    """Length-delimited fields of ``data`` by name (``wanted``: number -> name); others skipped."""
    found: dict[str, list[Any]] = {name: [] for name in wanted.values()}
    for number, wire, value in _fields(data):
        name = wanted.get(number)
        if name is not None:
            if wire != _LEN:
                raise PodResourcesError(f"field {name} has wire type {wire}, not length-delimited")
            found[name].append(value)
    return found


def _decode_devices(data: bytes) -> ContainerDevices:
    f = _strings(data, {1: "resource_name", 2: "device_ids"})
    names = f["resource_name"]
    return ContainerDevices(
        resource_name=_text(names[-1]) if names else "",
        device_ids=tuple(_text(v) for v in f["device_ids"]),
    )


def _decode_pod(data: bytes) -> PodDevices:
    f = _strings(data, {1: "name", 2: "namespace", 3: "containers"})
    if len(f["containers"]) > MAX_CONTAINERS_PER_POD:
        raise PodResourcesError(
            f"a pod of the PodResources answer lists {len(f['containers'])} containers, more "
            f"than any pod has ({MAX_CONTAINERS_PER_POD}): not a kubelet's answer"
        )
    # Entries of a repeated container name are merged (a protobuf runtime keeps them all):
    # appended to one list each, so that a broken kubelet's repeats cost linear time.
    merged: dict[str, list[ContainerDevices]] = {}
    for raw in f["containers"]:
        c = _strings(raw, {1: "name", 2: "devices"})
        name = _text(c["name"][-1]) if c["name"] else ""
        merged.setdefault(name, []).extend(map(_decode_devices, c["devices"]))
    return PodDevices(
        namespace=_text(f["namespace"][-1]) if f["namespace"] else "",
        name=_text(f["name"][-1]) if f["name"] else "",
        containers={name: tuple(devices) for name, devices in merged.items()},
    )


def decode_list_response(data: bytes) -> list[PodDevices]:
    """A ``ListPodResourcesResponse``."""
    return [_decode_pod(raw) for raw in _strings(data, {1: "pods"})["pods"]]


def decode_get_response(data: bytes) -> PodDevices | None:
    """A ``GetPodResourcesResponse`` (``None`` without its pod)."""
    pods = _strings(data, {1: "pod"})["pod"]
    return _decode_pod(pods[-1]) if pods else None


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


def _str_field(number: int, text: str) -> bytes:
    # proto3 leaves empty strings out, as the kubelet's encoder does.
    return _len_field(number, text.encode("utf-8")) if text else b""


def encode_get_request(namespace: str, name: str) -> bytes:
    """A ``GetPodResourcesRequest``."""
    return _str_field(1, name) + _str_field(2, namespace)


def encode_pod(pod: PodDevices) -> bytes:
    """A ``PodResources`` message (what a kubelet stand-in sends)."""
    containers = b""
    for name, devices in pod.containers.items():
        body = _str_field(1, name)
        for d in devices:
            entry = _str_field(1, d.resource_name) + b"".join(
                _len_field(2, i.encode("utf-8")) for i in d.device_ids
            )
            body += _len_field(2, entry)
        containers += _len_field(3, body)
    return _str_field(1, pod.name) + _str_field(2, pod.namespace) + containers


def encode_list_response(pods: Sequence[PodDevices]) -> bytes:
    """A ``ListPodResourcesResponse``."""
    return b"".join(_len_field(1, encode_pod(p)) for p in pods)


# -- client ------------------------------------------------------------------------------------


def _identity(data: bytes) -> bytes:
    return data


class PodResourcesClient:
    """Calls the kubelet's PodResources API on the Unix socket ``socket_path``.

    A channel is opened at the first call and kept; each call has ``timeout_s``. Not
    thread-safe for :meth:`close`; calls may run concurrently.

    Raises (from every call):
        PodResourcesError: The socket cannot be reached or the answer is not the API's.
    """

    def __init__(self, socket_path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: Any = None
        self._get_served = True

    def _call(self, method: str, request: bytes) -> bytes:
        import grpc  # the agent extra; imported on use, so that the operator never needs it

        if self._channel is None:
            self._channel = grpc.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
            )
        stub = self._channel.unary_unary(
            method, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            response: bytes = stub(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            # A channel that failed to connect waits out a reconnect backoff: a kubelet that
            # comes up (or restarts) is reached at the next call through a new channel.
            self.close()
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            name = getattr(code, "name", "UNKNOWN")
            raise PodResourcesError(
                f"kubelet PodResources {method.rsplit('/', 1)[-1]} on {self.socket_path}: "
                f"{name}: {details}"
            ) from None
        return response

    def list(self) -> list[PodDevices]:
        """Every pod the kubelet runs, with its containers' devices."""
        return decode_list_response(self._call(LIST_METHOD, b""))

    def get(self, namespace: str, name: str) -> PodDevices | None:
        """One pod's devices; ``None`` when the kubelet does not run it. Falls back to ``List``
        where ``Get`` is not served (the kubelet answers an error, not UNIMPLEMENTED, when its
        feature gate is off; after one such answer only ``List`` is used)."""
        if self._get_served:
            try:
                pod = decode_get_response(
                    self._call(GET_METHOD, encode_get_request(namespace, name))
                )
            except PodResourcesError:
                # Unknown pod and disabled method both come back as errors: List tells which.
                pods = self.list()
                found = _find(pods, namespace, name)
                if found is not None:
                    self._get_served = False
                return found
            if pod is not None and (pod.namespace, pod.name) == (namespace, name):
                return pod
            return None
        return _find(self.list(), namespace, name)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _find(pods: Sequence[PodDevices], namespace: str, name: str) -> PodDevices | None:
    return next((p for p in pods if (p.namespace, p.name) == (namespace, name)), None)
