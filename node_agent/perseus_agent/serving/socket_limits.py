"""Who makes room when a connection arrives at the agent's socket (see
:mod:`perseus_agent.serving.local_server`): a pure policy, so it can be read and tested on its own.

No connection holds a slot for free. A newcomer is admitted whenever possible, because the
newest connection is the one most likely to be a real training process that is about to say
hello; older connections that have not said hello, or have been idle longest, make room:

1. a peer with ``max_pending_per_peer`` connections without hello loses its oldest such one;
2. with ``max_pending`` connections without hello in all, the oldest of them goes;
3. a peer with ``max_connections_per_peer`` connections loses its oldest one without hello, or
   else its newcomer is refused (that peer is over its own budget, nobody else pays);
4. with ``max_connections`` in all, the oldest connection without hello goes, or else the
   longest-idle connection of the peer holding the most, if that peer holds more than the
   newcomer's would; or else the newcomer is refused.

A peer outside the agent's PID namespace (no ``hostPID``) shows as pid 0: all such peers of one
uid then count as one peer, and only the hello timeout and the all-peer caps tell them apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_PEER",
    "DEFAULT_MAX_PENDING",
    "DEFAULT_MAX_PENDING_PER_PEER",
    "Limits",
    "Slot",
    "make_room",
]

DEFAULT_MAX_CONNECTIONS: Final = 256
DEFAULT_MAX_PENDING: Final = 64
"""Connections that have not said hello yet, all peers together."""
DEFAULT_MAX_PENDING_PER_PEER: Final = 16
"""Room for every rank of a pod connecting at once (the pods of one uid are one peer to an
agent without ``hostPID``)."""
DEFAULT_MAX_CONNECTIONS_PER_PEER: Final = 64
"""A training process needs one connection (per rank it drives)."""


class Slot(Protocol):
    """What the policy reads of a connection."""

    @property
    def pending(self) -> bool:
        """No hello accepted yet."""

    @property
    def peer(self) -> Hashable:
        """Whose it is (the same value for all connections of one peer process)."""

    @property
    def last_request_ns(self) -> int:
        """``time.monotonic_ns()`` of its last request (of its accept before one)."""


S = TypeVar("S", bound=Slot)


@dataclass(frozen=True)
class Limits:
    max_connections: int
    max_pending: int
    max_pending_per_peer: int
    max_connections_per_peer: int

    def __post_init__(self) -> None:
        for name in (
            "max_connections",
            "max_pending",
            "max_pending_per_peer",
            "max_connections_per_peer",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")


def make_room(live: Sequence[S], peer: Hashable, limits: Limits) -> tuple[list[S], str | None]:
    """The connections to close so that a newcomer of ``peer`` fits among ``live`` (oldest
    first), or why the newcomer is refused (then nothing is to be closed)."""
    left = list(live)
    victims: list[S] = []

    def evict_oldest_pending(of: Hashable | None = None) -> bool:
        for slot in left:
            if slot.pending and (of is None or slot.peer == of):
                victims.append(slot)
                left.remove(slot)
                return True
        return False

    if sum(s.pending and s.peer == peer for s in left) >= limits.max_pending_per_peer:
        evict_oldest_pending(peer)
    if sum(s.pending for s in left) >= limits.max_pending:
        evict_oldest_pending()
    own = sum(s.peer == peer for s in left)
    if own >= limits.max_connections_per_peer and not evict_oldest_pending(peer):
        return [], "too many connections from this process"
    if len(left) >= limits.max_connections and not evict_oldest_pending():
        counts = Counter(s.peer for s in left)
        heaviest, held = counts.most_common(1)[0]
        if held <= counts.get(peer, 0) + 1:
            return [], "too many connections"
        victims.append(
            min((s for s in left if s.peer == heaviest), key=lambda s: s.last_request_ns)
        )
    return victims, None
