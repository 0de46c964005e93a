"""Multi-writer stream IDs: the SQL around the pure :class:`PositionTracker`.

IDs come from one sequence per stream shared by every writer: a PostgreSQL
sequence (``nextval``, several at once), or on SQLite a row of
``stream_sequences`` bumped inside the writing transaction (which holds
SQLite's write lock, so writers never race). A write goes through
:meth:`StreamWriters.run_write`: the ``_txn`` function allocates IDs through
its :class:`StreamWriteContext` and writes its rows; when the transaction
commits -- or rolls back -- every ID is completed in the tracker, which
returns the facts that became visible, in order, for the handler to
announce. No SQL runs per fact beyond the write itself.

On SQLite a rolled-back write must not give its IDs back (another writer
would reuse them, and the tracker has already let its position pass them):
the rows are written inside a SAVEPOINT, and on failure only the savepoint is
rolled back and the sequence re-bumped before the transaction commits. If
the transaction as a whole still fails (its COMMIT fails, say on a full
disk or a deferred constraint), the sequence bump is undone with it: those
IDs were never allocated, so the reservation ends without them and the next
write takes them again. (On PostgreSQL ``nextval`` is not transactional, so
the IDs of any failed write are spent and complete as aborted facts.)

Per-writer positions are persisted lazily to ``stream_positions`` (only ever
forward) by :func:`persist_position_txn`, which the replication handler
runs on its tick and at shutdown. At start-up :func:`load_stream_state_txn` reads them,
checks them against the sequence and the table, repairs what is safe
(bumping a sequence that is behind rows or positions) and otherwise refuses to
start with an explanation.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from synflow.audit import AuditLog, now_us
from synflow.errors import InconsistentPositionsError
from synflow.storage.engines import Database, Txn
from synflow.streams import StreamDef
from synflow.streams.tracker import Completed, PositionTracker

logger = logging.getLogger(__name__)

T = TypeVar("T")


@attrs.frozen
class FactPayload:
    """What a writer remembers about one fact until it is announced."""

    rows: tuple[Any, ...]
    reserved_at: int
    room_id: str | None = None
    event_id: str | None = None


# -- start-up state ---------------------------------------------------------------------


@attrs.frozen
class StreamState:
    """What the database says about one stream at start-up."""

    last_allocated: int
    positions: dict[str, int]
    own_max_row: int | None
    repairs: tuple[str, ...] = ()


def last_allocated_txn(txn: Txn, stream: StreamDef) -> int:
    """The highest ID the stream's sequence has handed out."""
    if txn.engine.name == "postgres":
        txn.execute(f"SELECT last_value, is_called FROM {stream.sequence}")
        row = txn.fetchone()
        assert row is not None
        last, called = row
        return int(last) if called else int(last) - 1
    txn.execute("SELECT last_id FROM stream_sequences WHERE stream_name = ?", (stream.name,))
    row = txn.fetchone()
    if row is None:
        raise InconsistentPositionsError(
            f"stream {stream.name!r} has no row in stream_sequences; the schema is incomplete. "
            f"Re-run the master's migrations, or insert it with "
            f"INSERT INTO stream_sequences VALUES ('{stream.name}', <max {stream.id_column} of {stream.table}>)"
        )
    return int(row[0])


def ensure_sequences_txn(txn: Txn, streams: Iterable[StreamDef]) -> list[str]:
    """Create each stream's ID sequence that is missing (its first ID is 2, as synflow's own streams').

    A plugin stream's migrations create only its table; the framework owns
    its sequence (``stream.sequence`` on PostgreSQL, a ``stream_sequences``
    row on SQLite). Run by every process at start: the sequences that exist
    are only looked up, and the schema lock is taken only to create one.
    Returns the names of the streams whose sequence was created.
    """
    if txn.engine.name == "postgres":
        missing = []
        for stream in streams:
            txn.execute("SELECT to_regclass(?)", (stream.sequence,))
            row = txn.fetchone()
            if row is None or row[0] is None:
                missing.append(stream)
        if missing:
            txn.engine.lock_schema_txn(txn)  # concurrent CREATE SEQUENCE IF NOT EXISTS can still collide
        for stream in missing:
            txn.execute(f"CREATE SEQUENCE IF NOT EXISTS {stream.sequence} START WITH 2")
        return [stream.name for stream in missing]
    created = []
    for stream in streams:  # the interaction holds SQLite's write lock already
        txn.execute("INSERT INTO stream_sequences (stream_name, last_id) VALUES (?, 1) "
                    "ON CONFLICT (stream_name) DO NOTHING", (stream.name,))
        if txn.rowcount:
            created.append(stream.name)
    return created


