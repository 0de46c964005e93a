"""An audit log that cannot write (an injected full disk) never breaks a write, and reports its gap.

Every test runs the production audit log and ID generators on an injected clock; the disk is
"full" while :data:`synflow.audit_files.os_write` raises ``ENOSPC``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow import audit_files, registry
from synflow.audit import ERROR_LOG_INTERVAL_S, RETRY_INTERVAL_S, AuditLog
from synflow.audit_files import PartFiles
from synflow.audit_gaps import MAX_GAP_READERS
from synflow.replication.handler import ReplicationHandler
from synflow.storage.id_generators import MultiWriterIdGenerator, StreamWriteContext
from synflow.streams import EVENTS, EventsRow
from tests.streams.test_audit import T0, WRITER, _Discard, records, sqlite_txn


class _Disk:
    """Makes every audit write fail with ENOSPC while ``full``; can let one write land half first."""

    def __init__(self) -> None:
        self.full = False
        self.torn_once = False
        self.real = audit_files.os_write

    def write(self, fd: int, data: Any) -> int:
        if self.torn_once:
            self.torn_once = False
            self.full = True
            return self.real(fd, bytes(data)[: max(1, len(data) // 2)])
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(fd, data)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.messages.append(record.getMessage())


def _errors(log: str) -> float:
    return REGISTRY.get_sample_value("synflow_audit_write_errors_total", {"log": log}) or 0.0


class AuditFailureTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(T0)
        self.dir = os.path.abspath(self.mktemp())
        self.disk = _Disk()
        self.patch(audit_files, "os_write", self.disk.write)
        self.logged = _Records()
        logging.getLogger("synflow.audit").addHandler(self.logged)
        self.addCleanup(logging.getLogger("synflow.audit").removeHandler, self.logged)

    def _audit(self, **kwargs: Any) -> AuditLog:
        audit = AuditLog(self.dir, WRITER, self.clock, **kwargs)
        self.addCleanup(audit.close)
        return audit

    def _write(self, gen: MultiWriterIdGenerator, n: int = 1) -> list[int]:
        """One committed write of ``n`` events through the real write context."""
        handle = gen.tracker.begin_fetch()
        ctx = StreamWriteContext(self.txn, {"events": gen})
        ids = ctx.allocate("events", n)
        for sid in ids:
            ctx.add_rows("events", sid, [EventsRow(f"$e{sid}:hs", "!r:hs", "m.room.message", None, "@u:hs", None)],
                         room_id="!r:hs", event_id=f"$e{sid}:hs")
        self.clock.advance(0.01)
        gen.finish(handle, ids, ctx.payloads["events"], ok=True)
        return ids

    def test_full_disk_never_stops_completion_or_announcements(self) -> None:
        """With the disk full, writes still complete, positions move and are announced; nothing raises."""
        audit = self._audit()
        self.txn = sqlite_txn()
        gen = MultiWriterIdGenerator(EVENTS, WRITER, 1, self.clock, audit)
        announced: list[int] = []
        gen.add_listener(lambda facts, position: announced.append(position))
        handler = ReplicationHandler(WRITER, self.clock, streams=registry.streams(), sources={}, generators={"events": gen},
                                     audit=audit)
        handler.set_transport(_Discard())
        before, tokens_before = _errors("writer"), _errors("tokens")
        self._write(gen)  # written normally
        self.disk.full = True
        lost = self._write(gen, 3) + self._write(gen, 2)
        self.assertEqual(gen.position, max(lost))
        self.assertEqual(announced[-1], max(lost))
        self.assertEqual(_errors("writer") - before, 2)
        self.assertIsNotNone(audit.problem)
        self.assertIn("No space left on device", audit.problem or "")
        self.assertEqual(audit.gaps.records_lost, 7)  # 5 facts and 2 position announcements
        # A token record fails too, but the caller (a sync) is not told.
        audit.token(reader="@u:hs", stream="events", since=None, token="s9", delivered=["$e2:hs"])
        self.assertEqual(_errors("tokens") - tokens_before, 1)

    def test_errors_are_logged_at_most_once_a_minute(self) -> None:
        """Many failed writes within a minute give one ERROR message; the next minute gives one more."""
        audit = self._audit()
        self.disk.full = True
        for i in range(20):
            audit.fact("events", 2 + i, room_id=None, event_id=None, reserved_at=1, completed_at=2, ok=True)
            audit.flush_facts()
            self.clock.advance(1)
        self.assertEqual(len(self.logged.messages), 1)
        self.clock.advance(ERROR_LOG_INTERVAL_S)
        audit.fact("events", 30, room_id=None, event_id=None, reserved_at=1, completed_at=2, ok=True)
        audit.flush_facts()
        self.assertEqual(len(self.logged.messages), 2)
        self.assertIn("failed write(s)", self.logged.messages[1])

    def test_gap_record_comes_first_when_space_returns(self) -> None:
        """Once writes work again the log resumes with a gap record naming the lost stream ids and window."""
        audit = self._audit()
        self.txn = sqlite_txn()
        gen = MultiWriterIdGenerator(EVENTS, WRITER, 1, self.clock, audit)
        (first,) = self._write(gen)
        self.disk.full = True
        failed_at = self.clock.seconds()
        lost = self._write(gen, 2) + self._write(gen, 1)
        audit.position("events", max(lost))
        self.clock.advance(1)  # the position record's flush fails too
        self.disk.full = False
        (after,) = self._write(gen)
        written = records(self.dir)
        facts = [r for r in written if r.get("kind") is None]
        self.assertEqual([r["stream_id"] for r in facts], [first, after])
        (gap,) = [r for r in written if r.get("kind") == "gap"]
        self.assertEqual(written.index(gap), written.index(facts[1]) - 1)  # just before the resumed records
        self.assertEqual((gap["stream"], gap["writer"], gap["from_stream_id"], gap["to_stream_id"]),
                         ("events", WRITER, min(lost), max(lost)))
        self.assertEqual((gap["records"], gap["facts"], gap["error"]), (4, 3, "No space left on device"))
        self.assertLessEqual(gap["lost_from"], int(failed_at * 1_000_000))
        self.assertGreaterEqual(gap["lost_until"], int(failed_at * 1_000_000))
        self.assertIsNone(audit.problem)

    def test_retry_timer_writes_the_gap_without_new_records(self) -> None:
        """With no further traffic, the retry timer writes the token gap once space returns."""
        audit = self._audit()
        self.disk.full = True
        for i in range(3):
            audit.token(reader=f"@u{i}:hs", stream="events", since=None, token=f"s{i + 2}", delivered=[])
        self.disk.full = False
        self.assertEqual(records(self.dir, "token_logs"), [])
        self.clock.advance(RETRY_INTERVAL_S)
        (gap,) = records(self.dir, "token_logs")
        self.assertEqual((gap["kind"], gap["issued_by"], gap["readers"], gap["records"]),
                         ("gap", WRITER, ["@u0:hs", "@u1:hs", "@u2:hs"], 3))
        self.assertIsNone(audit.problem)

    def test_many_readers_make_a_gap_for_every_reader(self) -> None:
        """Past MAX_GAP_READERS lost readers the token gap concerns every reader (readers is null)."""
        audit = self._audit()
        self.disk.full = True
        for i in range(MAX_GAP_READERS + 1):
            audit.token(reader=f"@u{i}:hs", stream="events", since=None, token="s2", delivered=[])
        self.disk.full = False
        audit.flush()
        (gap,) = records(self.dir, "token_logs")
        self.assertIsNone(gap["readers"])

    def test_a_torn_write_leaves_no_half_line(self) -> None:
        """A write that lands half before the disk fills is cut back: every line on disk parses."""
        audit = self._audit()
        audit.fact("events", 2, room_id=None, event_id=None, reserved_at=1, completed_at=2, ok=True)
        audit.flush_facts()
        self.disk.torn_once = True
        audit.fact("events", 3, room_id="!r:hs", event_id="$long:hs", reserved_at=1, completed_at=2, ok=True)
        audit.flush_facts()
        self.disk.full = False
        audit.fact("events", 4, room_id=None, event_id=None, reserved_at=3, completed_at=4, ok=True)
        audit.flush_facts()
        written = records(self.dir)  # json.loads of every line: raises on a torn one
        self.assertEqual([(r.get("kind"), r.get("stream_id")) for r in written],
                         [(None, 2), ("gap", None), (None, 4)])
        self.assertEqual((written[1]["from_stream_id"], written[1]["to_stream_id"]), (3, 3))

    def test_instance_map_is_written_once_space_returns(self) -> None:
        """An instance map that could not be written is written by a later flush."""
        audit = self._audit()

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        patched = self.patch(os, "replace", refuse)
        audit.instances({1: "master"})
        patched.restore()
        self.assertIsNotNone(audit.problem)
        path = os.path.join(self.dir, "instance_map", f"{WRITER}.jsonl")
        self.assertFalse(os.path.exists(path))
        audit.flush()
        self.assertTrue(os.path.exists(path))
        self.assertIsNone(audit.problem)


class RetentionTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(T0)
        self.dir = os.path.abspath(self.mktemp())

    def _fill(self, files: PartFiles, n: int) -> None:
        for i in range(n):
            files.write([json.dumps({"n": i, "pad": "x" * 80}, separators=(",", ":"))])

    def test_retain_bytes_deletes_oldest_rotated_files(self) -> None:
        """Past retain_bytes the oldest rotated files go; the active file and the newest stay."""
        files = PartFiles(self.dir, 300, self.clock, retain_bytes=700)
        self.addCleanup(files.close)
        self._fill(files, 60)
        names = sorted(os.listdir(self.dir))
        sizes = sum(os.path.getsize(os.path.join(self.dir, n)) for n in names)
        self.assertGreater(files.files_deleted, 5)
        self.assertLessEqual(sizes, 700 + 400)  # retained rotated files plus the active one
        newest = max(names, key=lambda n: int(n.rsplit("-", 1)[1].split(".")[0]))
        with open(os.path.join(self.dir, newest), encoding="utf-8") as f:
            self.assertIn('"n":59', f.read())

    def test_retain_days_deletes_old_files_never_the_active_one(self) -> None:
        """Rotated files last written longer ago than retain_days are deleted at the next rotation."""
        files = PartFiles(self.dir, 50, self.clock, retain_days=1)
        self.addCleanup(files.close)
        self._fill(files, 3)  # three files, the last active
        old = sorted(os.listdir(self.dir))
        for name in old:
            os.utime(os.path.join(self.dir, name), (T0 - 3 * 86400, T0 - 3 * 86400))
        self.clock.advance(10)
        self._fill(files, 1)  # rotates: the old rotated files go
        left = sorted(os.listdir(self.dir))
        self.assertEqual(files.files_deleted, 3)
        self.assertEqual(len(left), 1)
        self.assertNotIn(left[0], old)

    def test_no_retention_keeps_everything(self) -> None:
        """Without retain_bytes and retain_days every file stays."""
        files = PartFiles(self.dir, 50, self.clock)
        self.addCleanup(files.close)
        self._fill(files, 10)
        self.assertEqual((len(os.listdir(self.dir)), files.files_deleted), (10, 0))
