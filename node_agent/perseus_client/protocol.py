"""Wire protocol between a training process and the Perseus node agent.

Transport: a stream socket, Unix or TCP (:mod:`perseus_client.transport` says which).
Each message is one line of UTF-8 JSON ending in ``\\n``, at most
:data:`MAX_MESSAGE_BYTES` bytes including the newline. The client sends one request and
waits for its one reply before sending the next.

Requests (``op`` selects the kind)::

    {"op": "hello", "version": 2, "rank": 0, "local_rank": 0, "gpu_uuids": ["GPU-..."],
     "pid": 42, "job": "llm", "namespace": "team-a", "pod": "llm-worker-0"}
    {"op": "step_begin", "step": 7, "t_ns": 81234567890123}
    {"op": "step_end", "step": 7}
    {"op": "instruction_begin", "name": "forward", "microbatch": 3, "chunk": 1}
    {"op": "instruction_end", "name": "forward", "chunk": 1}

``t_ns`` (optional, on the four event requests) is the client's ``time.monotonic_ns()`` when
the event happened, after any GPU synchronization: the node's monotonic clock, which the
agent shares, so profiling times the event itself rather than its receipt, a fraction of a
millisecond to a few milliseconds later on a busy node (see the agent's ``local_server``).

Versions. ``hello`` must be the first request of a connection and names the version the
rest of the connection speaks; the agent accepts every version in
:data:`SUPPORTED_VERSIONS` and replies with it (``"version"``).

* Version 1: instruction ``name`` is ``forward`` or ``backward``; there is no ``chunk``.
  A version-1 connection that sends ``chunk`` (other than ``null``) or another name gets an
  error reply saying that it needs version 2.
* Version 2 adds, for interleaved and zero-bubble pipeline schedules, the names
  ``backward_input`` and ``backward_weight`` (the two halves of a backward that zero-bubble
  schedules run apart; ``backward`` stays the whole one) and the optional ``chunk`` on
  ``instruction_begin`` and ``instruction_end``: the rank-local virtual stage (model chunk)
  ``0..V-1`` the computation belongs to. With Megatron-LM's layout (torch's too), model
  stage ``v * P + p`` of a ``P``-GPU pipeline runs on GPU ``p`` as its chunk ``v``.
  ``chunk`` absent or ``null`` means the rank runs one chunk (or does not say which).

A client of version 2 whose hello an older agent refuses ("unsupported protocol version")
may say hello again with version 1 on the same connection when it needs neither chunks nor
split backwards (``perseus_client`` does, unless its schedule needs them: then it reports the
agent as unavailable, saying it must be upgraded).

``rank``, ``local_rank``, ``job``, ``namespace``, ``pod``, ``microbatch`` and ``chunk`` may
be ``null`` (or absent). Integers are in ``[0, 2**63)``; ``true``/``false`` are not integers.
Unknown keys are dropped (a peer of the same version never sends any).

Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": "why"}``. The reply to
``instruction_begin`` carries ``"sm_clock_mhz"``: the SM clock now in effect on
the caller's GPU, or ``null`` when the agent does not control it.

This module is standard library only: it is imported inside training processes.
Both sides use the same encoders and decoders, so they agree on what is valid.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal, NotRequired, TypeAlias, TypedDict, cast

PROTOCOL_VERSION: Final = 2
"""The newest version, the one a client says hello with first."""
SUPPORTED_VERSIONS: Final = (1, 2)
"""Versions the agent accepts (see the module docstring)."""
UNSUPPORTED_VERSION_ERROR: Final = "unsupported protocol version"
"""How a refused hello's error begins (older agents too): the cue to try an older version."""
MAX_MESSAGE_BYTES: Final = 4096
"""Largest message, newline included. Longer lines are a protocol error."""

SOCKET_ENV: Final = "PERSEUS_AGENT_SOCKET"
DEFAULT_SOCKET_PATH: Final = "/run/perseus/agent.sock"

OP_HELLO: Final = "hello"
OP_STEP_BEGIN: Final = "step_begin"
OP_STEP_END: Final = "step_end"
OP_INSTRUCTION_BEGIN: Final = "instruction_begin"
OP_INSTRUCTION_END: Final = "instruction_end"
OPS: Final = frozenset(
    {OP_HELLO, OP_STEP_BEGIN, OP_STEP_END, OP_INSTRUCTION_BEGIN, OP_INSTRUCTION_END}
)

InstructionName: TypeAlias = Literal["forward", "backward", "backward_input", "backward_weight"]
V1_INSTRUCTION_NAMES: Final = frozenset({"forward", "backward"})
SPLIT_BACKWARD_NAMES: Final = frozenset({"backward_input", "backward_weight"})
INSTRUCTION_NAMES: Final = V1_INSTRUCTION_NAMES | SPLIT_BACKWARD_NAMES
"""Every version's names (version 1: :data:`V1_INSTRUCTION_NAMES` only)."""

_MAX_INT: Final = 2**63 - 1
_MAX_ERROR_CHARS: Final = 1024


