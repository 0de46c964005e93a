"""SQL implementations of the federation stores.

* :class:`SqlDestinationStore` -- retry state and "how far each destination
  has got" (a vector-clock token) in ``destinations``; catch-up reads every
  owed event from ``events`` (local events list their destinations, a JSON
  array matched with ``json_each`` on SQLite and ``@>`` on PostgreSQL), or
  each room's latest from ``destination_rooms``, joined to ``instance_map``.
* :class:`SqlDedupeStore` -- inbound transactions already answered, in
  ``received_transactions``, deleted after :data:`RECEIVED_TRANSACTIONS_KEEP_S`.

"Covered by a token" is evaluated in SQL with a ``CASE`` over the token's
listed instance IDs, falling back to its minimum for the others.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from synflow.federation.interfaces import DestinationRecord, Pdu
from synflow.federation.policy import RetryState
from synflow.storage.engines import Database, Txn
from synflow.tokens import StreamToken

logger = logging.getLogger(__name__)


def _position_sql(token: StreamToken, column: str) -> tuple[str, list[Any]]:
    """SQL for the token's position of the writer whose instance ID is in ``column``."""
    if not token.positions:
        return "?", [token.minimum]
    parts = " ".join("WHEN ? THEN ?" for _ in token.positions)
    args: list[Any] = [v for pair in token.positions for v in pair]
    return f"(CASE {column} {parts} ELSE ? END)", [*args, token.minimum]


def event_to_pdu(row: tuple[Any, ...]) -> Pdu:
    """Build a PDU from (room, stream_ordering, instance_id, event_id, type, state_key, sender, content,
    origin_server_ts, origin, prev_event_id, depth)."""
    room_id, so, iid, event_id, etype, state_key, sender, content, ts, origin, prev, depth = row
    body: dict[str, Any] = {
        "event_id": event_id, "room_id": room_id, "type": etype, "sender": sender,
        "content": json.loads(content), "origin_server_ts": int(ts), "origin": origin,
        "prev_events": [prev] if prev else [], "depth": int(depth),
    }
    if state_key is not None:
        body["state_key"] = state_key
    return Pdu(event_id, room_id, int(iid), int(so), body)


PDU_COLUMNS = (
    "e.room_id, e.stream_ordering, im.instance_id, e.event_id, e.type, e.state_key, e.sender, e.content, "
    "e.origin_server_ts, e.origin, e.prev_event_id, e.depth"
)


def _destination_listed_sql(engine: str) -> str:
    """SQL true when the JSON list in ``e.destinations`` holds the bound destination."""
    if engine == "postgres":
        return "e.destinations::jsonb @> jsonb_build_array(CAST(? AS TEXT))"
    return "EXISTS (SELECT 1 FROM json_each(e.destinations) d WHERE d.value = ?)"


def _owed_events_sql(txn: Txn, destination: str, after: StreamToken,
                     upto: StreamToken) -> tuple[str, list[Any]]:
    """``JOIN ... WHERE ...`` of the local events ``destination`` needs in ``(after, upto]``.

    Local events are those with recorded destinations (only events created
    here have them). The plain ``stream_ordering > floor`` bound (``after``'s minimum,
    below every writer's position) lets the primary key narrow the scan.
    """
    lo, lo_args = _position_sql(after, "im.instance_id")
    hi, hi_args = _position_sql(upto, "im.instance_id")
    listed = _destination_listed_sql(txn.engine.name)
    where = (
        "JOIN instance_map im ON im.instance_name = e.instance_name "
        f"WHERE e.stream_ordering > ? AND e.destinations IS NOT NULL AND {listed} "
        f"AND e.stream_ordering > {lo} AND e.stream_ordering <= {hi}"
    )
    return where, [after.minimum, destination, *lo_args, *hi_args]


