"""The stream audit log: JSON Lines records the Spark token validator reads.

Every process appends, under ``audit.dir``:

* ``writer_logs/<instance>/part-*.jsonl`` -- one record per fact a writer
  completed: ``stream, writer, stream_id, room_id, event_id, reserved_at,
  completed_at, outcome`` (``ok`` or ``aborted``), and one record per
  position announcement with ``kind: "position"`` (``stream, writer,
  position, announced_at``);
* ``token_logs/<instance>/part-*.jsonl`` -- one record per token issued to
  a client (``reader, stream, since, token, issued_at, issued_by,
  delivered, rooms``);
* ``instance_map/<instance>.jsonl`` -- the ``instance_id, instance_name``
  rows this process knows.

Timestamps are integer microseconds since the epoch. Records are buffered
and flushed to disk every ``flush_interval_s`` (and on close); a file is
rotated when it passes ``max_bytes``. Token records are written through
before the sync response leaves, and a writer's fact records after every
completed batch, before anything announces them, so a killed process loses
none that a client could have seen. Writing is cheap, so the log is on by
default (``audit.enabled``); ``scripts/bench`` measures its cost.

The log never breaks a write or a sync: a failed write (a full disk, a
read-only mount) drops the records it held, counts the failure
(``synflow_audit_write_errors_total``), logs it at most once a minute and
makes :attr:`AuditLog.problem` (shown by ``/health``) say so. Writing is
retried with the next records and every :data:`RETRY_INTERVAL_S`; the first
write that works puts a gap record (:mod:`synflow.audit_gaps`) before them.
Old rotated files are deleted by ``audit.retain_bytes`` / ``audit.retain_days``
(:mod:`synflow.audit_files`).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from synflow.audit_files import PartFiles
from synflow.audit_gaps import GapTracker
from synflow.json_encoding import compact_json
from synflow.metrics import counter

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.5
#: While writing fails, try again this often even when no new record arrives.
RETRY_INTERVAL_S = 5.0
#: A failing audit log is logged at most once per this many seconds.
ERROR_LOG_INTERVAL_S = 60.0

WRITE_ERRORS = counter("synflow_audit_write_errors_total", "Failed writes to the audit log", ["log"])
RECORDS_LOST = counter("synflow_audit_records_lost_total", "Audit records dropped because a write failed", ["log"])


def now_us(clock: IReactorTime) -> int:
    """The clock's time in integer microseconds since the epoch."""
    return int(clock.seconds() * 1_000_000)


def _line(record: Mapping[str, Any]) -> str:
    return compact_json(record)


