"""IPC errors. Three tiers (DESIGN.md): "not now" is a None return (``recv`` on timeout);
a broken caller contract or bad bytes is a ValueError/TypeError subclass; a peer that
is gone or late is an ``IPCError`` naming it (role, rank, pid)."""
from __future__ import annotations


class IPCError(Exception):
    """Base of the peer and channel-state errors."""


class PeerError(IPCError):
    """Carries the identity of the peer process the error is about."""

    def __init__(self, message: str, role: str = "", rank: int = -1, pid: int = 0) -> None:
        super().__init__(message)
        self.role, self.rank, self.pid = role, rank, pid


class ChannelClosed(PeerError):
    """The channel was closed, locally or by the peer (after the consumer drained it);
    a peer's close names the peer (role, rank, pid)."""


class PeerDied(PeerError):
    """The process on the other end of a wait is gone (exited, killed, or a zombie)."""


class PeerTimeout(PeerError, TimeoutError):
    """A wait that must succeed (send into a full ring, a gather) ran out of time."""


class BadMessage(ValueError):
    """Bytes that do not decode to a registered message: unknown type, schema mismatch,
    truncated, trailing bytes, or a corrupt ring frame. The ring stays usable."""


class MessageTooLarge(ValueError):
    """A message larger than the whole ring can ever hold."""