def bump_sequence_txn(txn: Txn, stream: StreamDef, at_least: int) -> None:
    """Make the sequence's next ID greater than ``at_least``.

    On PostgreSQL the sequence is only set when it is behind ``at_least``:
    setting it to a value read a moment before would take it back past any
    ID another writer took in between.
    """
    if txn.engine.name == "postgres":
        txn.execute(f"SELECT setval('{stream.sequence}', ?) FROM {stream.sequence} "
                    f"WHERE CASE WHEN is_called THEN last_value ELSE last_value - 1 END < ?", (at_least, at_least))
    else:
        txn.execute(
            "UPDATE stream_sequences SET last_id = MAX(last_id, ?) WHERE stream_name = ?",
            (at_least, stream.name),
        )


def load_stream_state_txn(txn: Txn, stream: StreamDef, instance_name: str, repair: bool) -> StreamState:
    """Read positions and check them against the sequence and the table.

    Raises:
        InconsistentPositionsError: something is inconsistent and ``repair``
            is off (or the sequence is missing).
    """
    # The sequence is read last. Other writers may be committing meanwhile,
    # and on PostgreSQL each statement sees what was committed before it; an
    # ID in the table or in a position was taken from the sequence before it
    # got there, so a sequence read after them is never behind them unless
    # something really is wrong. Read first, a row committed between the two
    # reads would look like a sequence behind its rows, and the "repair"
    # would set the sequence back under the writer taking IDs from it.
    txn.execute(f"SELECT MAX({stream.id_column}) FROM {stream.table}")
    max_row = (txn.fetchone() or (None,))[0]
    txn.execute("SELECT instance_name, stream_id FROM stream_positions WHERE stream_name = ?", (stream.name,))
    positions = {name: int(pos) for name, pos in txn.fetchall()}
    txn.execute(
        f"SELECT MAX({stream.id_column}) FROM {stream.table} WHERE {stream.instance_column} = ?",
        (instance_name,),
    )
    own_max = (txn.fetchone() or (None,))[0]
    last = last_allocated_txn(txn, stream)
    problems = []
    if max_row is not None and max_row > last:
        problems.append(
            f"the {stream.table} table holds stream ID {max_row} but the sequence has only handed out "
            f"up to {last} (a restored backup, or a sequence reset)"
        )
    top_position = max(positions.values(), default=None)
    if top_position is not None and top_position > last:
        holder = max(positions, key=lambda n: positions[n])
        problems.append(
            f"stream_positions says {holder!r} reached {top_position} but the sequence has only "
            f"handed out up to {last}"
        )
    target = max(v for v in (max_row, top_position, last) if v is not None)
    if problems and not repair:
        if txn.engine.name == "postgres":
            by_hand = f"SELECT setval('{stream.sequence}', {target})"
        else:
            by_hand = f"UPDATE stream_sequences SET last_id = {target} WHERE stream_name = '{stream.name}'"
        raise InconsistentPositionsError(
            f"stream {stream.name!r} is inconsistent: {'; '.join(problems)}. synflow can repair this by "
            f"moving the sequence past every used ID (safe: no ID is reused and no reader position moves "
            f"back); set database.repair_positions: true to let it, or move the sequence by hand with "
            f"{by_hand}"
        )
    if problems:
        bump_sequence_txn(txn, stream, target)
        for problem in problems:
            logger.warning("repaired stream %r: %s; the sequence now continues after %d", stream.name, problem, target)
        last = target
    return StreamState(last, positions, own_max, tuple(problems))


def unaudited_events_txn(txn: Txn, instance_name: str, after: int) -> list[tuple[int, str, str, int]]:
    """This writer's events above ``after``: (stream_ordering, room_id, event_id, received_ts ms)."""
    txn.execute(
        "SELECT stream_ordering, room_id, event_id, received_ts FROM events "
        "WHERE instance_name = ? AND stream_ordering > ? ORDER BY stream_ordering",
        (instance_name, after),
    )
    return [(int(r[0]), r[1], r[2], int(r[3])) for r in txn.fetchall()]


