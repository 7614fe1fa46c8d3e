"""Wire protocol between a training process and the Perseus node agent.

Transport: a Unix stream socket. Each message is one line of UTF-8 JSON ending
in ``\\n``, at most :data:`MAX_MESSAGE_BYTES` bytes including the newline. The
client sends one request and waits for its one reply before sending the next.

Requests (``op`` selects the kind)::

    {"op": "hello", "version": 1, "rank": 0, "local_rank": 0, "gpu_uuids": ["GPU-..."],
     "pid": 42, "job": "llm", "namespace": "team-a", "pod": "llm-worker-0"}
    {"op": "step_begin", "step": 7, "t_ns": 81234567890123}
    {"op": "step_end", "step": 7}
    {"op": "instruction_begin", "name": "forward", "microbatch": 3}
    {"op": "instruction_end", "name": "forward"}

``t_ns`` (optional, on the four event requests) is the client's ``time.monotonic_ns()`` when
the event happened, after any GPU synchronization: the node's monotonic clock, which the
agent shares, so profiling times the event itself rather than its receipt, a fraction of a
millisecond to a few milliseconds later on a busy node (see the agent's ``local_server``).

``hello`` must be the first request of a connection; the agent rejects a
``version`` other than :data:`PROTOCOL_VERSION`. ``rank``, ``local_rank``,
``job``, ``namespace``, ``pod`` and ``microbatch`` may be ``null`` (or absent).
Integers are in ``[0, 2**63)``; ``true``/``false`` are not integers. Unknown keys
are dropped (a peer of the same version never sends any).

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

PROTOCOL_VERSION: Final = 1
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

InstructionName: TypeAlias = Literal["forward", "backward"]
INSTRUCTION_NAMES: Final = frozenset({"forward", "backward"})

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
    t_ns: NotRequired[int]


class InstructionEndRequest(TypedDict):
    op: Literal["instruction_end"]
    name: InstructionName
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
) -> HelloRequest:
    return cast(
        HelloRequest,
        validate_request(
            {
                "op": OP_HELLO,
                "version": PROTOCOL_VERSION,
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


def instruction_begin_request(name: str, microbatch: int | None = None) -> InstructionBeginRequest:
    msg = {"op": OP_INSTRUCTION_BEGIN, "name": name, "microbatch": microbatch}
    return cast(InstructionBeginRequest, validate_request(msg))


def instruction_end_request(name: str) -> InstructionEndRequest:
    return cast(InstructionEndRequest, validate_request({"op": OP_INSTRUCTION_END, "name": name}))


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


def _name(msg: Mapping[str, Any]) -> InstructionName:
    if "name" not in msg:
        raise ProtocolError("missing field 'name'")
    name = msg["name"]
    if name not in INSTRUCTION_NAMES:
        allowed = ", ".join(sorted(INSTRUCTION_NAMES))
        raise ProtocolError(f"field 'name' must be one of {allowed}, got {_describe(name)}")
    return cast(InstructionName, name)


def _describe(value: object) -> str:
    text = (
        json.dumps(value) if isinstance(value, str | int | float | bool) else type(value).__name__
    )
    return text if len(text) <= 40 else text[:37] + "..."


def validate_request(obj: object) -> Request:
    """A validated copy of a decoded request, keeping only the fields of its op."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a request must be a JSON object, got {_describe(obj)}")
    op = obj.get("op")
    if not isinstance(op, str):
        raise ProtocolError("missing or non-string field 'op'")
    if op == OP_HELLO:
        # The version first: a peer of another version may send other fields.
        version = obj.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"unsupported protocol version {_describe(version)}: "
                f"this side speaks version {PROTOCOL_VERSION}"
            )
        uuids = obj.get("gpu_uuids")
        if not isinstance(uuids, list) or not all(isinstance(u, str) for u in uuids):
            raise ProtocolError("field 'gpu_uuids' must be a list of strings")
        pid = _int(obj, "pid")
        assert pid is not None
        return {
            "op": OP_HELLO,
            "version": PROTOCOL_VERSION,
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
            "name": _name(obj),
            "microbatch": _int(obj, "microbatch", nullable=True),
        }
    elif op == OP_INSTRUCTION_END:
        event = {"op": OP_INSTRUCTION_END, "name": _name(obj)}
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


def encode_request(msg: Mapping[str, Any]) -> bytes:
    """Validate a request and return its line, newline included."""
    return _encode(validate_request(dict(msg)))


def decode_request(line: bytes) -> Request:
    """Parse and validate one request line (trailing newline optional)."""
    return validate_request(_decode(line))


def encode_reply(reply: Mapping[str, Any], op: str | None = None) -> bytes:
    """Validate a reply (to a request of ``op``, when given) and return its line."""
    return _encode(validate_reply(dict(reply), op))


def decode_reply(line: bytes, op: str | None = None) -> Reply:
    """Parse and validate one reply line (to a request of ``op``, when given)."""
    return validate_reply(_decode(line), op)