class SqlDestinationStore:
    """Destination retry state and catch-up bookkeeping."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def get_destination(self, destination: str) -> Deferred[DestinationRecord | None]:
        return self.db.run_interaction("get_destination", self._get_txn, destination, read_only=True, idempotent=True)

    @staticmethod
    def _get_txn(txn: Txn, destination: str) -> DestinationRecord | None:
        txn.execute(
            "SELECT retry_last_ts, retry_interval, failure_ts, last_successful_token FROM destinations "
            "WHERE destination = ?", (destination,),
        )
        row = txn.fetchone()
        if row is None:
            return None
        retry = RetryState(int(row[0] or 0), int(row[1] or 0), None if row[2] is None else int(row[2]))
        token = StreamToken.parse(row[3]) if row[3] else None
        return DestinationRecord(destination, retry, token)

    def set_retry(self, destination: str, retry: RetryState) -> Deferred[None]:
        return self.db.run_interaction("set_destination_retry", self._set_retry_txn, destination, retry, idempotent=True)

    @staticmethod
    def _set_retry_txn(txn: Txn, destination: str, retry: RetryState) -> None:
        txn.execute(
            "INSERT INTO destinations (destination, retry_last_ts, retry_interval, failure_ts) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (destination) DO UPDATE SET retry_last_ts = excluded.retry_last_ts, "
            "retry_interval = excluded.retry_interval, failure_ts = excluded.failure_ts",
            (destination, retry.retry_last_ts, retry.retry_interval, retry.failure_ts),
        )

    def set_last_successful(self, destination: str, token: StreamToken) -> Deferred[None]:
        return self.db.run_interaction("set_last_successful", self._set_last_txn, destination, str(token), idempotent=True)

    @staticmethod
    def _set_last_txn(txn: Txn, destination: str, token: str) -> None:
        txn.execute(
            "INSERT INTO destinations (destination, last_successful_token) VALUES (?, ?) "
            "ON CONFLICT (destination) DO UPDATE SET last_successful_token = excluded.last_successful_token",
            (destination, token),
        )

    def get_catch_up_pdus(self, destination: str, after: StreamToken, upto: StreamToken,
                          limit: int) -> Deferred[list[Pdu]]:
        return self.db.run_interaction("get_catch_up_pdus", self._catch_up_txn, destination, after, upto, limit,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _catch_up_txn(txn: Txn, destination: str, after: StreamToken, upto: StreamToken, limit: int) -> list[Pdu]:
        lo, lo_args = _position_sql(after, "im.instance_id")
        hi, hi_args = _position_sql(upto, "im.instance_id")
        txn.execute(
            f"SELECT {PDU_COLUMNS} FROM destination_rooms dr "
            "JOIN instance_map im ON im.instance_name = dr.instance_name "
            "JOIN events e ON e.stream_ordering = dr.stream_ordering "
            f"WHERE dr.destination = ? AND dr.stream_ordering > {lo} AND dr.stream_ordering <= {hi} "
            "ORDER BY dr.stream_ordering, im.instance_id LIMIT ?",
            (destination, *lo_args, *hi_args, limit),
        )
        return [event_to_pdu(tuple(r)) for r in txn.fetchall()]

    def count_catch_up_events(self, destination: str, after: StreamToken, upto: StreamToken,
                              limit: int) -> Deferred[int]:
        return self.db.run_interaction("count_catch_up_events", self._count_events_txn, destination, after, upto,
                                       limit, read_only=True, idempotent=True)

    @staticmethod
    def _count_events_txn(txn: Txn, destination: str, after: StreamToken, upto: StreamToken, limit: int) -> int:
        where, args = _owed_events_sql(txn, destination, after, upto)
        txn.execute(f"SELECT COUNT(*) FROM (SELECT 1 FROM events e {where} LIMIT ?) owed", (*args, limit))
        row = txn.fetchone()
        return int(row[0]) if row else 0

    def get_catch_up_events(self, destination: str, after: StreamToken, upto: StreamToken,
                            limit: int) -> Deferred[list[Pdu]]:
        return self.db.run_interaction("get_catch_up_events", self._catch_up_events_txn, destination, after, upto,
                                       limit, read_only=True, idempotent=True)

    @staticmethod
    def _catch_up_events_txn(txn: Txn, destination: str, after: StreamToken, upto: StreamToken,
                             limit: int) -> list[Pdu]:
        where, args = _owed_events_sql(txn, destination, after, upto)
        txn.execute(
            f"SELECT {PDU_COLUMNS} FROM events e {where} ORDER BY e.stream_ordering, im.instance_id LIMIT ?",
            (*args, limit),
        )
        return [event_to_pdu(tuple(r)) for r in txn.fetchall()]

    def outstanding_destinations(self, upto: StreamToken) -> Deferred[list[str]]:
        return self.db.run_interaction("outstanding_destinations", self._outstanding_txn, upto,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _outstanding_txn(txn: Txn, upto: StreamToken) -> list[str]:
        txn.execute(
            "SELECT DISTINCT dr.destination, d.last_successful_token FROM destination_rooms dr "
            "LEFT JOIN destinations d ON d.destination = dr.destination"
        )
        candidates = txn.fetchall()
        out = []
        hi, hi_args = _position_sql(upto, "im.instance_id")
        for destination, token_text in candidates:
            after = StreamToken.parse(token_text) if token_text else StreamToken.at(0)
            lo, lo_args = _position_sql(after, "im.instance_id")
            txn.execute(
                "SELECT 1 FROM destination_rooms dr JOIN instance_map im ON im.instance_name = dr.instance_name "
                f"WHERE dr.destination = ? AND dr.stream_ordering > {lo} AND dr.stream_ordering <= {hi} LIMIT 1",
                (destination, *lo_args, *hi_args),
            )
            if txn.fetchone() is not None:
                out.append(destination)
        return sorted(out)

    def local_events_between(self, instance: str, after: int, upto: int, server_name: str,
                             limit: int = 500) -> Deferred[list[tuple[Pdu, list[str]]]]:
        """Local events of one writer in ``(after, upto]`` with their destinations, in order."""
        return self.db.run_interaction("federation_new_events", self._local_events_txn, instance, after, upto,
                                       server_name, limit, read_only=True, idempotent=True)

    @staticmethod
    def _local_events_txn(txn: Txn, instance: str, after: int, upto: int, server_name: str,
                          limit: int) -> list[tuple[Pdu, list[str]]]:
        txn.execute(
            f"SELECT {PDU_COLUMNS}, e.destinations FROM events e "
            "JOIN instance_map im ON im.instance_name = e.instance_name "
            "WHERE e.instance_name = ? AND e.stream_ordering > ? AND e.stream_ordering <= ? "
            "AND e.origin = ? AND e.destinations IS NOT NULL ORDER BY e.stream_ordering LIMIT ?",
            (instance, after, upto, server_name, limit),
        )
        out = []
        for row in txn.fetchall():
            destinations = json.loads(row[-1])
            if destinations:
                out.append((event_to_pdu(tuple(row[:-1])), destinations))
        return out

    def get_stream_position(self, kind: str, instance: str) -> Deferred[str | None]:
        return self.db.run_interaction("get_federation_position", self._get_pos_txn, kind, instance,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _get_pos_txn(txn: Txn, kind: str, instance: str) -> str | None:
        txn.execute("SELECT token FROM federation_stream_position WHERE type = ? AND instance_name = ?", (kind, instance))
        row = txn.fetchone()
        return row[0] if row else None

    def set_stream_position(self, kind: str, instance: str, token: str) -> Deferred[None]:
        return self.db.run_interaction("set_federation_position", self._set_pos_txn, kind, instance, token,
                                       idempotent=True)

    @staticmethod
    def _set_pos_txn(txn: Txn, kind: str, instance: str, token: str) -> None:
        txn.execute(
            "INSERT INTO federation_stream_position (type, instance_name, token) VALUES (?, ?, ?) "
            "ON CONFLICT (type, instance_name) DO UPDATE SET token = excluded.token",
            (kind, instance, token),
        )


#: Inbound transactions are remembered (for deduplication) this long after they arrived.
RECEIVED_TRANSACTIONS_KEEP_S = 24 * 3600.0
#: Expired inbound transactions are deleted at most this often (after a store).
RECEIVED_TRANSACTIONS_PRUNE_INTERVAL_S = 600.0


class SqlDedupeStore:
    """Inbound transactions already answered, by (origin, txn_id).

    Rows older than :data:`RECEIVED_TRANSACTIONS_KEEP_S` are deleted (at
    most every :data:`RECEIVED_TRANSACTIONS_PRUNE_INTERVAL_S`, after a
    store): a remote retries a transaction for minutes, not days, so the
    table stays bounded by the recent inbound rate.

    Args:
        db: the database.
        clock: the time source (the wall clock when None).
        keep_s: how long a transaction is remembered.
    """

    def __init__(self, db: Database, clock: IReactorTime | None = None,
                 keep_s: float = RECEIVED_TRANSACTIONS_KEEP_S) -> None:
        self.db = db
        self.clock = clock
        self.keep_s = keep_s
        self._last_prune: float | None = None
        self.pruned = 0

    def _now(self) -> float:
        return self.clock.seconds() if self.clock is not None else time.time()

    def get_response(self, origin: str, txn_id: str) -> Deferred[tuple[int, dict[str, Any]] | None]:
        return self.db.run_interaction("get_received_txn", self._get_txn, origin, txn_id, read_only=True,
                                       idempotent=True)

    @staticmethod
    def _get_txn(txn: Txn, origin: str, txn_id: str) -> tuple[int, dict[str, Any]] | None:
        txn.execute(
            "SELECT response_code, response_json FROM received_transactions WHERE origin = ? AND txn_id = ?",
            (origin, txn_id),
        )
        row = txn.fetchone()
        return (int(row[0]), json.loads(row[1])) if row else None

    def store_response(self, origin: str, txn_id: str, code: int, body: dict[str, Any]) -> Deferred[None]:
        now = self._now()
        d: Deferred[None] = self.db.run_interaction("store_received_txn", self._store_txn, origin, txn_id, code,
                                                    body, int(now * 1000), idempotent=True)
        if self._last_prune is None or now - self._last_prune >= RECEIVED_TRANSACTIONS_PRUNE_INTERVAL_S:
            self._last_prune = now
            d.addCallback(lambda _: self.prune(now - self.keep_s).addErrback(
                lambda f: logger.warning("pruning received_transactions failed: %s", f.getErrorMessage())))
            d.addCallback(lambda _: None)
        return d

    def prune(self, before_s: float) -> Deferred[int]:
        """Delete transactions received before ``before_s`` (epoch seconds); returns how many."""
        def counted(n: int) -> int:
            self.pruned += n
            return n

        d: Deferred[int] = self.db.run_interaction("prune_received_txns", self._prune_txn, int(before_s * 1000),
                                                   idempotent=True)
        return d.addCallback(counted)

    @staticmethod
    def _prune_txn(txn: Txn, before_ms: int) -> int:
        txn.execute("DELETE FROM received_transactions WHERE received_ts < ?", (before_ms,))
        return max(0, txn.rowcount)

    @staticmethod
    def _store_txn(txn: Txn, origin: str, txn_id: str, code: int, body: dict[str, Any], now_ms: int) -> None:
        txn.execute(
            "INSERT INTO received_transactions (origin, txn_id, response_code, response_json, received_ts) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (origin, txn_id) DO NOTHING",
            (origin, txn_id, code, json.dumps(body), now_ms),
        )