class AuditLog:
    """Appends audit records for one process.

    Args:
        directory: the audit root (``audit.dir``).
        instance_name: this process's instance name.
        clock: for flush timers.
        max_bytes: rotate a part file past this size.
        enabled: when False every method is a no-op.
        retain_bytes: keep at most this many bytes of rotated files per log (None: keep all).
        retain_days: delete rotated files older than this many days (None: keep all).
    """

    def __init__(
        self,
        directory: str,
        instance_name: str,
        clock: IReactorTime,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        enabled: bool = True,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        retain_bytes: int | None = None,
        retain_days: float | None = None,
    ) -> None:
        self.enabled = enabled
        self.directory = directory
        self.instance_name = instance_name
        self.clock = clock
        self.flush_interval_s = flush_interval_s
        retain: dict[str, Any] = {"retain_bytes": retain_bytes, "retain_days": retain_days}
        self._writer = PartFiles(os.path.join(directory, "writer_logs", instance_name), max_bytes, clock, **retain)
        self._tokens = PartFiles(os.path.join(directory, "token_logs", instance_name), max_bytes, clock, **retain)
        self._writer_buffer: list[dict[str, Any]] = []
        self._token_buffer: list[dict[str, Any]] = []
        self._instances: dict[int, str] = {}
        self._instances_pending = False
        self._timer: IDelayedCall | None = None
        self._retry: IDelayedCall | None = None
        self.gaps = GapTracker(instance_name)
        self.failing_since: float | None = None
        self.last_error: str | None = None
        self._last_error_logged: float | None = None
        self._errors_unlogged = 0
        self.write_errors = 0
        self.gaps_written = 0
        self.facts_logged = 0
        self.tokens_logged = 0
        if enabled:
            self._writer.apply_retention()
            self._tokens.apply_retention()

    @property
    def problem(self) -> str | None:
        """Why the audit log is degraded (for ``/health``), or None while it writes."""
        if self.failing_since is None:
            return None
        return (f"audit log: writes under {self.directory} failing since "
                f"{_iso(self.failing_since)}: {self.last_error}; {self.gaps.records_lost} record(s) "
                "dropped so far (a gap record is written when writing works again)")

    # -- records --------------------------------------------------------------------

    def fact(
        self,
        stream: str,
        stream_id: int,
        *,
        room_id: str | None,
        event_id: str | None,
        reserved_at: int,
        completed_at: int | None,
        ok: bool,
    ) -> None:
        """A writer completed (or aborted) one fact."""
        if not self.enabled:
            return
        self._writer_buffer.append({
            "stream": stream, "writer": self.instance_name, "stream_id": stream_id,
            "room_id": room_id, "event_id": event_id, "reserved_at": reserved_at,
            "completed_at": completed_at, "outcome": "ok" if ok else "aborted",
        })
        self.facts_logged += 1
        self._schedule()

    def position(self, stream: str, position: int) -> None:
        """This writer announced a new position."""
        if not self.enabled:
            return
        self._writer_buffer.append({
            "kind": "position", "stream": stream, "writer": self.instance_name,
            "position": position, "announced_at": now_us(self.clock),
        })
        self._schedule()

    def token(
        self,
        *,
        reader: str,
        stream: str,
        since: str | None,
        token: str,
        delivered: Iterable[str],
        rooms: Iterable[str] | None = None,
        issued_at: int | None = None,
    ) -> None:
        """A token (``next_batch``) was handed to a client with these events."""
        if not self.enabled:
            return
        record: dict[str, Any] = {
            "reader": reader, "stream": stream, "since": since, "token": token,
            "issued_at": now_us(self.clock) if issued_at is None else issued_at,
            "issued_by": self.instance_name, "delivered": list(delivered),
        }
        if rooms is not None:
            record["rooms"] = sorted(rooms)
        self._token_buffer.append(record)
        self.tokens_logged += 1
        # Written through before the response leaves: a token a client may
        # hold is on disk even if the process is killed right after.
        self._flush_tokens()

    def flush_facts(self) -> None:
        """Write buffered writer records now (after each completed batch)."""
        if self.enabled:
            self._flush_writer()

    def recovery_view(self, stream: str) -> tuple[int, dict[int, int]]:
        """What this writer's log holds of ``stream``, for re-recording facts after a crash.

        Returns the last position the log records as announced (0 if none)
        and the ``reserved_at`` of every fact read, by stream ID. Part files
        are read newest first until one with an announcement has been read
        and an older part holds no fact above it. Facts above the last
        announced position may have been logged before that announcement
        (they completed out of order); every fact at or below it was logged
        before it. So every fact this writer could have logged above the
        position is in the result.
        """
        directory = self._writer.directory
        if not os.path.isdir(directory):
            return 0, {}
        names = [n for n in os.listdir(directory) if n.endswith(".jsonl")]
        paths = sorted((os.path.join(directory, n) for n in names),
                       key=lambda p: (os.path.getmtime(p), p), reverse=True)
        announced: int | None = None
        reserved: dict[int, int] = {}
        for path in paths:
            above = False
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by a crash
                    if record.get("stream") != stream:
                        continue
                    if record.get("kind") == "position":
                        position = int(record.get("position") or 0)
                        announced = position if announced is None else max(announced, position)
                    elif record.get("kind") is None:
                        stream_id = int(record.get("stream_id") or 0)
                        reserved[stream_id] = int(record.get("reserved_at") or 0)
                        above = above or announced is None or stream_id > announced
            if announced is not None and not above:
                break
        return announced or 0, reserved

    def instances(self, mapping: Mapping[int, str]) -> None:
        """Record instance IDs this process knows (rewritten when it grows)."""
        if not self.enabled:
            return
        new = {i: n for i, n in mapping.items() if self._instances.get(i) != n}
        if not new:
            return
        self._instances.update(new)
        self._instances_pending = True
        self._write_instances()

    def _write_instances(self) -> None:
        directory = os.path.join(self.directory, "instance_map")
        path = os.path.join(directory, f"{self.instance_name}.jsonl")
        tmp = path + ".tmp"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                for instance_id, name in sorted(self._instances.items()):
                    f.write(json.dumps({"instance_id": instance_id, "instance_name": name}) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            self._failed("instance_map", e, 0)
            return
        self._instances_pending = False
        self._written()

    # -- flushing -----------------------------------------------------------------------

    def _schedule(self) -> None:
        if self._timer is None:
            self._timer = self.clock.callLater(self.flush_interval_s, self.flush)

    def flush(self) -> None:
        """Write buffered records to disk now (never raises: see the module docstring)."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if not self.enabled:
            return
        self._flush_writer()
        self._flush_tokens()
        if self._instances_pending:
            self._write_instances()

    def _flush_writer(self) -> None:
        records, self._writer_buffer = self._writer_buffer, []
        gaps = self.gaps.writer_gap_records(now_us(self.clock)) if self.gaps.writer_pending else []
        if not records and not gaps:
            return
        try:
            self._writer.write([_line(r) for r in gaps + records])
        except OSError as e:
            self.gaps.lost_writer_records(records, now_us(self.clock), _reason(e))
            self._failed("writer", e, len(records))
            return
        if gaps:
            self.gaps.writer_reported()
            self.gaps_written += len(gaps)
        self._written()

    def _flush_tokens(self) -> None:
        records, self._token_buffer = self._token_buffer, []
        gaps = self.gaps.token_gap_records(now_us(self.clock)) if self.gaps.tokens_pending else []
        if not records and not gaps:
            return
        try:
            self._tokens.write([_line(r) for r in gaps + records])
        except OSError as e:
            self.gaps.lost_token_records(records, now_us(self.clock), _reason(e))
            self._failed("tokens", e, len(records))
            return
        if gaps:
            self.gaps.tokens_reported()
            self.gaps_written += len(gaps)
        self._written()

    def _failed(self, log: str, error: OSError, lost: int) -> None:
        """A write failed: count it, log it (at most once a minute) and keep retrying."""
        now = self.clock.seconds()
        WRITE_ERRORS.labels(log=log).inc()
        if lost:
            RECORDS_LOST.labels(log=log).inc(lost)
        self.write_errors += 1
        self._errors_unlogged += 1
        self.last_error = _reason(error)
        if self.failing_since is None:
            self.failing_since = now
        if self._last_error_logged is None or now - self._last_error_logged >= ERROR_LOG_INTERVAL_S:
            logger.error(
                "audit log: cannot write the %s log under %s: %s (%d failed write(s) since the last "
                "message, %d record(s) dropped in all; writes and syncs go on, and a gap record will "
                "say what is missing once writing works again)",
                log, self.directory, self.last_error, self._errors_unlogged, self.gaps.records_lost,
            )
            self._last_error_logged = now
            self._errors_unlogged = 0
        if self._retry is None or not self._retry.active():
            self._retry = self.clock.callLater(RETRY_INTERVAL_S, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        self.flush()

    def _written(self) -> None:
        if self.failing_since is None or self.gaps.writer_pending or self.gaps.tokens_pending \
                or self._instances_pending:
            return
        logger.warning("audit log: writing under %s works again after failing since %s; the gap is recorded",
                       self.directory, _iso(self.failing_since))
        self.failing_since = None
        self.last_error = None
        self._last_error_logged = None
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None

    def close(self) -> None:
        """Flush and close the files."""
        self.flush()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        self._writer.close()
        self._tokens.close()


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")
