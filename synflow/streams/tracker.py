"""The pure position tracker of one stream writer (no SQL, no locks, no clock).

A writer *reserves* stream IDs, then *completes* each one when its
transaction commits or rolls back. Its **current position** is the largest
completed ID such that every ID it reserved up to that one has completed
(or its starting position, before anything completes). Completions can come
in any order; each one returns the facts that just became visible, in ID
order, so the caller can announce them (RDATA for facts that committed,
nothing for rolled-back ones) and then a POSITION for the tail.

Reservations can be *in flight* before their IDs are known (the
``nextval`` is running on a database thread). While one is, the position
cannot pass the highest ID seen allocated when it began: the IDs it will get
are above that, and claiming beyond could skip them.

An **idle** writer (nothing reserved, nothing in flight) may leap its
position to the highest ID it knows has been allocated by anyone (learned
from other writers' positions), so it never holds the minimum position of
the stream back: every ID it reserves later comes from the shared sequence
and is larger.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

import attrs

P = TypeVar("P")


@attrs.frozen
class Completed(Generic[P]):
    """A fact that became visible: its ID, whether it committed, its payload."""

    stream_id: int
    ok: bool
    payload: P | None


class TrackerError(ValueError):
    """An ID was completed that was never reserved, or reserved twice."""


class PositionTracker(Generic[P]):
    """Tracks one writer's reservations and completions.

    Args:
        position: the writer's position at start-up (everything at or below
            it is done).
    """

    def __init__(self, position: int) -> None:
        self.position = position
        self.max_seen_allocated = position
        self._unfinished: set[int] = set()
        self._unfinished_heap: list[int] = []
        self._finished: dict[int, Completed[P]] = {}
        self._finished_heap: list[int] = []
        self._fetches: dict[int, int] = {}
        self._fetch_ids = itertools.count()

    # -- queries ------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing reserved, nothing in flight, nothing waiting to be announced."""
        return not self._unfinished and not self._fetches and not self._finished

    @property
    def in_flight(self) -> int:
        """IDs reserved and not yet completed, plus reservations being fetched."""
        return len(self._unfinished) + len(self._fetches)

    def _limit(self) -> int | None:
        """The highest ID the position may reach now (None: no bound)."""
        limits = []
        while self._unfinished_heap and self._unfinished_heap[0] not in self._unfinished:
            heapq.heappop(self._unfinished_heap)
        if self._unfinished_heap:
            limits.append(self._unfinished_heap[0] - 1)
        if self._fetches:
            limits.append(min(self._fetches.values()))
        return min(limits) if limits else None

    # -- reserving ---------------------------------------------------------------------

    def begin_fetch(self) -> int:
        """A reservation started whose IDs are not known yet; returns its handle."""
        handle = next(self._fetch_ids)
        self._fetches[handle] = self.max_seen_allocated
        return handle

    def end_fetch(self, handle: int, ids: list[int]) -> list[Completed[P]]:
        """The reservation ``handle`` got ``ids`` (an empty list if it failed).

        Returns:
            Facts that became visible because the in-flight bound lifted.
        """
        floor = self._fetches.pop(handle)
        for stream_id in ids:
            if stream_id <= floor or stream_id <= self.position:
                raise TrackerError(
                    f"reserved ID {stream_id} is not above the highest ID seen allocated ({floor}) "
                    f"or the position ({self.position}): the stream's sequence went backwards"
                )
            if stream_id in self._unfinished or stream_id in self._finished:
                raise TrackerError(f"stream ID {stream_id} reserved twice")
            self._unfinished.add(stream_id)
            heapq.heappush(self._unfinished_heap, stream_id)
            self.max_seen_allocated = max(self.max_seen_allocated, stream_id)
        return self._release()

    def reserve(self, ids: list[int]) -> None:
        """Reserve IDs that are already known (``begin_fetch`` + ``end_fetch``)."""
        self.end_fetch(self.begin_fetch(), ids)

    # -- completing ------------------------------------------------------------------------

    def complete(self, stream_id: int, ok: bool = True, payload: P | None = None) -> list[Completed[P]]:
        """Mark one reserved ID completed (committed if ``ok``, else rolled back).

        Returns:
            The facts that became visible, in ID order (possibly none, if an
            earlier ID is still unfinished).

        Raises:
            TrackerError: the ID is not reserved.
        """
        return self.complete_many((stream_id,), ok, None if payload is None else {stream_id: payload})

    def complete_many(self, stream_ids: Sequence[int], ok: bool = True,
                      payloads: Mapping[int, P] | None = None) -> list[Completed[P]]:
        """Mark several reserved IDs completed alike (one transaction's), working out the position once.

        Returns the same facts, in the same order, as completing them one by
        one would, but works out the position once rather than once per ID.
        Nothing is marked if any of the IDs is not reserved (or repeats).

        Raises:
            TrackerError: an ID is not reserved, or appears twice.
        """
        unfinished = self._unfinished
        if len(set(stream_ids)) != len(stream_ids) or not unfinished.issuperset(stream_ids):
            for i, stream_id in enumerate(stream_ids):
                if stream_id not in unfinished or stream_id in stream_ids[:i]:
                    raise TrackerError(f"stream ID {stream_id} completed but not reserved (or completed twice)")
        finished, heap = self._finished, self._finished_heap
        get = payloads.get if payloads is not None else None
        for stream_id in stream_ids:
            unfinished.discard(stream_id)
            finished[stream_id] = Completed(stream_id, ok, get(stream_id) if get is not None else None)
            heapq.heappush(heap, stream_id)
        return self._release()

    def _release(self) -> list[Completed[P]]:
        limit = self._limit()
        visible: list[Completed[P]] = []
        while self._finished_heap and (limit is None or self._finished_heap[0] <= limit):
            stream_id = heapq.heappop(self._finished_heap)
            visible.append(self._finished.pop(stream_id))
        if visible:
            self.position = max(self.position, visible[-1].stream_id)
        return visible

    # -- other writers ------------------------------------------------------------------------

    def observe_allocated(self, stream_id: int) -> None:
        """Another writer's position shows ``stream_id`` has been allocated."""
        if stream_id > self.max_seen_allocated:
            self.max_seen_allocated = stream_id

    def idle_advance(self) -> int | None:
        """If idle, leap to the highest ID known allocated; returns the new position."""
        if self.idle and self.max_seen_allocated > self.position:
            self.position = self.max_seen_allocated
            return self.position
        return None
