"""Refuses writer positions that no ID of the stream's sequence reaches.

A ``POSITION s w prev new`` (or an ``RDATA`` at a numeric token) claims that
writer ``w`` reached that ID on stream ``s``. Every legitimate claim is an ID
the stream's shared sequence has already handed out: a writer's own
completed (committed or aborted) IDs, the IDs it leapt to while idle (the
highest *seen allocated* by anyone), its persisted start position (the
start-up check moves the sequence past it). And every claim is sent only
after the write it covers committed, so the sequence bump (on SQLite, made
in the writing transaction; on PostgreSQL, ``nextval`` is visible at once)
is visible to any transaction a reader opens after receiving it.

A claim above the sequence therefore did not come from a synflow writer: a
forged line on the hub, a stray publisher on the Redis channel, a bug.
Applying it would move every reader's view of ``w`` (and, through the
idle-writer leap, of every other writer) past IDs not yet handed out, so
the real rows written there later would look stale and be dropped.

Why the sequence and not the table: the table lacks aborted IDs and the
leaps, both of which are legitimate positions; the sequence covers exactly
what was handed out.

Cost: the guard remembers the highest value it has read from the sequence
(and any ID this process allocated itself, which is just as good). Claims at
or below it are accepted without a query; only a claim above it reads the
sequence once more. The handler processes one stream's commands in order,
so at most one such read per stream is in flight, and every claim queued
behind it is settled by its answer.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Final

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from synflow.replication.commands import PositionCommand, RdataCommand

logger = logging.getLogger(__name__)

#: A refused claim is logged at most once per stream in this many seconds (the rest are counted).
REFUSAL_LOG_INTERVAL_S: Final = 10.0

#: Reads the highest ID a stream's sequence has handed out (from the database).
FetchAllocated = Callable[[str], Deferred[int]]


class PositionGuard:
    """Checks writer positions against each stream's sequence before they are applied.

    Args:
        fetch_allocated: reads a stream's highest allocated ID from the database.
        allocated: each stream's highest allocated ID known at start-up.
        clock: for the rate limit of refusal logs.
    """

    def __init__(self, fetch_allocated: FetchAllocated, allocated: Mapping[str, int], clock: IReactorTime) -> None:
        self.fetch_allocated = fetch_allocated
        self.clock = clock
        self._allocated: dict[str, int] = dict(allocated)
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self.refused = 0
        self.fetches = 0

    def allocated(self, stream: str) -> int:
        """The highest ID of ``stream`` known to be handed out."""
        return self._allocated.get(stream, 0)

    def note_allocated(self, stream: str, stream_id: int) -> None:
        """``stream_id`` is known to be handed out (this process allocated or completed it)."""
        if stream_id > self._allocated.get(stream, 0):
            self._allocated[stream] = stream_id

    def check_command(self, cmd: RdataCommand | PositionCommand) -> bool | Deferred[bool]:
        """:meth:`check` the position a stream command claims for its writer.

        A ``POSITION`` claims both its tokens (a reader new to the writer
        starts from ``prev``); an ``RDATA`` its numeric token; a ``batch``
        row claims nothing (its numeric row follows).
        """
        if isinstance(cmd, RdataCommand):
            if cmd.token is None:
                return True
            claim = cmd.token
        else:
            claim = max(cmd.prev_token, cmd.new_token)
        if claim <= self._allocated.get(cmd.stream_name, 0):
            return True  # the common case, settled before describing the command for a log
        # The line as received (a row may not have been decoded, and may not decode).
        what = cmd.wire.decode("utf-8", "replace") if cmd.wire is not None else f"{cmd.NAME} {cmd.to_args()}"
        return self.check(cmd.stream_name, cmd.instance_name, claim, what[:128])

    def check(self, stream: str, instance: str, claim: int, what: str) -> bool | Deferred[bool]:
        """Whether writer ``instance`` may be at ``claim`` on ``stream``.

        Takes input from another process: ``instance`` and ``claim`` are as
        received (already bounded by the codec: a word, a 64-bit integer).

        Args:
            what: the command, for the log (``POSITION events p1 1 9``).

        Returns:
            True or False at once when the known bound decides; otherwise a
            Deferred that reads the sequence and fires with the answer (False
            too if the read fails: an unverifiable claim is not applied).
        """
        if claim <= self._allocated.get(stream, 0):
            return True
        self.fetches += 1
        d = self.fetch_allocated(stream)

        def decide(allocated: int) -> bool:
            self.note_allocated(stream, allocated)
            if claim <= allocated:
                return True
            self._refuse(stream, instance, claim, what, f"the sequence has handed out only up to {allocated}")
            return False

        def failed(failure: object) -> bool:
            message = getattr(failure, "getErrorMessage", lambda: str(failure))()
            self._refuse(stream, instance, claim, what, f"the sequence could not be read ({message})")
            return False

        result: Deferred[bool] = d.addCallbacks(decide, failed)
        return result

    def _refuse(self, stream: str, instance: str, claim: int, what: str, why: str) -> None:
        self.refused += 1
        now = self.clock.seconds()
        last = self._last_log.get(stream)
        if last is not None and now - last < REFUSAL_LOG_INTERVAL_S:
            self._unlogged[stream] = self._unlogged.get(stream, 0) + 1
            return
        self._last_log[stream] = now
        suppressed = self._unlogged.pop(stream, 0)
        more = f" ({suppressed} more refused since the last report)" if suppressed else ""
        logger.warning(
            "refused %s: %s claims %s position %d but %s; not applied%s",
            what[:200], instance, stream, claim, why, more,
        )


__all__ = ["REFUSAL_LOG_INTERVAL_S", "FetchAllocated", "PositionGuard"]