class HelloRequest(TypedDict):
    op: Literal["hello"]
    version: int
    rank: int | None
    local_rank: int | None
    gpu_uuids: list[str]
    pid: int
    job: str | None
    namespace: str | None
    pod: str | None


class StepBeginRequest(TypedDict):
    op: Literal["step_begin"]
    step: int
    t_ns: NotRequired[int]


class StepEndRequest(TypedDict):
    op: Literal["step_end"]
    step: int
    t_ns: NotRequired[int]


class InstructionBeginRequest(TypedDict):
    op: Literal["instruction_begin"]
    name: InstructionName
    microbatch: int | None
    chunk: NotRequired[int]
    """Version 2: the rank-local virtual stage; absent when not given."""
    t_ns: NotRequired[int]


class InstructionEndRequest(TypedDict):
    op: Literal["instruction_end"]
    name: InstructionName
    chunk: NotRequired[int]
    t_ns: NotRequired[int]


Request: TypeAlias = (
    HelloRequest
    | StepBeginRequest
    | StepEndRequest
    | InstructionBeginRequest
    | InstructionEndRequest
)
Reply: TypeAlias = dict[str, Any]


class ProtocolError(ValueError):
    """A message is not valid under this protocol (syntax, type, size or version)."""


# ---------------------------------------------------------------------------
# Request builders (validated: they raise ProtocolError on bad arguments)


def hello_request(
    *,
    rank: int | None,
    local_rank: int | None,
    gpu_uuids: list[str],
    pid: int,
    job: str | None,
    namespace: str | None,
    pod: str | None,
    version: int = PROTOCOL_VERSION,
) -> HelloRequest:
    return cast(
        HelloRequest,
        validate_request(
            {
                "op": OP_HELLO,
                "version": version,
                "rank": rank,
                "local_rank": local_rank,
                "gpu_uuids": list(gpu_uuids),
                "pid": pid,
                "job": job,
                "namespace": namespace,
                "pod": pod,
            }
        ),
    )


def step_begin_request(step: int) -> StepBeginRequest:
    return cast(StepBeginRequest, validate_request({"op": OP_STEP_BEGIN, "step": step}))


def step_end_request(step: int) -> StepEndRequest:
    return cast(StepEndRequest, validate_request({"op": OP_STEP_END, "step": step}))


def instruction_begin_request(
    name: str,
    microbatch: int | None = None,
    chunk: int | None = None,
    *,
    version: int = PROTOCOL_VERSION,
) -> InstructionBeginRequest:
    """For a connection of ``version``; a version-1 one leaves out chunk 0 (its only one)."""
    msg = {"op": OP_INSTRUCTION_BEGIN, "name": name, "microbatch": microbatch}
    if chunk is not None and not (version == 1 and chunk == 0):
        msg["chunk"] = chunk
    return cast(InstructionBeginRequest, validate_request(msg, version))


def instruction_end_request(
    name: str, chunk: int | None = None, *, version: int = PROTOCOL_VERSION
) -> InstructionEndRequest:
    msg: dict[str, Any] = {"op": OP_INSTRUCTION_END, "name": name}
    if chunk is not None and not (version == 1 and chunk == 0):
        msg["chunk"] = chunk
    return cast(InstructionEndRequest, validate_request(msg, version))


def error_reply(message: str) -> Reply:
    """``{"ok": false, "error": message}``, the message cut short enough to always encode."""
    if len(message) > _MAX_ERROR_CHARS:
        message = message[: _MAX_ERROR_CHARS - 3] + "..."
    return {"ok": False, "error": message}


# ---------------------------------------------------------------------------
# Validation


def _int(msg: Mapping[str, Any], key: str, *, nullable: bool = False) -> int | None:
    """An integer field in [0, 2**63); a nullable one may be absent (read as null)."""
    if key not in msg and not nullable:
        raise ProtocolError(f"missing field {key!r}")
    value = msg.get(key)
    if value is None and nullable:
        return None
    # bool is an int subclass; true/false is never a valid number here.
    if not isinstance(value, int) or isinstance(value, bool):
        kind = "an integer or null" if nullable else "an integer"
        raise ProtocolError(f"field {key!r} must be {kind}, got {_describe(value)}")
    if not 0 <= value <= _MAX_INT:
        raise ProtocolError(f"field {key!r} out of range: {value}")
    return value


def _str(msg: Mapping[str, Any], key: str) -> str | None:
    """A string-or-null field; absent reads as null."""
    value = msg.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ProtocolError(f"field {key!r} must be a string or null, got {_describe(value)}")


def _name(msg: Mapping[str, Any], version: int) -> InstructionName:
    if "name" not in msg:
        raise ProtocolError("missing field 'name'")
    name = msg["name"]
    if version == 1 and name in SPLIT_BACKWARD_NAMES:
        raise ProtocolError(
            f"instruction {name!r} needs protocol version 2; this connection said hello with "
            "version 1 (upgrade perseus_client)"
        )
    allowed_names = V1_INSTRUCTION_NAMES if version == 1 else INSTRUCTION_NAMES
    if name not in allowed_names:
        allowed = ", ".join(sorted(allowed_names))
        raise ProtocolError(f"field 'name' must be one of {allowed}, got {_describe(name)}")
    return cast(InstructionName, name)