async def recover_audit(db: Any, audit: AuditLog, instance_name: str) -> int:
    """Re-record events committed by a previous run of this writer but missing from its audit log.

    A crash between a commit and the audit write loses those records; the
    events themselves are in the database, and readers catch up on them.
    Every committed event above the last position the log records as
    announced is compared with the log: persisters complete out of order, so
    a missing event may lie below IDs that were logged.

    A missing event is recorded as reserved and completed at the time it was
    received (before its commit), moved up to the reservation of the nearest
    lower ID in the log and down to that of the nearest higher one: IDs are
    reserved in order, so the real reservation lies between them (a received
    time can precede a concurrent request's reservation, and ``received_ts``
    has only millisecond precision). Both recorded times stay at or before
    the real completion. Returns how many events were re-recorded.
    """
    if not audit.enabled:
        return 0
    announced, logged = audit.recovery_view("events")
    rows = await db.run_interaction("unaudited_events", unaudited_events_txn, instance_name, announced,
                                    read_only=True, idempotent=True)
    ids = sorted(logged)
    recovered = 0
    for stream_id, room_id, event_id, ts_ms in rows:  # in stream ID order
        if stream_id in logged:
            continue
        i = bisect.bisect_left(ids, stream_id)
        at = ts_ms * 1000
        if i > 0:
            at = max(at, logged[ids[i - 1]])
        if i < len(ids):
            at = min(at, logged[ids[i]])
        audit.fact("events", stream_id, room_id=room_id, event_id=event_id, reserved_at=at,
                   completed_at=at, ok=True)
        logged[stream_id] = at
        ids.insert(i, stream_id)
        recovered += 1
    if recovered:
        audit.flush_facts()
        logger.warning("re-recorded %d committed events missing from the audit log (after a crash)", recovered)
    return recovered


def persist_position_txn(txn: Txn, stream: str, instance_name: str, position: int) -> None:
    """Upsert a writer's position, only ever moving it forward."""
    greatest = txn.engine.greatest("stream_positions.stream_id", "excluded.stream_id")
    txn.execute(
        "INSERT INTO stream_positions (stream_name, instance_name, stream_id) VALUES (?, ?, ?) "
        f"ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id = {greatest}",
        (stream, instance_name, position),
    )


# -- the generator ------------------------------------------------------------------------


