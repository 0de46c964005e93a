"""The stream audit log on an injected clock: record shapes, µs timestamps, rotation, switching off."""

from __future__ import annotations

import glob
import json
import os
import sqlite3
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow import registry
from synflow.audit import FLUSH_INTERVAL_S, AuditLog
from synflow.replication.handler import ReplicationHandler
from synflow.storage.engines import Txn, get_engine
from synflow.storage.id_generators import MultiWriterIdGenerator, StreamWriteContext
from synflow.streams import EVENTS, EventsRow

WRITER = "persister1"
#: An epoch time exactly representable as a float, so µs conversions are exact.
T0 = 1_700_000_000.25

FACT_KEYS = {"stream", "writer", "stream_id", "room_id", "event_id", "reserved_at", "completed_at", "outcome"}
POSITION_KEYS = {"kind", "stream", "writer", "position", "announced_at"}
TOKEN_KEYS = {"reader", "stream", "since", "token", "issued_at", "issued_by", "delivered", "rooms"}


def records(directory: str, kind: str = "writer_logs") -> list[dict[str, Any]]:
    """Every record under ``<directory>/<kind>/<instance>/``, part files in order."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, kind, "*", "part-*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            out += [json.loads(line) for line in f]
    return out


def sqlite_txn() -> Txn:
    """A real Txn over an in-memory SQLite database holding the events sequence row."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    cursor = conn.cursor()
    cursor.execute("CREATE TABLE stream_sequences (stream_name TEXT PRIMARY KEY, last_id BIGINT NOT NULL)")
    cursor.execute("INSERT INTO stream_sequences VALUES ('events', 1)")
    return Txn(cursor, get_engine("sqlite"), "test")


def is_int(value: Any) -> bool:
    return type(value) is int


class AuditLogTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(T0)
        self.dir = os.path.abspath(self.mktemp())

    def _audit(self, **kwargs: Any) -> AuditLog:
        audit = AuditLog(self.dir, WRITER, self.clock, **kwargs)
        self.addCleanup(audit.close)
        return audit

    def test_writer_records_from_a_real_write(self) -> None:
        """A completed write's records have exactly the documented keys and integer µs times from the clock."""
        audit = self._audit()
        gen = MultiWriterIdGenerator(EVENTS, WRITER, 1, self.clock, audit)
        handler = ReplicationHandler(WRITER, self.clock, streams=registry.streams(), sources={}, generators={"events": gen},
                                     audit=audit)
        handler.set_transport(_Discard())
        ok_handle, bad_handle = gen.tracker.begin_fetch(), gen.tracker.begin_fetch()
        ctx = StreamWriteContext(sqlite_txn(), {"events": gen})
        (committed,) = ctx.allocate("events")  # reserved at T0
        ctx.add_rows("events", committed, [EventsRow("$a:hs", "!r:hs", "m.room.message", None, "@u:hs", None)],
                     room_id="!r:hs", event_id="$a:hs")
        self.clock.advance(0.125)
        rolled_back = StreamWriteContext(ctx.txn, {"events": gen})
        (aborted,) = rolled_back.allocate("events")  # reserved at T0 + 0.125
        self.clock.advance(0.5)
        gen.finish(bad_handle, [aborted], rolled_back.payloads["events"], ok=False)  # at T0 + 0.625
        self.clock.advance(0.25)
        gen.finish(ok_handle, [committed], ctx.payloads["events"], ok=True)  # at T0 + 0.875: both visible

        facts = [r for r in records(self.dir) if "kind" not in r]
        self.assertEqual([set(r) for r in facts], [FACT_KEYS, FACT_KEYS])
        self.assertEqual(facts, [
            {"stream": "events", "writer": WRITER, "stream_id": aborted, "room_id": None, "event_id": None,
             "reserved_at": 1_700_000_000_375_000, "completed_at": 1_700_000_000_875_000, "outcome": "aborted"},
            {"stream": "events", "writer": WRITER, "stream_id": committed, "room_id": "!r:hs", "event_id": "$a:hs",
             "reserved_at": 1_700_000_000_250_000, "completed_at": 1_700_000_001_125_000,
             "outcome": "ok"},
        ])
        self.assertTrue(all(is_int(r["reserved_at"]) and is_int(r["completed_at"]) for r in facts))

        self.clock.advance(FLUSH_INTERVAL_S)  # position records wait for the flush timer
        positions = [r for r in records(self.dir) if r.get("kind") == "position"]
        self.assertEqual([set(r) for r in positions], [POSITION_KEYS])
        self.assertEqual(positions[0], {"kind": "position", "stream": "events", "writer": WRITER,
                                        "position": aborted, "announced_at": 1_700_000_001_125_000})

    def test_position_records_wait_for_the_flush_timer(self) -> None:
        """Position records reach the disk after flush_interval_s on the clock; fact records at once."""
        audit = self._audit()
        audit.position("events", 5)
        self.assertEqual(records(self.dir), [])
        self.clock.advance(FLUSH_INTERVAL_S - 0.125)
        self.assertEqual(records(self.dir), [])
        self.clock.advance(0.125)
        self.assertEqual([r["position"] for r in records(self.dir)], [5])
        audit.fact("events", 6, room_id=None, event_id=None, reserved_at=1, completed_at=2, ok=True)
        audit.flush_facts()
        self.assertEqual([r.get("stream_id") for r in records(self.dir)], [None, 6])

    def test_token_and_instance_records(self) -> None:
        """Token records (written through at once) and the instance map carry exactly their documented keys."""
        audit = self._audit()
        audit.token(reader="synchrotron1", stream="events", since="s5", token="m7~2.9",
                    delivered=["$a:hs"], rooms={"!b:hs", "!a:hs"})
        (token,) = records(self.dir, "token_logs")
        self.assertEqual(set(token), TOKEN_KEYS)
        self.assertEqual(token["issued_at"], 1_700_000_000_250_000)
        self.assertEqual((token["issued_by"], token["rooms"]), (WRITER, ["!a:hs", "!b:hs"]))
        audit.instances({2: "persister2", 1: "master"})
        with open(os.path.join(self.dir, "instance_map", f"{WRITER}.jsonl"), encoding="utf-8") as f:
            self.assertEqual([json.loads(line) for line in f], [
                {"instance_id": 1, "instance_name": "master"}, {"instance_id": 2, "instance_name": "persister2"},
            ])

    def test_rotation_by_size(self) -> None:
        """A small max_bytes rotates the writer log over several part files, each record in exactly one, in order."""
        max_bytes = 400
        audit = self._audit(max_bytes=max_bytes)
        for sid in range(2, 42):
            audit.fact("events", sid, room_id="!r:hs", event_id=f"$e{sid}:hs", reserved_at=sid, completed_at=sid,
                       ok=True)
            audit.flush_facts()
        audit.close()
        parts = sorted(glob.glob(os.path.join(self.dir, "writer_logs", WRITER, "part-*.jsonl")))
        self.assertGreater(len(parts), 3)
        self.assertEqual([r["stream_id"] for r in records(self.dir)], list(range(2, 42)))
        longest_line = max(len(json.dumps(r, separators=(",", ":"))) + 1 for r in records(self.dir))
        for path in parts[:-1]:  # every rotated file was filled to max_bytes, by less than one more batch
            self.assertGreaterEqual(os.path.getsize(path), max_bytes)
            self.assertLess(os.path.getsize(path), max_bytes + longest_line)

    def test_disabled_writes_nothing(self) -> None:
        """With enabled=False no record is written and no directory is created, whatever is called."""
        audit = self._audit(enabled=False)
        gen = MultiWriterIdGenerator(EVENTS, WRITER, 1, self.clock, audit)
        handle = gen.tracker.begin_fetch()
        ctx = StreamWriteContext(sqlite_txn(), {"events": gen})
        ids = ctx.allocate("events", 2)
        gen.finish(handle, ids, ctx.payloads["events"], ok=True)
        audit.position("events", 3)
        audit.token(reader="r", stream="events", since=None, token="s3", delivered=[])
        audit.instances({1: "master"})
        audit.flush_facts()
        self.clock.advance(10)
        audit.close()
        self.assertEqual(gen.position, 3)
        self.assertFalse(os.path.exists(self.dir))
        self.assertEqual((audit.facts_logged, audit.tokens_logged), (0, 0))


class _Discard:
    def send_command(self, cmd: object) -> None:
        pass