def _chunk(msg: Mapping[str, Any], event: dict[str, Any], version: int) -> None:
    """Copy a given ``chunk`` into ``event``; version 1 has none."""
    chunk = _int(msg, "chunk", nullable=True)
    if chunk is None:
        return
    if version == 1:
        raise ProtocolError(
            "field 'chunk' needs protocol version 2; this connection said hello with version 1 "
            "(upgrade perseus_client)"
        )
    event["chunk"] = chunk


def _describe(value: object) -> str:
    text = (
        json.dumps(value) if isinstance(value, str | int | float | bool) else type(value).__name__
    )
    return text if len(text) <= 40 else text[:37] + "..."


def validate_request(obj: object, version: int = PROTOCOL_VERSION) -> Request:
    """A validated copy of a decoded request, keeping only the fields of its op.

    ``version`` is the connection's (its hello's); a hello itself may name any of
    :data:`SUPPORTED_VERSIONS`.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(f"a request must be a JSON object, got {_describe(obj)}")
    op = obj.get("op")
    if not isinstance(op, str):
        raise ProtocolError("missing or non-string field 'op'")
    if op == OP_HELLO:
        # The version first: a peer of another version may send other fields.
        said = obj.get("version")
        if not isinstance(said, int) or isinstance(said, bool) or said not in SUPPORTED_VERSIONS:
            spoken = ", ".join(map(str, SUPPORTED_VERSIONS))
            raise ProtocolError(
                f"{UNSUPPORTED_VERSION_ERROR} {_describe(said)}: this side speaks versions {spoken}"
            )
        uuids = obj.get("gpu_uuids")
        if not isinstance(uuids, list) or not all(isinstance(u, str) for u in uuids):
            raise ProtocolError("field 'gpu_uuids' must be a list of strings")
        pid = _int(obj, "pid")
        assert pid is not None
        return {
            "op": OP_HELLO,
            "version": said,
            "rank": _int(obj, "rank", nullable=True),
            "local_rank": _int(obj, "local_rank", nullable=True),
            "gpu_uuids": list(uuids),
            "pid": pid,
            "job": _str(obj, "job"),
            "namespace": _str(obj, "namespace"),
            "pod": _str(obj, "pod"),
        }
    event: dict[str, Any]
    if op in (OP_STEP_BEGIN, OP_STEP_END):
        step = _int(obj, "step")
        assert step is not None
        event = {"op": op, "step": step}
    elif op == OP_INSTRUCTION_BEGIN:
        event = {
            "op": OP_INSTRUCTION_BEGIN,
            "name": _name(obj, version),
            "microbatch": _int(obj, "microbatch", nullable=True),
        }
        _chunk(obj, event, version)
    elif op == OP_INSTRUCTION_END:
        event = {"op": OP_INSTRUCTION_END, "name": _name(obj, version)}
        _chunk(obj, event, version)
    else:
        raise ProtocolError(f"unknown op {_describe(op)}")
    t_ns = _int(obj, "t_ns", nullable=True)
    if t_ns is not None:
        event["t_ns"] = t_ns
    return cast(Request, event)


def validate_reply(obj: object, op: str | None = None) -> Reply:
    """Check a decoded reply (to a request of ``op``, when given) and return it."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a reply must be a JSON object, got {_describe(obj)}")
    ok = obj.get("ok")
    if not isinstance(ok, bool):
        raise ProtocolError("reply field 'ok' must be true or false")
    if not ok:
        if not isinstance(obj.get("error"), str):
            raise ProtocolError("an error reply must carry a string field 'error'")
        return obj
    if op == OP_INSTRUCTION_BEGIN:
        _int(obj, "sm_clock_mhz", nullable=True)
    return obj


# ---------------------------------------------------------------------------
# Encoding


def _encode(obj: Mapping[str, Any]) -> bytes:
    try:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"message is not JSON-serializable: {exc}") from None
    data = text.encode() + b"\n"
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES} bytes")
    return data


def _decode(line: bytes) -> object:
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(line)} bytes exceeds {MAX_MESSAGE_BYTES} bytes")
    body = line[:-1] if line.endswith(b"\n") else line
    if b"\n" in body:
        raise ProtocolError("more than one message in a line")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ProtocolError(f"invalid JSON: {exc}") from None


def encode_request(msg: Mapping[str, Any], version: int = PROTOCOL_VERSION) -> bytes:
    """Validate a request (of a connection of ``version``) and return its line, newline
    included."""
    return _encode(validate_request(dict(msg), version))


def decode_request(line: bytes, version: int = PROTOCOL_VERSION) -> Request:
    """Parse and validate one request line (trailing newline optional) of a connection of
    ``version``."""
    return validate_request(_decode(line), version)


def encode_reply(reply: Mapping[str, Any], op: str | None = None) -> bytes:
    """Validate a reply (to a request of ``op``, when given) and return its line."""
    return _encode(validate_reply(dict(reply), op))


def decode_reply(line: bytes, op: str | None = None) -> Reply:
    """Parse and validate one reply line (to a request of ``op``, when given)."""
    return validate_reply(_decode(line), op)
