"""Reads and simple writes of users, rooms and events (everything but persisting events).

Users and access tokens are plain rows any process may write (registration
is not a stream). Access tokens are stored as SHA-256 hashes and compared in
constant time. Sync reads events by vector-clock window: for each writer the
rows with a stream ordering in ``(since, upto]``.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred

from synflow.caching import cached
from synflow.json_encoding import json_string
from synflow.storage.engines import Database, Txn


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@attrs.frozen
class Requester:
    """An authenticated client."""

    user_id: str
    device_id: str | None


@attrs.frozen
class SyncEvent:
    """An event as sync hands it to a client.

    ``content_json`` is the content as stored (compact ASCII JSON: persist
    writes it with :func:`~synflow.json_encoding.compact_json`). Sync never
    parses it: :meth:`client_json` splices it into the event's client JSON,
    which is built once per event and kept, since the syncs that share a
    window deliver the same event objects.
    """

    stream_ordering: int
    instance_name: str
    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str
    content_json: str
    origin_server_ts: int
    _client_json: str | None = attrs.field(default=None, init=False, eq=False, repr=False)

    @property
    def content(self) -> dict[str, Any]:
        """The content, parsed."""
        content: dict[str, Any] = json.loads(self.content_json)
        return content

    def to_client(self) -> dict[str, Any]:
        """The event as a client sees it (the value :meth:`client_json` encodes)."""
        event: dict[str, Any] = {
            "event_id": self.event_id, "room_id": self.room_id, "type": self.type, "sender": self.sender,
            "content": self.content, "origin_server_ts": self.origin_server_ts,
        }
        if self.state_key is not None:
            event["state_key"] = self.state_key
        return event

    def client_json(self) -> str:
        """:meth:`to_client` as compact ASCII JSON, the text ``encode_json`` gives for it, without parsing the content."""
        text = self._client_json
        if text is None:
            text = (f'{{"event_id":{json_string(self.event_id)},"room_id":{json_string(self.room_id)},'
                    f'"type":{json_string(self.type)},"sender":{json_string(self.sender)},'
                    f'"content":{self.content_json},"origin_server_ts":{int(self.origin_server_ts)}')
            if self.state_key is not None:
                text += f',"state_key":{json_string(self.state_key)}'
            text += "}"
            object.__setattr__(self, "_client_json", text)
        return text


class DataStore:
    """Users, tokens, rooms and event reads over one database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # -- users ---------------------------------------------------------------------

    def register_user(self, user_id: str, token: str, device_id: str, now_ms: int) -> Deferred[bool]:
        """Create a user with a first access token; False if the user exists."""
        return self.db.run_interaction("register_user", self._register_txn, user_id, hash_token(token), device_id, now_ms)

    @staticmethod
    def _register_txn(txn: Txn, user_id: str, token_hash: str, device_id: str, now_ms: int) -> bool:
        txn.execute("SELECT 1 FROM users WHERE user_id = ?", (user_id,))
        if txn.fetchone() is not None:
            return False
        txn.execute("INSERT INTO users (user_id, created_ts) VALUES (?, ?)", (user_id, now_ms))
        txn.execute(
            "INSERT INTO access_tokens (token_hash, user_id, device_id, created_ts) VALUES (?, ?, ?, ?)",
            (token_hash, user_id, device_id, now_ms),
        )
        return True

    def get_user_by_access_token(self, token: str) -> Deferred[Requester | None]:
        """The user an access token belongs to, or None."""
        return self.get_user_by_token_hash(hash_token(token))

    @cached(name="get_user_by_access_token")
    def get_user_by_token_hash(self, token_hash: str) -> Deferred[Requester | None]:
        return self.db.run_interaction("get_user_by_access_token", self._user_by_token_txn, token_hash,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _user_by_token_txn(txn: Txn, token_hash: str) -> Requester | None:
        txn.execute("SELECT token_hash, user_id, device_id FROM access_tokens WHERE token_hash = ?", (token_hash,))
        row = txn.fetchone()
        if row is None or not hmac.compare_digest(row[0], token_hash):
            return None
        return Requester(row[1], row[2])

    # -- rooms ---------------------------------------------------------------------------

    @cached(name="get_rooms_for_user", user_key=True, tier=True)
    def get_rooms_for_user(self, user_id: str) -> Deferred[list[str]]:
        """Rooms the user is joined to now (sorted)."""
        return self.db.run_interaction("get_rooms_for_user", self._rooms_for_user_txn, user_id,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _rooms_for_user_txn(txn: Txn, user_id: str) -> list[str]:
        txn.execute("SELECT room_id FROM room_memberships WHERE user_id = ? AND membership = 'join'", (user_id,))
        return sorted(r[0] for r in txn.fetchall())

    @cached(name="get_users_in_room", room_key=True, tier=True)
    def get_users_in_room(self, room_id: str) -> Deferred[list[str]]:
        """Users joined to a room now (sorted)."""
        return self.db.run_interaction("get_users_in_room", self._users_in_room_txn, room_id,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _users_in_room_txn(txn: Txn, room_id: str) -> list[str]:
        txn.execute("SELECT user_id FROM room_memberships WHERE room_id = ? AND membership = 'join'", (room_id,))
        return sorted(r[0] for r in txn.fetchall())

    @cached(name="get_current_hosts_in_room", room_key=True, tier=True)
    def get_current_hosts_in_room(self, room_id: str) -> Deferred[list[str]]:
        """Servers with a joined or invited user in a room now (sorted)."""
        return self.db.run_interaction("get_current_hosts_in_room", self._hosts_txn, room_id,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _hosts_txn(txn: Txn, room_id: str) -> list[str]:
        txn.execute(
            "SELECT DISTINCT server_name FROM room_memberships WHERE room_id = ? AND membership IN ('join', 'invite')",
            (room_id,),
        )
        return sorted(r[0] for r in txn.fetchall())

    @cached(name="get_current_state_ids", room_key=True, tier=True)
    def get_current_state_ids(self, room_id: str) -> Deferred[dict[str, dict[str, str]]]:
        """A room's current state now: event type -> state key -> event ID (empty for an unknown room).

        Every state event's write records ``cs_cache_fake [room, ...]`` in its
        transaction, which clears this (room-keyed) cache.
        """
        return self.db.run_interaction("get_current_state_ids", self._current_state_txn, room_id,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _current_state_txn(txn: Txn, room_id: str) -> dict[str, dict[str, str]]:
        txn.execute("SELECT type, state_key, event_id FROM current_state WHERE room_id = ?", (room_id,))
        state: dict[str, dict[str, str]] = {}
        for event_type, state_key, event_id in sorted(txn.fetchall()):
            state.setdefault(event_type, {})[state_key] = event_id
        return state

    def get_membership(self, room_id: str, user_id: str) -> Deferred[str | None]:
        return self.db.run_interaction("get_membership", self._membership_txn, room_id, user_id,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _membership_txn(txn: Txn, room_id: str, user_id: str) -> str | None:
        txn.execute("SELECT membership FROM room_memberships WHERE room_id = ? AND user_id = ?", (room_id, user_id))
        row = txn.fetchone()
        return row[0] if row else None

    def room_exists(self, room_id: str) -> Deferred[bool]:
        return self.db.run_interaction("room_exists", self._room_exists_txn, room_id, read_only=True, idempotent=True)

    @staticmethod
    def _room_exists_txn(txn: Txn, room_id: str) -> bool:
        txn.execute("SELECT 1 FROM rooms WHERE room_id = ?", (room_id,))
        return txn.fetchone() is not None

    # -- events for sync ---------------------------------------------------------------------

    def get_events_in_window(
        self,
        rooms: Sequence[str] | None,
        since: Mapping[str, int],
        since_default: int,
        upto: Mapping[str, int],
        upto_default: int,
        limit: int,
    ) -> Deferred[list[SyncEvent]]:
        """Events of ``rooms`` (of every room if None) after ``since`` and up to ``upto``, oldest first.

        ``since``/``upto`` map writer names to positions; a writer missing
        from them is at the ``*_default`` (the token minimum).
        """
        return self.db.run_interaction(
            "get_events_in_window", self._window_txn, None if rooms is None else list(rooms), dict(since),
            since_default, dict(upto),
            upto_default, limit, one_statement=True, idempotent=True,
        )

    @staticmethod
    def _window_txn(txn: Txn, rooms: list[str] | None, since: dict[str, int], since_default: int,
                    upto: dict[str, int], upto_default: int, limit: int) -> list[SyncEvent]:
        if rooms is not None and not rooms:
            return []
        writers = sorted(set(since) | set(upto))
        clauses = []
        args: list[Any] = []
        for writer in writers:
            lo, hi = since.get(writer, since_default), upto.get(writer, upto_default)
            if hi > lo:
                clauses.append("(instance_name = ? AND stream_ordering > ? AND stream_ordering <= ?)")
                args += [writer, lo, hi]
        if upto_default > since_default:
            marks = ", ".join("?" for _ in writers) or "''"
            clauses.append(f"(instance_name NOT IN ({marks}) AND stream_ordering > ? AND stream_ordering <= ?)")
            args += [*writers, since_default, upto_default]
        if not clauses:
            return []
        in_rooms = "" if rooms is None else f"room_id IN ({', '.join('?' for _ in rooms)}) AND "
        txn.execute(
            "SELECT stream_ordering, instance_name, event_id, room_id, type, state_key, sender, content, "
            f"origin_server_ts FROM events WHERE {in_rooms}({' OR '.join(clauses)}) "
            "ORDER BY stream_ordering LIMIT ?",
            (*(rooms or ()), *args, limit),
        )
        return [
            SyncEvent(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], int(r[8]))
            for r in txn.fetchall()
        ]
