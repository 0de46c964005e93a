"""What the audit log could not write, summarised as gap records.

When a write to the audit log fails, the records it held are dropped (the
process keeps no unbounded backlog) and summarised here: per stream, the
range of stream IDs of the facts lost and the time window they span; for the
token log, the time window and the readers whose tokens were lost. When
writing works again, the summary is written first, as one ``kind: "gap"``
record per stream (writer log) or one for the token log, so the Spark
validator knows which part of the history it cannot verify
(docs/validator.md, "Gaps").

A writer-log gap record::

    {"kind": "gap", "stream": "events", "writer": "persister1",
     "from_stream_id": 41, "to_stream_id": 57, "lost_from": <µs>, "lost_until": <µs>,
     "records": 19, "facts": 17, "error": "No space left on device", "written_at": <µs>}

(``from_stream_id``/``to_stream_id`` are null when only position records were
lost). A token-log gap record::

    {"kind": "gap", "issued_by": "master", "readers": ["@u:hs", ...],
     "lost_from": <µs>, "lost_until": <µs>, "records": 4, "error": "...", "written_at": <µs>}

(``readers`` is null when more than :data:`MAX_GAP_READERS` readers lost
tokens: then the gap concerns every reader). ``lost_from`` is the earliest
time any lost record mentions (a fact's reservation, an announcement, a
token's issue) and ``lost_until`` the latest, or the last failed attempt if
that is later: every lost record lies wholly inside the window.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

#: A token-log gap lists at most this many readers; beyond it the gap concerns every reader.
MAX_GAP_READERS = 1000


def _times(record: Mapping[str, Any]) -> list[int]:
    keys = ("reserved_at", "completed_at", "announced_at", "issued_at")
    return [int(record[k]) for k in keys if isinstance(record.get(k), int)]


@attrs.define
class _Window:
    records: int = 0
    lost_from: int | None = None
    lost_until: int | None = None

    def widen(self, times: Iterable[int]) -> None:
        for t in times:
            self.lost_from = t if self.lost_from is None else min(self.lost_from, t)
            self.lost_until = t if self.lost_until is None else max(self.lost_until, t)


@attrs.define
class _StreamGap(_Window):
    facts: int = 0
    from_stream_id: int | None = None
    to_stream_id: int | None = None


@attrs.define
class _TokenGap(_Window):
    readers: set[str] | None = attrs.Factory(set)


class GapTracker:
    """Accumulates lost records of one process until a gap record can be written.

    Args:
        instance_name: this process (the ``writer`` / ``issued_by`` of its gap records).
    """

    def __init__(self, instance_name: str) -> None:
        self.instance_name = instance_name
        self._streams: dict[str, _StreamGap] = {}
        self._tokens: _TokenGap | None = None
        self.error: str | None = None
        self.records_lost = 0

    @property
    def writer_pending(self) -> bool:
        """Whether writer-log records were lost and not yet reported."""
        return bool(self._streams)

    @property
    def tokens_pending(self) -> bool:
        """Whether token-log records were lost and not yet reported."""
        return self._tokens is not None

    def lost_writer_records(self, records: Iterable[Mapping[str, Any]], now_us: int, error: str) -> None:
        """Writer-log records (facts, position announcements) that could not be written."""
        self.error = error
        for record in records:
            gap = self._streams.setdefault(str(record.get("stream")), _StreamGap())
            gap.records += 1
            self.records_lost += 1
            gap.widen(_times(record))
            if record.get("kind") is None and isinstance(record.get("stream_id"), int):
                sid = record["stream_id"]
                gap.facts += 1
                gap.from_stream_id = sid if gap.from_stream_id is None else min(gap.from_stream_id, sid)
                gap.to_stream_id = sid if gap.to_stream_id is None else max(gap.to_stream_id, sid)
        for gap in self._streams.values():
            gap.widen([now_us])

    def lost_token_records(self, records: Iterable[Mapping[str, Any]], now_us: int, error: str) -> None:
        """Token-log records that could not be written."""
        self.error = error
        gap = self._tokens = self._tokens or _TokenGap()
        for record in records:
            gap.records += 1
            self.records_lost += 1
            gap.widen(_times(record))
            if gap.readers is not None:
                gap.readers.add(str(record.get("reader")))
                if len(gap.readers) > MAX_GAP_READERS:
                    gap.readers = None
        gap.widen([now_us])

    def writer_gap_records(self, now_us: int) -> list[dict[str, Any]]:
        """The gap records for the writer log (one per stream with losses)."""
        return [
            {"kind": "gap", "stream": stream, "writer": self.instance_name,
             "from_stream_id": gap.from_stream_id, "to_stream_id": gap.to_stream_id,
             "lost_from": gap.lost_from, "lost_until": gap.lost_until, "records": gap.records,
             "facts": gap.facts, "error": self.error, "written_at": now_us}
            for stream, gap in sorted(self._streams.items())
        ]

    def token_gap_records(self, now_us: int) -> list[dict[str, Any]]:
        """The gap record for the token log (none when no token record was lost)."""
        gap = self._tokens
        if gap is None:
            return []
        return [{"kind": "gap", "issued_by": self.instance_name,
                 "readers": sorted(gap.readers) if gap.readers is not None else None,
                 "lost_from": gap.lost_from, "lost_until": gap.lost_until, "records": gap.records,
                 "error": self.error, "written_at": now_us}]

    def writer_reported(self) -> None:
        """The writer-log gap records were written."""
        self._streams.clear()

    def tokens_reported(self) -> None:
        """The token-log gap record was written."""
        self._tokens = None
