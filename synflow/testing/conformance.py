"""The conformance kit: trial mixins that prove a stream or a worker type honours synflow's protocol.

A stream author combines :class:`StreamConformance` with
:class:`twisted.trial.unittest.TestCase`, names the stream and gives a few
valid rows::

    from twisted.trial.unittest import TestCase

    from synflow.testing.conformance import StreamConformance
    from synflow_receipts.receipts import RECEIPTS, ReceiptRow


    class ReceiptsConformanceTest(StreamConformance, TestCase):
        stream = RECEIPTS

        def sample_rows(self):
            return [ReceiptRow("!a:hs", "@u:hs", "$1:hs"), ReceiptRow("!b:hs", "@v:hs", "$2:hs"),
                    ReceiptRow("!a:hs", "@v:hs", "$3:hs")]

and the mixin's ``test_conformance_*`` methods run against synflow's real
code: the line codec, the ID generator and :class:`StreamWriters`, the
replication handler on both ends, the database catch-up source, the audit
log and the validator's reference checker. Each test gets a fresh SQLite
database (synflow's schema, then the stream's own ``schema`` migrations and
whatever :meth:`StreamConformance.plugin_schemas` adds). What it proves:

* rows round-trip the wire byte for byte, and malformed wire rows are refused
  with :class:`~synflow.streams.StreamRowError` (a reader drops them);
* a writer announces a row (RDATA) or a position (POSITION) only once every
  row it covers is committed, and its announcements never go backwards;
* a reader that missed rows (a dropped link, a congested bus) catches up
  through the writer's POSITION and the stream's table, and ends with every
  row once, in order, equal to what was written (so ``select``,
  ``row_from_db`` and the table agree with the row type);
* tokens built from the stream's writer positions parse, merge and compare
  as vector clocks, and cover exactly the rows the reader had seen;
* the audit log of those writes passes the validator's writer checks (and
  the reader's tokens its token checks).

Rows are written the way :meth:`synflow.api.ProcessContext.write_rows`
writes them (``row_to_db`` into the ``select`` columns); a stream whose
table needs more (other columns, JSON encoding) overrides
:meth:`StreamConformance.write_rows_txn` with its own writing function.

A worker type author combines :class:`WorkerTypeConformance` with a
``TestCase`` the same way::

    class ReceiptWriterConformanceTest(WorkerTypeConformance, TestCase):
        worker_type = ReceiptWriter
        config_yaml = "receipts:\\n  max_list: 50\\n"  # optional: a valid fragment holding its section

It checks the type describes itself, is registered under its name (its
distribution is installed), that its config section structures like
synflow's own (defaults from an empty mapping, an unknown key refused
naming ``<section>.<key>``) and that every stream it writes or follows is
registered.

The validator check needs the reference checker (``synflow_spark``, or
``spark`` in a synflow checkout) and the token test needs ``hypothesis``;
each is skipped when its module cannot be imported.
"""

from __future__ import annotations

import importlib
import json
import os
import sqlite3
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SkipTest

from synflow.audit import AuditLog
from synflow.config import core_keys, structure
from synflow.errors import ConfigError, RemoteProtocolError
from synflow.framework import Capability, Section, WorkerType
from synflow.replication.commands import (
    AnyCommand,
    PositionCommand,
    RdataCommand,
    encode_line,
    parse_line,
)
from synflow.replication.guard import PositionGuard
from synflow.replication.handler import ReplicationHandler
from synflow.sharding import shard_for
from synflow.storage.engines import Database, DatabaseConfig
from synflow.storage.id_generators import (
    MultiWriterIdGenerator,
    StreamWriteContext,
    StreamWriters,
    ensure_sequences_txn,
    insert_stream_rows_txn,
    last_allocated_txn,
    load_stream_state_txn,
)
from synflow.storage.instances import InstanceMap
from synflow.storage.prepare import prepare_database, prepare_plugin_schemas
from synflow.storage.sources import DatabaseSource
from synflow.streams import StreamDef, StreamRowError, Writers
from synflow.tokens import StreamToken

if TYPE_CHECKING:
    from twisted.trial.unittest import TestCase as _TestCaseBase
else:
    _TestCaseBase = object

__all__ = ["StreamConformance", "WorkerTypeConformance", "reference_checker"]

#: How long a reader may take to catch up before the test fails (seconds).
_CATCH_UP_TIMEOUT_S = 10.0


