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

    async def test_event_below_logged_ids_is_recovered(self) -> None:
        """An event committed below IDs that completed and were logged before it is re-recorded once."""
        db = await make_database(self, "sqlite")
        directory = os.path.abspath(self.mktemp())
        audit = AuditLog(directory, WRITER, reactor)
        self.addCleanup(audit.close)
        base = 1_800_000_000_000_000
        # The position reached 358; 360, 362 and 363 then completed and were
        # logged while 359's transaction was still running. 359 committed, and
        # the process died before it could log or announce it; 364 committed
        # after the last log write.
        audit.fact("events", 358, room_id="!r:hs", event_id="$358", reserved_at=base, completed_at=base + 9,
                   ok=True)
        audit.position("events", 358)
        for sid in (360, 362, 363):
            audit.fact("events", sid, room_id="!r:hs", event_id=f"${sid}", reserved_at=base + (sid - 358) * 1000,
                       completed_at=base + (sid - 358) * 1000 + 500, ok=True)
        audit.flush_facts()
        for sid in (358, 359, 360, 362, 363, 364):
            await db.run_interaction("insert", _insert_event_txn, sid, f"${sid}", base // 1000 + (sid - 358))
        # 359's request was received late (after 360's reservation): it is recorded
        # no later than 360's reservation, so the log's IDs still grow with time.
        await db.run_interaction("delete", lambda txn: txn.execute(
            "UPDATE events SET received_ts = ? WHERE stream_ordering = 359", (base // 1000 + 3,)))

        self.assertEqual(await recover_audit(db, audit, WRITER), 2)

        records = [r for path in glob.glob(os.path.join(directory, "writer_logs", WRITER, "*.jsonl"))
                   for r in read_jsonl(path) if r.get("kind") is None]
        by_id = {r["stream_id"]: r for r in records}
        self.assertEqual(sorted(r["stream_id"] for r in records), [358, 359, 360, 362, 363, 364])
        self.assertEqual(by_id[359]["reserved_at"], by_id[360]["reserved_at"])
        self.assertEqual(by_id[359]["completed_at"], by_id[359]["reserved_at"])
        self.assertEqual(by_id[364]["reserved_at"], (base // 1000 + 6) * 1000)
        by_time = sorted(records, key=lambda r: (r["reserved_at"], r["stream_id"]))
        self.assertEqual([r["stream_id"] for r in by_time], [358, 359, 360, 362, 363, 364])
        self.assertEqual(await recover_audit(db, audit, WRITER), 0)