class MultiWriterIdGenerator:
    """Allocates and tracks this instance's IDs on one stream.

    Args:
        stream: the stream definition.
        instance_name: this writer.
        position: the writer's position at start-up.
        clock: timestamps for the audit log.
        audit: where completed facts are recorded (optional).
    """

    def __init__(
        self,
        stream: StreamDef,
        instance_name: str,
        position: int,
        clock: IReactorTime,
        audit: AuditLog | None = None,
    ) -> None:
        self.stream = stream
        self.instance_name = instance_name
        self.clock = clock
        self.audit = audit
        self.tracker: PositionTracker[FactPayload] = PositionTracker(position)
        self.persisted_position = position
        self._alloc_lock = threading.Lock()
        self._listeners: list[Callable[[list[Completed[FactPayload]], int], None]] = []
        self.facts_completed = 0
        self.facts_aborted = 0

    @property
    def position(self) -> int:
        return self.tracker.position

    def add_listener(self, fn: Callable[[list[Completed[FactPayload]], int], None]) -> None:
        """Call ``fn(visible_facts, new_position)`` whenever facts become visible."""
        self._listeners.append(fn)

    # -- on a database thread -------------------------------------------------------------

    def allocate_txn(self, txn: Txn, n: int) -> tuple[list[int], int]:
        """Take ``n`` IDs from the stream's sequence; returns them and the time."""
        if n < 1:
            raise ValueError("allocate at least one ID")
        with self._alloc_lock:
            if txn.engine.name == "postgres":
                txn.execute(f"SELECT nextval('{self.stream.sequence}') FROM generate_series(1, ?)", (n,))
                ids = sorted(int(r[0]) for r in txn.fetchall())
            else:
                txn.execute(
                    "UPDATE stream_sequences SET last_id = last_id + ? WHERE stream_name = ? RETURNING last_id",
                    (n, self.stream.name),
                )
                row = txn.fetchone()
                assert row is not None, f"no stream_sequences row for {self.stream.name}"
                last = int(row[0])
                ids = list(range(last - n + 1, last + 1))
            reserved_at = now_us(self.clock)
        return ids, reserved_at

    # -- on the reactor thread ---------------------------------------------------------------

    def observe_position(self, position: int) -> None:
        """Another writer reached ``position``: that ID has been allocated."""
        self.tracker.observe_allocated(position)

    def idle_advance(self) -> int | None:
        """Leap an idle writer's position; tells listeners. Returns the new position."""
        if not self.stream.idle_leaps:
            return None
        new = self.tracker.idle_advance()
        if new is not None:
            self._notify([], new)
        return new

    def finish(self, handle: int, ids: Sequence[int], payloads: dict[int, FactPayload], ok: bool) -> None:
        """The transaction that reserved ``ids`` committed (``ok``) or rolled back.

        The IDs complete in the tracker, and listeners hear of what became
        visible, whatever happens to the audit records: the audit log never
        raises (it reports its own failures), and should anything in it
        break, the completion has already happened.
        """
        completed_at = now_us(self.clock)
        visible = self.tracker.end_fetch(handle, list(ids))
        visible += self.tracker.complete_many(ids, ok, payloads if ok else None)
        if ok:
            self.facts_completed += len(ids)
        else:
            self.facts_aborted += len(ids)
        if self.audit is not None and ids:
            try:
                self._audit_facts(ids, payloads, completed_at, ok)
            except Exception:
                logger.exception("recording stream %s facts %d..%d in the audit log failed",
                                 self.stream.name, min(ids), max(ids))
        if visible:
            self._notify(visible, self.tracker.position)

    def _audit_facts(self, ids: Sequence[int], payloads: dict[int, FactPayload], completed_at: int,
                     ok: bool) -> None:
        assert self.audit is not None
        for stream_id in ids:
            payload = payloads.get(stream_id)
            if payload is not None:
                self.audit.fact(
                    self.stream.name, stream_id, room_id=payload.room_id, event_id=payload.event_id,
                    reserved_at=payload.reserved_at, completed_at=completed_at, ok=ok,
                )
        # One write per batch, before anything announces these facts: keeps the crash window small.
        self.audit.flush_facts()

    def abandon(self, handle: int, ids: Sequence[int]) -> None:
        """The transaction that reserved ``ids`` rolled back its allocation too (SQLite).

        The reservation ends with no IDs: they go back to the sequence, so
        nothing about them is completed, audited or announced.
        """
        if ids:
            logger.warning(
                "a write to %s rolled back together with its sequence bump; IDs %d..%d will be handed out again",
                self.stream.name, min(ids), max(ids),
            )
        visible = self.tracker.end_fetch(handle, [])
        if visible:
            self._notify(visible, self.tracker.position)

    def _notify(self, visible: list[Completed[FactPayload]], position: int) -> None:
        for fn in self._listeners:
            try:
                fn(visible, position)
            except Exception:
                logger.exception("stream %s listener failed", self.stream.name)

    def persist_position_txn(self, txn: Txn, position: int) -> None:
        persist_position_txn(txn, self.stream.name, self.instance_name, position)


class StreamWriteContext:
    """What a writing ``_txn`` function uses to take IDs and register rows.

    Created on the reactor thread, filled on the database thread, read back on
    the reactor thread once the transaction is over.
    """

    def __init__(self, txn: Txn | None, generators: dict[str, MultiWriterIdGenerator]) -> None:
        self.txn: Txn = txn  # type: ignore[assignment]
        self._generators = generators
        self.allocated: dict[str, list[int]] = {}
        self.payloads: dict[str, dict[int, FactPayload]] = {}
        self._reserved_at: dict[str, int] = {}

    def allocate(self, stream: str, n: int = 1) -> list[int]:
        """Take ``n`` stream IDs for this transaction."""
        gen = self._generators.get(stream)
        if gen is None:
            raise ValueError(f"this write did not declare stream {stream!r}")
        ids, reserved_at = gen.allocate_txn(self.txn, n)
        self.allocated.setdefault(stream, []).extend(ids)
        for stream_id in ids:
            self.payloads.setdefault(stream, {})[stream_id] = FactPayload((), reserved_at)
        return ids

    def add_rows(
        self, stream: str, stream_id: int, rows: Iterable[Any], *, room_id: str | None = None,
        event_id: str | None = None,
    ) -> None:
        """The rows (sharing ``stream_id``) to announce once the fact is visible."""
        payloads = self.payloads[stream]
        payload = payloads[stream_id]
        # Built directly, not through attrs.evolve (about twice the cost): once per fact, under the write lock.
        payloads[stream_id] = FactPayload(payload.rows + tuple(rows), payload.reserved_at, room_id, event_id)


