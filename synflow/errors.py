"""The synflow error hierarchy.

Every error synflow raises on purpose derives from :class:`SynflowError`, so
callers can tell "synflow refused this, with a reason" apart from a bug. The
message of each error says what was wrong, with the offending value, and
where it helps, what to do about it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations


class SynflowError(Exception):
    """Base class of every error synflow raises deliberately."""


class ProtocolError(SynflowError):
    """Something about a replication line or connection broke the protocol."""


class LocalProtocolError(ProtocolError):
    """This process tried to send something the protocol does not allow.

    Nothing was written to the connection.
    """


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow.

    The connection answers with ``ERROR <message>`` and closes.
    """


class ConfigError(SynflowError):
    """A configuration file or value is invalid.

    Attributes:
        path: the file the problem is in, when known.
        key: the dotted key path of the offending value, when known.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        self.path = path
        self.key = key
        self.reason = message
        where = []
        if path:
            where.append(str(path))
        if key:
            where.append(key)
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class StorageError(SynflowError):
    """The database is unusable or inconsistent in a way synflow cannot repair."""


class InconsistentPositionsError(StorageError):
    """Stream positions on disk disagree with the stream's sequence.

    Start-up stops with this error when repairing it automatically could lose
    or duplicate facts; the message says which rows to check and how to fix them.
    """


class SchemaVersionError(StorageError):
    """The database schema is not at the version this code needs."""


class TokenError(SynflowError):
    """A stream token could not be parsed or is out of range."""


class ShardingError(SynflowError):
    """A key was routed to an instance that does not own it, or no instance exists."""


class PersistRefused(SynflowError):
    """The event persister or the room rules refused an event (or a whole batch).

    Domain errors, free of HTTP: the subclass says what kind of refusal it
    is, and the HTTP edge (:mod:`synflow.http.server`) gives each kind its
    status. A persister records an event's refusal in its result; a refusal
    of a whole call is raised.

    Attributes:
        errcode: the Matrix ``errcode`` naming the reason (``M_FORBIDDEN``, ...).
        msg: what was refused and why.
        extra: further fields for the error body (e.g. ``owner``).
    """

    def __init__(self, errcode: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.errcode = errcode
        self.msg = message
        self.extra = extra


class BadEvent(PersistRefused):
    """The event is malformed or out of bounds."""


class Forbidden(PersistRefused):
    """The room rules do not let the sender do this."""


class NotFound(PersistRefused):
    """The event names a room this server does not know."""


class Conflict(PersistRefused):
    """The event clashes with what exists (a room created twice)."""


class WrongPersister(Conflict):
    """The room belongs to another event persister; ``owner`` names it."""

    def __init__(self, room_id: str, owner: str, instance_name: str) -> None:
        super().__init__("M_WRONG_PERSISTER",
                         f"room {room_id} belongs to event persister {owner!r}, not {instance_name!r}", owner=owner)
        self.owner = owner


class RoomMoving(PersistRefused):
    """The room is being handed over to another event persister; the send is retried once it has moved."""


class NotStored(PersistRefused):
    """The event passed the rules but could not be written (a database error)."""


class HttpApiError(SynflowError):
    """An error with an HTTP status and a Matrix-style ``errcode``.

    Raised by request handlers; the HTTP layer turns it into a JSON body
    ``{"errcode": ..., "error": ...}`` with the given status.
    """

    def __init__(self, code: int, errcode: str, message: str, **extra: object):
        super().__init__(message)
        self.code = code
        self.errcode = errcode
        self.msg = message
        self.extra = extra

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {"errcode": self.errcode, "error": self.msg}
        body.update(self.extra)
        return body


class PluginError(ConfigError):
    """A worker type or stream plugin cannot be used: two claim one name, its import fails, or it is malformed."""
