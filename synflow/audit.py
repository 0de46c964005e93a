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
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IReactorTime

FLUSH_INTERVAL_S = 0.5


def now_us(clock: IReactorTime) -> int:
    """The clock's time in integer microseconds since the epoch."""
    return int(clock.seconds() * 1_000_000)


class _JsonlFile:
    """An append-only, size-rotated JSONL part file series in one directory."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._buffer: list[str] = []
        self._file: Any = None
        self._size = 0
        self._part = 0

    def add(self, record: Mapping[str, Any]) -> None:
        self._buffer.append(json.dumps(record, separators=(",", ":")))

    def flush(self) -> None:
        if not self._buffer:
            return
        data = "\n".join(self._buffer) + "\n"
        self._buffer.clear()
        if self._file is None or self._size >= self.max_bytes:
            self._rotate()
        self._file.write(data)
        self._file.flush()
        self._size += len(data)

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
        os.makedirs(self.directory, exist_ok=True)
        while True:
            self._part += 1
            path = os.path.join(self.directory, f"part-{os.getpid()}-{self._part:05d}.jsonl")
            if not os.path.exists(path):
                break
        self._file = open(path, "a", encoding="utf-8")
        self._size = 0

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


class AuditLog:
    """Appends audit records for one process.

    Args:
        directory: the audit root (``audit.dir``).
        instance_name: this process's instance name.
        clock: for flush timers.
        max_bytes: rotate a part file past this size.
        enabled: when False every method is a no-op.
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
    ) -> None:
        self.enabled = enabled
        self.directory = directory
        self.instance_name = instance_name
        self.clock = clock
        self.flush_interval_s = flush_interval_s
        self._writer = _JsonlFile(os.path.join(directory, "writer_logs", instance_name), max_bytes)
        self._tokens = _JsonlFile(os.path.join(directory, "token_logs", instance_name), max_bytes)
        self._instances: dict[int, str] = {}
        self._timer: IDelayedCall | None = None
        self.facts_logged = 0
        self.tokens_logged = 0

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
        self._writer.add({
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
        self._writer.add({
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
        self._tokens.add(record)
        self.tokens_logged += 1
        # Written through before the response leaves: a token a client may
        # hold is on disk even if the process is killed right after.
        self._tokens.flush()

    def flush_facts(self) -> None:
        """Write buffered writer records now (after each completed batch)."""
        if self.enabled:
            self._writer.flush()

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
        directory = os.path.join(self.directory, "instance_map")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.instance_name}.jsonl")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for instance_id, name in sorted(self._instances.items()):
                f.write(json.dumps({"instance_id": instance_id, "instance_name": name}) + "\n")
        os.replace(tmp, path)

    # -- flushing -----------------------------------------------------------------------

    def _schedule(self) -> None:
        if self._timer is None:
            self._timer = self.clock.callLater(self.flush_interval_s, self.flush)

    def flush(self) -> None:
        """Write buffered records to disk now."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._writer.flush()
        self._tokens.flush()

    def close(self) -> None:
        """Flush and close the files."""
        self.flush()
        self._writer.close()
        self._tokens.close()