def reference_checker() -> ModuleType:
    """The validator's pure-Python reference checker (``synflow_spark.reference``, else ``spark.reference``).

    Raises:
        SkipTest: neither is importable.
    """
    for name in ("synflow_spark.reference", "spark.reference"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise SkipTest("the validator's reference checker (synflow_spark) is not installed")


def _checker_checks(checker: ModuleType, *groups: str) -> frozenset[str]:
    """The names of the validator's checks in ``groups`` (``writer``, ``tokens``, ``syntax`` ...)."""
    checks = importlib.import_module(checker.__name__.rsplit(".", 1)[0] + ".checks")
    return frozenset(c.name for c in checks.CHECKS if c.group in groups)


class _Rollback(Exception):
    """Raised inside a write to roll it back (its IDs complete as aborted facts)."""


def _line(cmd: AnyCommand) -> bytes:
    return encode_line(cmd).encode("utf-8")


class _Link:
    """One end of a replication link that records every command sent on it, as it goes out.

    For a command of ``stream`` it also records which of the writer's rows
    at or below the claimed position were committed at that moment (read
    through its own SQLite connection, outside the writer's transaction).
    """

    def __init__(self, committed: _CommittedRows | None = None) -> None:
        self.committed = committed
        self.sent: list[tuple[AnyCommand, frozenset[int] | None]] = []
        self.peer_name: str | None = "conformance link"

    def send_command(self, cmd: AnyCommand) -> None:
        _line(cmd)  # every command the writer sends must encode
        snapshot = None
        if self.committed is not None and isinstance(cmd, RdataCommand | PositionCommand):
            claim = cmd.token if isinstance(cmd, RdataCommand) else cmd.new_token
            if claim is not None and cmd.stream_name == self.committed.stream.name:
                snapshot = self.committed.ids(cmd.instance_name, claim)
        self.sent.append((cmd, snapshot))

    def commands(self) -> list[AnyCommand]:
        return [cmd for cmd, _ in self.sent]


class _CommittedRows:
    """Reads which stream IDs are committed in the stream's table, from a connection of its own."""

    def __init__(self, path: str, stream: StreamDef) -> None:
        self.stream = stream
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
        self.sql = (f"SELECT {stream.id_column} FROM {stream.table} "
                    f"WHERE {stream.instance_column} = ? AND {stream.id_column} <= ?")

    def ids(self, instance: str, upto: int) -> frozenset[int]:
        return frozenset(int(r[0]) for r in self.conn.execute(self.sql, (instance, upto)))

    def close(self) -> None:
        self.conn.close()


@attrs.define(eq=False)
class _Writer:
    """One writing process: its generator, writes, replication handler, audit log and links."""

    name: str
    generator: MultiWriterIdGenerator
    writers: StreamWriters
    handler: ReplicationHandler
    audit: AuditLog
    start: int
    #: The first link's hello (the POSITION a new connection gets), then everything it announced.
    hello: _Link
    transport: _Link
    #: (stream ID, row) of every committed row, in ID order once the writes are done.
    written: list[tuple[int, Any]] = attrs.Factory(list)
    aborted: list[int] = attrs.Factory(list)

    def link_commands(self) -> list[AnyCommand]:
        """What a reader connected before the writes saw on the first link, in order."""
        return self.hello.commands() + self.transport.commands()


@attrs.define(eq=False)
class _Env:
    db: Database
    directory: str
    audit_dir: str
    committed: _CommittedRows
    allocated_at_start: int
    writers: dict[str, _Writer]


@attrs.define(eq=False)
class _Reader:
    handler: ReplicationHandler
    #: (writer, token, rows) as the row handler got them.
    rows: list[tuple[str, int, list[Any]]] = attrs.Factory(list)
    #: (writer, position) after every advance.
    positions: list[tuple[str, int]] = attrs.Factory(list)
    #: How many rows arrived as RDATA before the link dropped (the rest come from the catch-up).
    live_rows: int = 0

    def rows_of(self, writer: str) -> list[tuple[int, Any]]:
        return [(token, row) for w, token, rows in self.rows if w == writer for row in rows]


class StreamConformance(_TestCaseBase):
    """Trial mixin: a stream honours the replication protocol (see the module docstring).

    Set ``stream`` and override :meth:`sample_rows`; optionally
    :meth:`malformed_wire_rows`, :meth:`write_rows_txn`,
    :meth:`plugin_schemas`, ``writer_names`` and ``reader_name``.
    ``stream`` may also be set on the instance (in ``setUp``).
    """

    #: The stream under test.
    stream: StreamDef
    #: The writing processes the tests run (rows shard over them for a sharded stream).
    writer_names: tuple[str, ...] = ("writer1", "writer2")
    #: The reading process.
    reader_name: str = "reader1"

    # -- what the author provides ----------------------------------------------------

    def sample_rows(self) -> list[Any]:
        """At least three valid rows of the stream, all different (distinct keys where the table needs them)."""
        raise NotImplementedError(f"{type(self).__name__} must override sample_rows()")

    def malformed_wire_rows(self) -> list[Any]:
        """Wire rows (decoded JSON) that ``row_type.from_wire`` must refuse with ``StreamRowError``.

        The default: values that are not arrays, an empty array and an array
        one item longer than a sample row's wire form.
        """
        wire = self.stream.row_type.to_wire(self._conformance_rows()[0])  # type: ignore[attr-defined]
        return [None, {}, "row", 7, [], [*wire, None]]

    def plugin_schemas(self) -> dict[str, str]:
        """Migration directories to apply after synflow's schema, by namespace (default: the stream's ``schema``)."""
        if self.stream.schema is None:
            return {}
        return {f"stream:{self.stream.name}": self.stream.schema}

    def write_rows_txn(self, ctx: StreamWriteContext, instance_name: str, rows: Sequence[Any]) -> Sequence[int]:
        """Write ``rows`` as ``instance_name`` in one transaction; their stream IDs, in row order.

        The default is what :meth:`synflow.api.ProcessContext.write_rows` does:
        one ID per row, ``(id, instance, *row_to_db(row))`` into the
        stream's ``id_column``, ``instance_column`` and ``select`` columns,
        each row registered for announcement (with its shard key as the
        room). A stream written otherwise overrides this with its own
        writing function.
        """
        return insert_stream_rows_txn(ctx, self.stream, instance_name, rows)

    # -- the tests -----------------------------------------------------------------------

    def test_conformance_rows_round_trip_the_wire(self) -> None:
        """Every sample row survives RDATA encoding and parsing, and re-encodes to the same bytes."""
        stream = self.stream
        row_type: Any = stream.row_type
        for token in (17, None):
            for row in self._conformance_rows():
                wire = row.to_wire()
                self.assertIsInstance(wire, list, f"{row!r}.to_wire() must return a list")
                line = _line(RdataCommand(stream.name, self.writer_names[0], token, wire))
                cmd = parse_line(line)
                self.assertIsInstance(cmd, RdataCommand)
                assert isinstance(cmd, RdataCommand)
                self.assertEqual((cmd.stream_name, cmd.instance_name, cmd.token),
                                 (stream.name, self.writer_names[0], token))
                try:
                    back = row_type.from_wire(cmd.row)
                except RemoteProtocolError as e:
                    self.fail(f"{stream.name}: from_wire refused the wire form of {row!r} ({line!r}): {e}")
                self.assertIsInstance(back, row_type)
                self.assertEqual(back, row, f"{stream.name}: {line!r} does not give back {row!r}")
                again = _line(RdataCommand(stream.name, self.writer_names[0], token, back.to_wire()))
                self.assertEqual(again, line, f"{stream.name}: {row!r} re-encodes differently")

    def test_conformance_malformed_rows_are_refused(self) -> None:
        """Every malformed wire row raises StreamRowError, and a reader drops it without moving."""
        stream = self.stream
        row_type: Any = stream.row_type
        malformed = self.malformed_wire_rows()
        self.assertTrue(malformed, "malformed_wire_rows() returned nothing")
        for wire in malformed:
            try:
                row = row_type.from_wire(wire)
            except RemoteProtocolError as e:
                self.assertIsInstance(e, StreamRowError, f"{stream.name}: refuse {wire!r} with StreamRowError")
            except Exception as e:
                self.fail(f"{stream.name}: from_wire({wire!r}) raised {type(e).__name__} ({e}), "
                          "not StreamRowError: a reader would not drop the row")
            else:
                self.fail(f"{stream.name}: from_wire accepted the malformed row {wire!r} as {row!r}")
        # Through a reader: the RDATA lines of the array-shaped ones are dropped and counted.
        writer = self.writer_names[0]
        reader = ReplicationHandler(self.reader_name, Clock(), streams={stream.name: stream}, sources={},
                                    initial_positions={stream.name: {writer: 1}})
        applied: list[Any] = []
        reader.add_row_handler(stream.name, lambda w, token, rows: applied.append((w, token, rows)))
        link = _Link()
        reader.new_connection(link)
        reader.on_command(link, parse_line(_line(PositionCommand(stream.name, writer, 1, 1))))
        arrays = [w for w in malformed if isinstance(w, list)]
        for token, wire in enumerate(arrays, start=2):
            reader.on_command(link, parse_line(_line(RdataCommand(stream.name, writer, token, wire))))
        self.assertEqual(applied, [])
        self.assertEqual(reader.stats.bad_rows, len(arrays))
        self.assertEqual(reader.position(stream.name, writer), 1)

    async def test_conformance_positions_after_commit_and_monotonic(self) -> None:
        """A writer announces a row or position only once every row it covers is committed, never going back."""
        stream = self.stream
        env = await self._conformance_env()
        await self._conformance_write(env)
        self.assertTrue(any(w.written for w in env.writers.values()), "nothing was written")
        for writer in env.writers.values():
            sent = writer.transport.sent
            last = writer.start
            last_rdata = writer.start
            announced: list[tuple[int, Any]] = []
            batch: list[Any] = []
            for cmd, committed in sent:
                if not isinstance(cmd, RdataCommand | PositionCommand) or cmd.stream_name != stream.name:
                    continue
                self.assertEqual(cmd.instance_name, writer.name)
                if isinstance(cmd, RdataCommand):
                    batch.append(stream.row_type.from_wire(cmd.row))  # type: ignore[attr-defined]
                    if cmd.token is None:
                        continue
                    claim = cmd.token
                    self.assertGreater(claim, last_rdata, f"{writer.name}: RDATA at {claim} after {last_rdata}")
                    last_rdata = claim
                    assert committed is not None
                    self.assertIn(claim, committed,
                                  f"{writer.name} announced row {claim} before it was committed")
                    announced += [(claim, row) for row in batch]
                    batch = []
                else:
                    claim = cmd.new_token
                    self.assertLessEqual(cmd.prev_token, cmd.new_token, f"{writer.name}: {cmd}")
                self.assertGreaterEqual(claim, last, f"{writer.name}'s announcements went back: {claim} after {last}")
                last = claim
                assert committed is not None
                final = env.committed.ids(writer.name, claim)
                self.assertEqual(committed, final,
                                 f"{writer.name} announced {claim} while rows {sorted(final - committed)} "
                                 "at or below it were not committed")
            self.assertEqual(batch, [], f"{writer.name} left batch rows without their numeric RDATA")
            self.assertEqual(announced, writer.written, f"{writer.name} announced other rows than it committed")
            self.assertEqual(last, writer.generator.position)
            self.assertGreaterEqual(last, max([*writer.aborted, *(sid for sid, _ in writer.written)]))

    async def test_conformance_reader_catches_up_after_missing_rows(self) -> None:
        """A reader that missed rows catches up through POSITION and the table: every row once, in order."""
        env = await self._conformance_env()
        await self._conformance_write(env)
        for live_share in (0.0, 0.5):
            reader = await self._conformance_read(env, live_share, f"{self.reader_name}_{int(live_share * 100)}")
            self._conformance_assert_caught_up(env, reader)

    async def test_conformance_tokens(self) -> None:
        """Tokens of the stream's writer positions parse, merge point-wise and compare like vector clocks."""
        try:
            from hypothesis import given, settings
            from hypothesis import strategies as st
        except ImportError:
            raise SkipTest("hypothesis is not installed") from None
        env = await self._conformance_env()
        await self._conformance_write(env)
        reader = await self._conformance_read(env, 0.5, self.reader_name)
        self._conformance_assert_caught_up(env, reader)
        names = list(env.writers)
        ids = await InstanceMap(env.db).ids_for(names)
        outsider = max(ids.values()) + 1  # a writer no token lists: it is at the minimum
        every_id = [*ids.values(), outsider]

        # The reader's vector clock after each advance never goes back.
        clock = {ids[w]: self._conformance_reader_start() for w in names}
        history = [StreamToken.from_positions(clock)]
        for writer, position in reader.positions:
            clock[ids[writer]] = position
            history.append(StreamToken.from_positions(clock))
        for before, after in zip(history, history[1:]):
            self.assertTrue(before.is_before_or_eq(after), f"reader token went back: {before} then {after}")

        reached = {w: sorted({self._conformance_reader_start(), *(p for x, p in reader.positions if x == w)})
                   for w in names}
        seen = {w: reader.rows_of(w) for w in names}

        @st.composite
        def tokens(draw: Any) -> StreamToken:
            positions = {ids[w]: draw(st.sampled_from(reached[w])) for w in names}
            minimum = draw(st.integers(min_value=0, max_value=min(positions.values())))
            return StreamToken.from_positions(positions, minimum)

        @settings(max_examples=60, deadline=None, database=None)
        @given(tokens(), tokens(), tokens())
        def check(a: StreamToken, b: StreamToken, c: StreamToken) -> None:
            for t in (a, b, c):
                self.assertEqual(StreamToken.parse(str(t)), t)
                self.assertEqual(str(StreamToken.parse(str(t))), str(t))
            ab = a.merge(b)
            self.assertEqual(ab, b.merge(a))
            self.assertEqual(a.merge(a), a)
            self.assertEqual(ab.merge(c), a.merge(b.merge(c)))
            for i in every_id:
                self.assertEqual(ab.get(i), max(a.get(i), b.get(i)))
            pointwise = all(a.get(i) <= b.get(i) for i in every_id)
            self.assertEqual(a.is_before_or_eq(b), pointwise, f"{a} <= {b}")
            self.assertTrue(a.is_before_or_eq(ab) and b.is_before_or_eq(ab))
            for writer in names:
                upto = a.get(ids[writer])
                covered = [(sid, row) for sid, row in env.writers[writer].written if a.covers(ids[writer], sid)]
                self.assertEqual(covered, [(t, r) for t, r in seen[writer] if t <= upto],
                                 f"{a} covers other rows of {writer} than the reader had at {upto}")

        check()

    async def test_conformance_validator_writer_checks(self) -> None:
        """The audit log of real writes and reads passes the validator's writer and token checks."""
        checker = reference_checker()
        stream = self.stream
        env = await self._conformance_env()
        reader_audit = self._conformance_audit(env, self.reader_name)
        ids = await InstanceMap(env.db, reader_audit).ids_for(list(env.writers))
        await self._conformance_write(env)
        reader = await self._conformance_read(env, 0.5, self.reader_name, audit=reader_audit, instance_ids=ids)
        self._conformance_assert_caught_up(env, reader)
        for writer in env.writers.values():
            writer.audit.close()
        reader_audit.close()

        def load(kind: str) -> list[dict[str, Any]]:
            return list(checker.load_jsonl(os.path.join(env.audit_dir, kind)))

        writer_rows, token_rows, instance_rows = load("writer_logs"), load("token_logs"), load("instance_map")
        facts = [r for r in writer_rows if r.get("kind") is None and r["stream"] == stream.name]
        for writer in env.writers.values():
            mine = [r for r in facts if r["writer"] == writer.name]
            self.assertEqual(sorted(r["stream_id"] for r in mine if r["outcome"] == "ok"),
                             [sid for sid, _ in writer.written], f"{writer.name}'s committed facts in the audit log")
            self.assertEqual(sorted(r["stream_id"] for r in mine if r["outcome"] == "aborted"), writer.aborted,
                             f"{writer.name}'s aborted facts in the audit log")
        self.assertTrue([r for r in token_rows if r["stream"] == stream.name], "the reader issued no token")
        result = checker.check(writer_rows, token_rows, instance_rows)
        wanted = _checker_checks(checker, "writer", "tokens", "syntax")
        found = [v for v in result.violations if v["check"] in wanted and v.get("stream") == stream.name]
        self.assertEqual(found, [], f"the validator found violations on {stream.name}: "
                                    + json.dumps(found, sort_keys=True)[:2000])

    # -- the machinery --------------------------------------------------------------------

    def _conformance_rows(self) -> list[Any]:
        rows = list(self.sample_rows())
        self.assertGreaterEqual(len(rows), 3, "sample_rows() must give at least three rows")
        for row in rows:
            self.assertIsInstance(row, self.stream.row_type)
        return rows

    def _conformance_audit(self, env: _Env, instance: str) -> AuditLog:
        from twisted.internet import reactor

        audit = AuditLog(env.audit_dir, instance, reactor)
        self.addCleanup(audit.close)
        return audit

    async def _conformance_env(self) -> _Env:
        """A fresh database with the stream's table, and a started writer per writer name."""
        from twisted.internet import reactor

        stream = self.stream
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        path = os.path.join(directory, "synflow.db")
        db = Database(reactor, DatabaseConfig(engine="sqlite", path=path, synchronous="normal"))
        self.addCleanup(db.close)
        await prepare_database(db, apply=True)
        schemas = self.plugin_schemas()
        if schemas:
            await prepare_plugin_schemas(db, schemas)
        await db.run_interaction("ensure_sequences", ensure_sequences_txn, [stream])  # as the bootstrap does
        committed = _CommittedRows(path, stream)
        self.addCleanup(committed.close)
        allocated = await db.run_interaction("allocated", last_allocated_txn, stream)
        env = _Env(db, directory, os.path.join(directory, "audit"), committed, allocated, {})
        for name in self.writer_names:
            env.writers[name] = await self._conformance_writer(env, name)
        return env

    async def _conformance_writer(self, env: _Env, name: str) -> _Writer:
        """A writer started the way the bootstrap starts one (recovering its audit log first)."""
        from twisted.internet import reactor

        stream = self.stream
        state = await env.db.run_interaction(f"load_stream_{stream.name}", load_stream_state_txn, stream, name,
                                             False)
        audit = self._conformance_audit(env, name)
        if stream.recover_audit is not None:
            await stream.recover_audit(env.db, audit, name)
        start = max(state.positions.get(name, 1), state.own_max_row or 1)
        generator = MultiWriterIdGenerator(stream, name, start, reactor, audit)
        handler = ReplicationHandler(name, reactor, streams={stream.name: stream},
                                     sources={stream.name: DatabaseSource(env.db, stream)},
                                     generators={stream.name: generator},
                                     initial_positions={stream.name: {name: start}}, audit=audit)
        transport = _Link(env.committed)
        handler.set_transport(transport)
        hello = _Link(env.committed)
        handler.new_connection(hello)
        return _Writer(name, generator, StreamWriters(env.db, {stream.name: generator}), handler, audit, start,
                       hello, transport)

    def _conformance_owner(self, row: Any, index: int) -> str:
        stream = self.stream
        if stream.shard_key is not None and stream.writers is Writers.CONFIGURED:
            return shard_for(stream.shard_key(row), self.writer_names)
        return self.writer_names[index % len(self.writer_names)]

    async def _conformance_write(self, env: _Env) -> None:
        """Write every sample row, in transactions of one and two rows, all writers at once.

        Each writer also has one write that allocates an ID and rolls back.
        """
        stream = self.stream
        mine: dict[str, list[Any]] = {name: [] for name in env.writers}
        for i, row in enumerate(self._conformance_rows()):
            mine[self._conformance_owner(row, i)].append(row)
        pending: list[Deferred[Any]] = []

        def write(writer: _Writer, rows: list[Any]) -> Deferred[Any]:
            def txn(ctx: StreamWriteContext) -> Sequence[int]:
                return self.write_rows_txn(ctx, writer.name, rows)

            def done(ids: Sequence[int]) -> None:
                self.assertEqual(len(ids), len(rows), "write_rows_txn must return one stream ID per row")
                writer.written += zip(ids, rows, strict=True)

            return writer.writers.run_write(f"conformance_{stream.name}", [stream.name], txn).addCallback(done)

        def abort(writer: _Writer) -> Deferred[Any]:
            allocated: list[int] = []

            def txn(ctx: StreamWriteContext) -> None:
                allocated.extend(ctx.allocate(stream.name, 1))
                raise _Rollback()

            def rolled_back(failure: Any) -> None:
                failure.trap(_Rollback)
                writer.aborted += allocated

            d = writer.writers.run_write(f"conformance_{stream.name}_rollback", [stream.name], txn)
            return d.addCallbacks(lambda _: self.fail("the rolled-back write committed"), rolled_back)

        chunks: dict[str, list[list[Any]]] = {}
        for name, rows in mine.items():
            chunks[name] = []
            i, size = 0, 1
            while i < len(rows):
                chunks[name].append(rows[i:i + size])
                i += size
                size = 3 - size
        rounds = max((len(c) for c in chunks.values()), default=0)
        for r in range(rounds):
            for name, writer in env.writers.items():
                if r < len(chunks[name]):
                    pending.append(write(writer, chunks[name][r]))
                if r == rounds // 2:
                    pending.append(abort(writer))
        # Every write ends before anything is reported (none is left running after the test).
        for ok, result in await DeferredList(pending, consumeErrors=True):
            if not ok:
                result.raiseException()  # the write's own error, or the failed assertion
        for writer in env.writers.values():
            writer.written.sort(key=lambda pair: pair[0])
            writer.aborted.sort()

    def _conformance_reader_start(self) -> int:
        """Where a freshly started reader puts a writer (as the bootstrap does); 0 when unknown."""
        return 0 if self.stream.writers is Writers.DECLARED else 1

    async def _conformance_read(self, env: _Env, live_share: float, name: str, *, audit: AuditLog | None = None,
                                instance_ids: Mapping[str, int] | None = None) -> _Reader:
        """A reader connected before the writes gets part of each writer's first link, loses it, reconnects.

        Every command crosses as a line (encoded, then parsed). With
        ``audit`` and ``instance_ids``, the reader records a token each time
        a writer's position moves.
        """
        from twisted.internet import reactor

        stream = self.stream
        initial = {w: p for w in env.writers if (p := self._conformance_reader_start())}

        def fetch_allocated(s: str) -> Deferred[int]:
            return env.db.run_interaction("allocated", last_allocated_txn, stream)

        handler = ReplicationHandler(
            name, reactor, streams={stream.name: stream},
            sources={stream.name: DatabaseSource(env.db, stream)}, initial_positions={stream.name: initial},
            guard=PositionGuard(fetch_allocated, {stream.name: env.allocated_at_start}, reactor),
        )
        reader = _Reader(handler)
        handler.add_row_handler(stream.name, lambda w, token, rows: reader.rows.append((w, token, list(rows))))
        issued: list[str] = []

        def advanced(writer: str, position: int) -> None:
            reader.positions.append((writer, position))
            if audit is not None and instance_ids is not None:
                token = str(StreamToken.from_positions(
                    {instance_ids[w]: handler.position(stream.name, w) for w in env.writers}))
                audit.token(reader=name, stream=stream.name, since=issued[-1] if issued else None, token=token,
                            delivered=[])
                issued.append(token)

        handler.add_position_listener(stream.name, advanced)

        def deliver(link: _Link, cmd: AnyCommand) -> None:
            handler.on_command(link, parse_line(_line(cmd)))

        first = _Link()
        handler.new_connection(first)
        for writer in env.writers.values():
            commands = writer.link_commands()
            live = commands[:len(writer.hello.sent) + int(len(writer.transport.sent) * live_share)]
            for cmd in live:
                deliver(first, cmd)
            claims = [c.token if isinstance(c, RdataCommand) else c.new_token
                      for c in live if isinstance(c, RdataCommand | PositionCommand)]
            await self._conformance_wait(reader, writer.name, max((c for c in claims if c is not None), default=0))
            reader.live_rows += sum(1 for c in live if isinstance(c, RdataCommand))
        handler.lost_connection(first)  # the rest of the first link is lost
        second = _Link()
        handler.new_connection(second)
        for writer in env.writers.values():
            hello = _Link()
            writer.handler.new_connection(hello)
            for cmd in hello.commands():
                deliver(second, cmd)
        for writer in env.writers.values():
            await self._conformance_wait(reader, writer.name, writer.generator.position)
        return reader

    async def _conformance_wait(self, reader: _Reader, writer: str, position: int) -> None:
        """Until ``reader`` has ``writer`` at ``position`` (a test failure after a while)."""
        handler = reader.handler
        reached = await handler.wait_for_position(self.stream.name, writer, position, timeout=_CATCH_UP_TIMEOUT_S)
        self.assertTrue(reached, f"{handler.instance_name} did not reach {writer}'s position {position} "
                                 f"(at {handler.position(self.stream.name, writer)})")
        # Waiters fire from inside the handler's apply: let it finish the command first.
        from twisted.internet import reactor

        await deferLater(reactor, 0, lambda: None)

    def _conformance_assert_caught_up(self, env: _Env, reader: _Reader) -> None:
        """The reader has every written row once, in order, and each writer's final position."""
        stream = self.stream
        name = reader.handler.instance_name
        for writer in env.writers.values():
            self.assertEqual(reader.rows_of(writer.name), writer.written,
                             f"{name} has other rows of {writer.name} than were written")
            self.assertEqual(reader.handler.position(stream.name, writer.name), writer.generator.position)
        stats = reader.handler.stats
        total = sum(len(w.written) for w in env.writers.values())
        self.assertEqual((stats.bad_rows, stats.positions_refused, stats.rdata_unconnected), (0, 0, 0))
        self.assertEqual(stats.rows_caught_up, total - reader.live_rows,
                         f"{name} should have read every row it missed from the stream's table")


class WorkerTypeConformance(_TestCaseBase):
    """Trial mixin: a worker type describes itself, is registered and has a well-behaved config section.

    Set ``worker_type`` (on the class, or on the instance in ``setUp``) and,
    when it has a config section, optionally ``config_yaml``: a config file
    fragment with the section as its top-level key, which must structure
    without error.
    """

    #: The worker type under test.
    worker_type: type[WorkerType]
    #: A valid config file fragment holding the type's section (``"receipts:\n  max_list: 50\n"``).
    config_yaml: str | None = None

    def test_conformance_worker_type_is_described(self) -> None:
        """The type has a name (one word), a one-line summary and well-typed class attributes."""
        cls = self.worker_type
        self.assertTrue(isinstance(cls, type) and issubclass(cls, WorkerType), f"{cls!r} is not a WorkerType")
        name = getattr(cls, "name", None)
        self.assertIsInstance(name, str, f"{cls.__name__} has no name")
        assert isinstance(name, str)
        self.assertTrue(name and name.split() == [name] and ":" not in name,
                        f"{cls.__name__}.name {name!r} must be one word (no spaces or ':')")
        self.assertIsInstance(cls.summary, str)
        self.assertTrue(cls.summary.strip(), f"{name} has no summary")
        self.assertNotIn("\n", cls.summary, f"{name}'s summary must be one line")
        for stream in cls.writes:
            self.assertIsInstance(stream, StreamDef, f"{name}.writes holds {stream!r}")
        for followed in cls.follows:
            self.assertIsInstance(followed, str, f"{name}.follows holds {followed!r} (stream names)")
        for capability in cls.capabilities:
            self.assertIsInstance(capability, Capability)
        if cls.schema is not None:
            self.assertTrue(os.path.isdir(cls.schema), f"{name}.schema {cls.schema!r} is not a directory")

    def test_conformance_worker_type_is_registered(self) -> None:
        """The registry finds the type under its name, and every stream it writes or follows."""
        from synflow import registry

        cls = self.worker_type
        try:
            registered = registry.worker_type(cls.name)
        except KeyError as e:
            self.fail(f"no worker type is registered as {cls.name!r} (entry point group synflow.apps): {e}")
        self.assertIs(registered, cls, f"{cls.name!r} is registered as another class ({registered!r})")
        streams = registry.streams()
        for stream in cls.writes:
            self.assertIn(stream.name, streams, f"{cls.name} writes the unregistered stream {stream.name!r}")
            self.assertEqual(streams[stream.name], stream,
                             f"{cls.name} writes another definition of {stream.name!r} than the registered one")
        for followed in cls.follows:
            self.assertIn(followed, streams, f"{cls.name} follows the unregistered stream {followed!r}")

    def test_conformance_config_section(self) -> None:
        """The config section structures from {} to its defaults and names an unknown key as <section>.<key>."""
        cls = self.worker_type
        section = cls.config
        if section is None:
            self.assertIsNone(self.config_yaml, f"config_yaml is set but {cls.name} has no config section")
            return
        self.assertIsInstance(section, Section)
        self.assertTrue(attrs.has(section.type), f"{cls.name}'s section type must be an attrs class")
        self.assertNotIn(section.key, core_keys(), f"{cls.name}'s section {section.key!r} is one of synflow's keys")
        fields = attrs.fields(section.type)
        required = [f.name for f in fields if f.default is attrs.NOTHING]
        if required:
            with self.assertRaises(ConfigError) as missing:
                structure(section.type, {}, {}, section.key)
            self.assertEqual(missing.exception.key, f"{section.key}.{required[0]}")
        else:
            self.assertEqual(structure(section.type, {}, {}, section.key), section.type())
        unknown = "no_such_key"
        while unknown in {f.name for f in fields}:
            unknown += "_really"
        with self.assertRaises(ConfigError) as refused:
            structure(section.type, {unknown: 1}, {section.key: "conformance.yaml"}, section.key)
        self.assertEqual(refused.exception.key, f"{section.key}.{unknown}")
        self.assertEqual(refused.exception.path, "conformance.yaml")
        self.assertIn(f"{section.key}.{unknown}", str(refused.exception))
        if self.config_yaml is not None:
            import yaml

            data = yaml.safe_load(self.config_yaml)
            self.assertIsInstance(data, dict, "config_yaml must be a mapping")
            self.assertIn(section.key, data, f"config_yaml must hold the {section.key!r} section")
            value: Any = structure(section.type, data[section.key], {}, section.key)
            self.assertIsInstance(value, section.type)
