"""Sync: the events a user can see after a token, and the next token.

A process's view of the events stream is a vector clock (every writer's
position). ``sync(since)`` returns the user's events whose positions lie in
``(since, now]`` for each writer, oldest first, and ``next_batch`` = ``now``
(or, when more than ``limit`` events are pending, the token that covers
exactly the events returned). Facts completed out of order are never
skipped: a writer's position only covers facts it has completed, and the
window is per writer.

If ``since`` is ahead of this process (the client's last sync, or send, ran
on a faster process), the request first waits until this process has caught
up -- even with ``timeout=0``, bounded by :data:`CATCH_UP_TIMEOUT_S` (or the
request's timeout, if longer) -- so a token from any process reads its
writes here too. With nothing new it then long-polls, up to its timeout,
until an event in one of the user's rooms (or a membership change of the
user) arrives. A long-poll is answered at the end of the reactor turn in
which that event's position arrived: every position of the same turn is in
the answer, not in the next sync. An event whose position arrives while a
sync is still reading (its rooms, or the window) is not missed: the sync
reads again instead of waiting.

A process keeps the recent events of every room in memory, read from the
database once per new position (by whichever sync first needs it; the others
that need it meanwhile wait for that read). A sync from a token within that
stretch -- a long-poll chain's, from this process or from another one that
is not far ahead or behind -- takes its rooms' events from it; an older
token reads the database for the sync's rooms.

Every response is recorded in the audit log: reader, since, next_batch,
delivered event IDs and the rooms the response covered.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import operator
from bisect import bisect_right, insort
from collections import Counter, deque
from collections.abc import Callable
from typing import cast

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from synflow.audit import AuditLog
from synflow.errors import HttpApiError, TokenError
from synflow.replication.handler import ReplicationHandler
from synflow.storage.instances import InstanceMap
from synflow.storage.stores import DataStore, SyncEvent
from synflow.streams import EventsRow
from synflow.tokens import StreamToken
from synflow.util import cancel_timer_when_done

logger = logging.getLogger(__name__)

#: How long a sync waits, at least, for this process to catch up with a
#: ``since`` token from a faster process (the same bound as internal RPC's
#: ``replication.wait_for_position_timeout_s`` default).
CATCH_UP_TIMEOUT_S = 5.0
#: The most recent events (of every room) a process keeps for the syncs from recent tokens, and the
#: most bytes of content they may hold between them. A new stretch larger than either is not kept:
#: those syncs read from the database, for their rooms only.
RECENT_EVENTS = 1024
RECENT_BYTES = 8 * 1024 * 1024
#: The rows of recent positions kept to tell a sync whether news for it arrived while it was reading
#: (when more arrive during one read, the sync looks again rather than wait).
RECENT_NEWS = 4096


#: A sync of n rooms takes the kept events of each of its rooms when n times this is fewer than the kept
#: events its window would scan (a dictionary look-up and a bisection a room against a test an event).
ROOM_LOOKUP_COST = 4

_stream_ordering = operator.attrgetter("stream_ordering")


def _scan_window(recent: list[SyncEvent], first: int, rooms: frozenset[str], after: dict[str, int],
                 after_default: int, upto: dict[str, int], upto_default: int, limit: int) -> list[SyncEvent]:
    """The events of ``rooms`` among ``recent[first:]`` in each writer's ``(after, upto]``, at most ``limit``."""
    events = []
    for event in recent[first:] if first else recent:
        ordering = event.stream_ordering
        writer = event.instance_name
        if (event.room_id in rooms and ordering > after.get(writer, after_default)
                and ordering <= upto.get(writer, upto_default)):
            events.append(event)
            if len(events) >= limit:
                break
    return events


def _rooms_window(by_room: dict[str, list[SyncEvent]], rooms: frozenset[str], after: dict[str, int],
                  after_default: int, upto: dict[str, int], upto_default: int, limit: int) -> list[SyncEvent]:
    """:func:`_scan_window` of each room's kept events, from the lowest start on, merged (each room's first
    ``limit`` are all the merge can take of it)."""
    events: list[SyncEvent] = []
    for room_id in rooms:
        room = by_room.get(room_id)
        if room:
            events += _scan_window(room, bisect_right(room, after_default, key=_stream_ordering), rooms, after,
                                   after_default, upto, upto_default, limit)
    if len(events) > 1:
        events.sort(key=_stream_ordering)
    return events[:limit]


