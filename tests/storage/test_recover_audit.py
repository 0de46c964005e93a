"""Re-recording committed events missing from a writer's audit log after a crash."""

from __future__ import annotations

import glob
import os

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from synflow.audit import AuditLog
from synflow.storage.id_generators import recover_audit
from tests.cluster import read_jsonl
from tests.dbutil import make_database

WRITER = "persister1"
RESERVED_319 = 1_800_000_000_742_845  # µs: reserved after the 322 request below was received


def _insert_event_txn(txn, stream_ordering: int, event_id: str, received_ms: int) -> None:
    txn.execute(
        "INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, sender, content, "
        "origin_server_ts, origin, depth, received_ts) VALUES (?, ?, ?, '!r:hs', 'm.text', '@u:hs', '{}', ?, "
        "'hs', 1, ?)",
        (stream_ordering, WRITER, event_id, received_ms, received_ms),
    )


class RecoverAuditTest(TestCase):
    async def test_recovered_facts_never_reserved_before_the_audited_ones(self) -> None:
        """A recovered event's received time precedes an audited lower ID's reservation: it is clamped."""
        db = await make_database(self, "sqlite")
        directory = os.path.abspath(self.mktemp())
        audit = AuditLog(directory, WRITER, reactor)
        self.addCleanup(audit.close)
        # Before the crash: 319 was reserved, committed and audited; 322 (whose request
        # arrived 2.8 ms before 319's reservation) and 323 (received later) were committed
        # but the process died before auditing them.
        audit.fact("events", 319, room_id="!r:hs", event_id="$319", reserved_at=RESERVED_319,
                   completed_at=RESERVED_319 + 500, ok=True)
        audit.flush_facts()
        await db.run_interaction("insert", _insert_event_txn, 319, "$319", RESERVED_319 // 1000)
        await db.run_interaction("insert", _insert_event_txn, 322, "$322", RESERVED_319 // 1000 - 2)
        await db.run_interaction("insert", _insert_event_txn, 323, "$323", RESERVED_319 // 1000 + 5)
        # 324's request arrived before 323's (it was reserved after it all the same).
        await db.run_interaction("insert", _insert_event_txn, 324, "$324", RESERVED_319 // 1000 + 4)

        self.assertEqual(await recover_audit(db, audit, WRITER), 3)

        records = {r["stream_id"]: r
                   for path in glob.glob(os.path.join(directory, "writer_logs", WRITER, "*.jsonl"))
                   for r in read_jsonl(path) if r.get("kind") is None}
        self.assertEqual(sorted(records), [319, 322, 323, 324])
        # 322 is recorded no earlier than 319's reservation (IDs and reservations grow together) ...
        self.assertEqual(records[322]["reserved_at"], RESERVED_319)
        self.assertEqual(records[322]["completed_at"], RESERVED_319)
        # ... 323 keeps its own, later, received time, and 324 is not recorded before 323.
        self.assertEqual(records[323]["reserved_at"], (RESERVED_319 // 1000 + 5) * 1000)
        self.assertEqual(records[324]["reserved_at"], records[323]["reserved_at"])
        by_time = sorted(records.values(), key=lambda r: (r["reserved_at"], r["stream_id"]))
        self.assertEqual([r["stream_id"] for r in by_time], [319, 322, 323, 324])
        # Nothing is recorded twice on a second start-up.
        self.assertEqual(await recover_audit(db, audit, WRITER), 0)