def insert_stream_rows_txn(ctx: StreamWriteContext, stream: StreamDef, instance_name: str,
                           rows: Sequence[Any]) -> list[int]:
    """Take one ID per row and insert each as ``(id, instance, *row_to_db(row))`` into the stream's table.

    The stream's ``id_column``, ``instance_column`` and ``select`` columns;
    each row is registered for announcement with its shard key as the room.
    Returns the IDs, in row order.
    """
    columns = (stream.id_column, stream.instance_column, *stream.select)
    sql = f"INSERT INTO {stream.table} ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)})"
    ids = ctx.allocate(stream.name, len(rows))
    for stream_id, row in zip(ids, rows, strict=True):
        ctx.txn.execute(sql, (stream_id, instance_name, *stream.row_to_db(row)))
        ctx.add_rows(stream.name, stream_id, [row], room_id=stream.shard_key(row) if stream.shard_key else None)
    return ids


@attrs.frozen
class _RolledBack:
    error: BaseException


class StreamWriters:
    """All streams this process writes, and the one way to write them.

    Args:
        db: the database.
        generators: this process's generators, by stream name.
    """

    def __init__(self, db: Database, generators: dict[str, MultiWriterIdGenerator]) -> None:
        self.db = db
        self.generators = generators

    def run_write(
        self, desc: str, streams: Sequence[str], func: Callable[..., T], *args: Any, **kwargs: Any
    ) -> Deferred[T]:
        """Run ``func(ctx, *args, **kwargs)`` in one transaction that may allocate IDs of ``streams``.

        Every ID allocated completes when the transaction is over: as a
        committed fact if it committed, as an aborted one if it rolled back
        (the error is then re-raised to the caller).
        """
        gens = {s: self.generators[s] for s in streams}
        handles = {s: g.tracker.begin_fetch() for s, g in gens.items()}
        ctx = StreamWriteContext(None, gens)
        sqlite = self.db.engine.name == "sqlite"

        def write_txn(txn: Txn) -> Any:
            ctx.txn = txn
            if not sqlite:
                return func(ctx, *args, **kwargs)
            txn.execute("SAVEPOINT stream_write")
            try:
                result = func(ctx, *args, **kwargs)
            except Exception as e:
                txn.execute("ROLLBACK TO SAVEPOINT stream_write")
                for stream, ids in ctx.allocated.items():
                    bump_sequence_txn(txn, gens[stream].stream, max(ids))
                txn.execute("RELEASE SAVEPOINT stream_write")
                return _RolledBack(e)
            txn.execute("RELEASE SAVEPOINT stream_write")
            return result

        def done(result: Any) -> Any:
            ok = not isinstance(result, _RolledBack)
            self._finish(gens, handles, ctx, ok)
            if not ok:
                raise result.error
            return result

        def failed(failure: Any) -> Any:
            if sqlite:
                # The whole transaction rolled back (its commit failed, or the
                # savepoint handling did), and the sequence bump with it: the
                # IDs were never allocated and the next write takes them again.
                # Completing them would move the position past IDs about to be
                # reused.
                for stream, gen in gens.items():
                    gen.abandon(handles[stream], ctx.allocated.get(stream, []))
            else:
                # nextval is not transactional: the IDs are spent, so they
                # complete as aborted facts.
                self._finish(gens, handles, ctx, False)
            return failure

        d = self.db.run_interaction(desc, write_txn)
        d.addCallbacks(done, failed)
        return d

    @staticmethod
    def _finish(gens: dict[str, MultiWriterIdGenerator], handles: dict[str, int],
                ctx: StreamWriteContext, ok: bool) -> None:
        # Every generator ends its fetch even if another one fails: an open
        # fetch would hold that stream's position back until a restart.
        first_error: Exception | None = None
        for stream, gen in gens.items():
            try:
                gen.finish(handles[stream], ctx.allocated.get(stream, []), ctx.payloads.get(stream, {}), ok)
            except Exception as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