@attrs.frozen
class SyncResult:
    next_batch: str
    events: list[SyncEvent]
    limited: bool
    rooms: frozenset[str]


class _Waiter:
    def __init__(self, user_id: str, rooms: frozenset[str], canceller: Callable[[_Waiter], None]) -> None:
        self.user_id = user_id
        self.rooms = rooms
        self.deferred: Deferred[None] = Deferred(lambda _: canceller(self))


class SyncHandler:
    """Answers sync requests on one process.

    Args:
        store: reads events and memberships.
        handler: this process's replication handler (the events positions).
        instances: instance name <-> ID for tokens.
        clock: timeouts and timestamps.
        audit: where tokens issued are recorded.
        catch_up_timeout_s: the least a sync waits to catch up with its ``since``.
    """

    def __init__(self, store: DataStore, handler: ReplicationHandler, instances: InstanceMap,
                 clock: IReactorTime, audit: AuditLog | None = None, *,
                 catch_up_timeout_s: float = CATCH_UP_TIMEOUT_S) -> None:
        self.store = store
        self.catch_up_timeout_s = catch_up_timeout_s
        self.handler = handler
        self.instances = instances
        self.clock = clock
        self.audit = audit
        #: Long-polling syncs, by each room they cover and by user (a membership change of the user wakes it).
        self._waiting_on_room: dict[str, set[_Waiter]] = {}
        self._waiting_user: dict[str, set[_Waiter]] = {}
        #: Rows received since the last position: the waiters they concern are woken at the position.
        self._pending_rows: list[EventsRow] = []
        #: Waiters a position woke, answered together once the positions of this reactor turn are in
        #: (not empty exactly while that answer is scheduled).
        self._to_wake: list[_Waiter] = []
        handler.add_row_handler("events", self._on_rows)
        handler.add_position_listener("events", self._on_position)
        self._position_waiters: list[Deferred[None]] = []
        self._current: tuple[StreamToken, dict[str, int]] | None = None
        #: Every room's events in ``(_recent_from, _recent_to]``, by stream ordering (see _recent_window).
        self._recent: list[SyncEvent] = []
        #: The same events by room, each room's in the same order (a sync of a few rooms looks at theirs only).
        self._recent_by_room: dict[str, list[SyncEvent]] = {}
        self._recent_bytes = 0  # of their content
        self._recent_from: StreamToken | None = None
        self._recent_to: StreamToken | None = None
        #: The syncs waiting for the read that extends the recent events (None: no such read is out).
        self._extending: list[Deferred[None]] | None = None
        #: Rows applied so far, and the recent ones as (number, room, user whose membership changed or None).
        self._rows_applied = 0
        self._news: deque[tuple[int, str, str | None]] = deque(maxlen=RECENT_NEWS)

    # -- notification ----------------------------------------------------------------

    def _on_rows(self, instance: str, token: int, rows: list[EventsRow]) -> None:
        self._pending_rows.extend(rows)

    def _on_position(self, instance: str, token: int) -> None:
        rows, self._pending_rows = self._pending_rows, []
        if rows:
            n, news = self._rows_applied, self._news
            for row in rows:
                n += 1
                news.append((n, row.room_id, row.state_key if row.is_membership else None))
            self._rows_applied = n
            # Only the syncs waiting on these rooms or users: the others are not looked at.
            woken: set[_Waiter] = set()
            by_room, by_user = self._waiting_on_room, self._waiting_user
            for row in rows:
                waiting = by_room.get(row.room_id)
                if waiting:
                    woken.update(waiting)
                if row.is_membership and row.state_key in by_user:
                    woken.update(by_user[row.state_key])
            for waiter in woken:
                self._forget(waiter)
            if woken:
                # Answered at the end of this reactor turn, not now: the rest of what arrived with
                # this position (the other transactions of the same read, the other writers' reads
                # of the same poll) is applied first, so a sync woken by several of them answers
                # once with all of them, rather than once now and again at once for the rest.
                if not self._to_wake:
                    self.clock.callLater(0, self._wake)
                self._to_wake.extend(woken)
        waiters, self._position_waiters = self._position_waiters, []
        for d in waiters:
            d.callback(None)

    def _wake(self) -> None:
        woken, self._to_wake = self._to_wake, []
        for waiter in woken:
            if not waiter.deferred.called:  # not expired or cancelled meanwhile
                waiter.deferred.callback(None)

    # -- tokens --------------------------------------------------------------------------

    async def current_token(self) -> tuple[StreamToken, dict[str, int]]:
        """This process's events position as a token, and by writer name (the caller must not change it)."""
        positions = self.handler.positions("events")
        last = self._current
        if last is not None and last[1] == positions:
            return last  # no writer moved since: the same token (instance IDs never change)
        ids = await self.instances.ids_for(sorted(positions))
        current = StreamToken.from_positions({ids[n]: p for n, p in positions.items()}), positions
        self._current = current
        return current

    async def parse_token(self, text: str) -> StreamToken:
        try:
            token = StreamToken.parse(text)
        except TokenError as e:
            raise HttpApiError(400, "M_INVALID_PARAM", f"bad since token: {e}") from None
        unknown = [i for i, _ in token.positions if i not in self.instances.by_id]
        if unknown:
            await self.instances.load()
            unknown = [i for i, _ in token.positions if i not in self.instances.by_id]
        if unknown:
            raise HttpApiError(400, "M_INVALID_PARAM", f"bad since token: unknown instance id {unknown[0]}")
        return token

    def _by_name(self, token: StreamToken) -> dict[str, int]:
        return {self.instances.by_id[i]: p for i, p in token.positions}

    # -- sync ----------------------------------------------------------------------------------

    async def sync(self, user_id: str, reader: str, since_text: str | None, timeout_ms: int, limit: int) -> SyncResult:
        """Events for ``user_id`` after ``since`` (the beginning if None)."""
        since = await self.parse_token(since_text) if since_text is not None else StreamToken.at(0)
        started = self.clock.seconds()
        deadline = started + timeout_ms / 1000.0
        # Catching up is not long-polling: a token from a faster process is
        # waited for even with timeout=0 (bounded), or the client would get
        # nothing back for a write it already made elsewhere.
        await self._wait_until_reached(since, max(deadline, started + self.catch_up_timeout_s))
        while True:
            applied = self._rows_applied
            result = await self._sync_once(user_id, since, limit)
            remaining = deadline - self.clock.seconds()
            if result.events or remaining <= 0:
                break
            if self._news_since(applied, user_id, result.rooms):
                continue  # its news arrived while it read: it would wait for a wake-up already gone by
            await self._wait_for_news(user_id, result.rooms, remaining)
        if self.audit is not None:
            self.audit.token(
                reader=reader, stream="events", since=since_text, token=result.next_batch,
                delivered=[e.event_id for e in result.events], rooms=result.rooms,
            )
        return result

    def _news_since(self, applied: int, user_id: str, rooms: frozenset[str]) -> bool:
        """Whether a row of ``rooms``, or of ``user_id``'s membership, came after the first ``applied`` rows."""
        if applied == self._rows_applied:
            return False
        news = self._news
        for n, room, member in reversed(news):
            if n <= applied:
                return False
            if room in rooms or member == user_id:
                return True
        # Every row kept is since: if some rows since are no longer kept, look again rather than risk one.
        return not news or news[0][0] > applied + 1

    async def _sync_once(self, user_id: str, since: StreamToken, limit: int) -> SyncResult:
        # "now" first: every membership change at or before it has committed
        # and had its cache invalidation applied, so the rooms read next
        # reflect all of them (reading rooms first could miss a join that
        # "now" then covers, skipping that room's events for good).
        now, now_by_name = await self.current_token()
        rooms = frozenset(await self.store.get_rooms_for_user(user_id))
        if not since.is_before_or_eq(now):
            # Still behind the client's token: answer nothing new, keep its token.
            return SyncResult(str(since), [], False, rooms)
        if now.is_before_or_eq(since):
            # Nothing written since the token (the next request of a long-poll chain, mostly): the window
            # is empty for every writer, so there is nothing to read.
            return SyncResult(str(since), [], False, rooms)
        events = await self._read_window(rooms, since, now, now_by_name, limit + 1)
        limited = len(events) > limit
        if limited:
            # Cover exactly the events returned: every writer up to the last
            # one's stream ordering (events are ordered by it), never past now.
            events = events[:limit]
            next_token = now.clamp(events[-1].stream_ordering).merge(since)
        else:
            next_token = now.merge(since)
        return SyncResult(str(next_token), events, limited, rooms)

    async def _read_window(self, rooms: frozenset[str], since: StreamToken, now: StreamToken,
                           now_by_name: dict[str, int], limit: int) -> list[SyncEvent]:
        """The events of ``rooms`` in ``(since, now]``, oldest first, at most ``limit``.

        From the recent events in memory when they cover the window (see
        :meth:`_recent_window`), else read for ``rooms`` alone.
        """
        if not rooms:
            return []
        if await self._recent_window(since, now, now_by_name):
            # The window within the kept events: each writer's events after its position in since, up to now.
            after, after_default = self._by_name(since), since.minimum
            recent = self._recent
            first = bisect_right(recent, after_default, key=_stream_ordering)  # no writer's window starts lower
            if len(rooms) * ROOM_LOOKUP_COST < len(recent) - first:
                # Fewer rooms than events to look at: each room's own events, merged.
                return _rooms_window(self._recent_by_room, rooms, after, after_default, now_by_name, now.minimum,
                                     limit)
            return _scan_window(recent, first, rooms, after, after_default, now_by_name, now.minimum, limit)
        return await self.store.get_events_in_window(
            sorted(rooms), self._by_name(since), since.minimum, now_by_name, now.minimum, limit
        )

    async def _recent_window(self, since: StreamToken, now: StreamToken, now_by_name: dict[str, int]) -> bool:
        """Whether the recent events in memory hold every event in ``(since, now]``, extended to ``now`` if need be.

        They hold ``(_recent_from, _recent_to]``. Positions only move
        forward, so each ``now`` a sync sees is at or after the last one kept,
        or before it: the stretch up to a later ``now`` is read once, for
        every room, by the first sync that needs it, and the syncs that need
        it meanwhile wait for that read. Past :data:`RECENT_EVENTS` events or
        :data:`RECENT_BYTES` of content the oldest events are dropped (and
        ``_recent_from`` moves up to the last of them); a stretch larger than
        that, or positions that went back, start the kept events afresh,
        empty, at ``now``.
        """
        while True:
            kept_to = self._recent_to
            if kept_to is None or not (kept_to.is_before_or_eq(now) or now.is_before_or_eq(kept_to)):
                self._keep_from(now)  # the first sync, or a writer's position went back: afresh from here
                return False
            if not cast(StreamToken, self._recent_from).is_before_or_eq(since):
                return False  # older than what is kept
            if now.is_before_or_eq(kept_to):
                return True
            if self._extending is not None:
                waiting: Deferred[None] = Deferred()
                self._extending.append(waiting)
                await waiting
                continue  # look again: that read may have reached now, or not (a later one is needed)
            followers: list[Deferred[None]] = []
            self._extending = followers
            try:  # a failed read fails this sync and adds nothing: the next sync that needs it reads again
                read = await self.store.get_events_in_window(
                    None, self._by_name(kept_to), kept_to.minimum, now_by_name, now.minimum, RECENT_EVENTS + 1
                )
                if self._recent_to is kept_to:  # not started afresh meanwhile
                    self._keep_more(read, now)
            finally:
                self._extending = None
                for waiting in followers:  # they look again, at what is kept now
                    if not waiting.called:  # not cancelled (its client went away) meanwhile
                        waiting.callback(None)

    def _keep_more(self, read: list[SyncEvent], upto: StreamToken) -> None:
        """Add every room's events read up to ``upto`` to the recent events (or start afresh there if too many)."""
        if len(read) > RECENT_EVENTS:
            self._keep_from(upto)
            return
        recent = self._recent
        if not read or not recent or read[0].stream_ordering > recent[-1].stream_ordering:
            recent.extend(read)
        else:
            # A writer that was behind completed events below some already kept: the read (in order) and the
            # kept events above its first, merged in order (two sorted runs, the older events untouched).
            start = bisect_right(recent, read[0].stream_ordering, key=_stream_ordering)
            merged = recent[start:]
            merged.extend(read)
            merged.sort(key=_stream_ordering)
            recent[start:] = merged
        self._recent_bytes += sum(len(e.content_json) for e in read)
        by_room = self._recent_by_room
        for event in read:  # in order (the read's): each goes after its room's last, or, if below it, in its place
            room = by_room.get(event.room_id)
            if room is None:
                by_room[event.room_id] = [event]
            elif room[-1].stream_ordering < event.stream_ordering:
                room.append(event)
            else:
                insort(room, event, key=_stream_ordering)
        self._recent_to = upto
        if len(recent) <= RECENT_EVENTS and self._recent_bytes <= RECENT_BYTES:
            return
        # Drop the oldest, down to three quarters of each bound: every writer's kept events then start
        # after the last one dropped.
        drop = max(0, len(recent) - RECENT_EVENTS * 3 // 4)
        dropped = sum(len(e.content_json) for e in recent[:drop])
        while drop < len(recent) and self._recent_bytes - dropped > RECENT_BYTES * 3 // 4:
            dropped += len(recent[drop].content_json)
            drop += 1
        if drop >= len(recent):
            self._keep_from(upto)
            return
        last = recent[drop - 1].stream_ordering
        # Each room's dropped events are the first of its own (the same order): as many as it had dropped.
        for room_id, count in Counter(e.room_id for e in recent[:drop]).items():
            room = by_room[room_id]
            if count == len(room):
                del by_room[room_id]
            else:
                del room[:count]
        del recent[:drop]
        self._recent_bytes -= dropped
        self._recent_from = upto.clamp(last).merge(cast(StreamToken, self._recent_from))

    def _keep_from(self, token: StreamToken) -> None:
        """Start the recent events afresh: none kept, from ``token`` on."""
        self._recent, self._recent_by_room, self._recent_bytes = [], {}, 0
        self._recent_from = self._recent_to = token

    async def _wait_until_reached(self, token: StreamToken, deadline: float) -> None:
        while True:
            now, _ = await self.current_token()
            if token.is_before_or_eq(now):
                return
            remaining = deadline - self.clock.seconds()
            if remaining <= 0:
                return
            await self._sleep_until_position(min(remaining, 1.0))

    def _sleep_until_position(self, seconds: float) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self._position_waiters.append(d)
        call = self.clock.callLater(seconds, lambda: None if d.called else d.callback(None))
        return cancel_timer_when_done(d, call)

    def _wait_for_news(self, user_id: str, rooms: frozenset[str], seconds: float) -> Deferred[None]:
        waiter = _Waiter(user_id, rooms, self._forget)  # a cancelled sync stops waiting too
        for room in rooms:
            self._waiting_on_room.setdefault(room, set()).add(waiter)
        self._waiting_user.setdefault(user_id, set()).add(waiter)

        def expire() -> None:
            if not waiter.deferred.called:
                self._forget(waiter)
                waiter.deferred.callback(None)

        return cancel_timer_when_done(waiter.deferred, self.clock.callLater(seconds, expire))

    def _forget(self, waiter: _Waiter) -> None:
        """Take a waiter out of the indexes (it is woken or expired)."""
        for key, index in ((waiter.user_id, self._waiting_user), *((r, self._waiting_on_room) for r in waiter.rooms)):
            waiting = index.get(key)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del index[key]

    @property
    def waiting(self) -> int:
        """Syncs long-polling now."""
        return sum(len(w) for w in self._waiting_user.values())
