"""Routing event writes to the persister that owns each room.

Any process may accept an event; :class:`EventRouter` sends it to the room's
owner (``shard_for(room_id, stream_writers.events)``): directly when this
process is that persister, over internal RPC (``persist_events``) otherwise.
The RPC layer carries stream positions both ways, so when ``persist``
returns, this process has seen the events it persisted.

With live resharding (a :class:`~synflow.events.shards.ShardFollower`), the
owner comes from the shard map this process follows. A send of a room that
is moving waits here until the hand-over is over (at most ``max_wait_s``,
then 503 ``M_ROOM_MOVING`` with ``Retry-After``); a send a persister refuses
because this process's map was stale (``M_WRONG_PERSISTER``, or
``M_ROOM_MOVING`` from its transaction's fence) is re-routed after the map
is re-read, never refused to the client. Persisting is idempotent, so a
re-routed send is never written twice.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, gatherResults
from twisted.python.failure import Failure

from synflow.errors import HttpApiError, WrongPersister
from synflow.events.persist import EventPersister, EventSpec, PersistResult
from synflow.events.shards import (
    DEFAULT_MAX_WAIT_S,
    SENDS_HELD,
    SENDS_REROUTED,
    SENDS_WAITING,
    ShardFollower,
)
from synflow.http.rpc import RpcClient, RpcServer
from synflow.http.server import refusal_from_status, refusal_status
from synflow.sharding import shard_for

#: Events sent in one persist_events call at most.
MAX_RPC_BATCH = 500
#: persist_events calls to one persister in flight at once at most; sends made
#: meanwhile wait and go in the next call, so under load a call carries every
#: send that arrived while the previous one ran.
MAX_RPC_IN_FLIGHT = 2
#: Sends waiting for one persister that start a call beside one already in flight: fewer wait for it to
#: return. A call's HTTP round trip costs both processes about what persisting several events does, so
#: a few sends are cheaper in the next call; a backlog this large is worth the second call's overlap.
MIN_EXTRA_CALL_BATCH = 8
#: Times one send is re-routed at most (each after the shard map changed or was re-read).
MAX_REROUTES = 8
#: The refusals that mean "send it elsewhere", not "it is refused".
REROUTE_ERRCODES = frozenset({"M_WRONG_PERSISTER", "M_ROOM_MOVING"})


class EventRouter:
    """Sends events to their rooms' persisters and collects the results in order.

    Calls to one remote persister made in the same reactor turn share one
    ``persist_events`` RPC (up to :data:`MAX_RPC_BATCH` events), and at most
    :data:`MAX_RPC_IN_FLIGHT` such RPCs run at once per persister: sends made
    while they run go together in the next. A call beside one already in
    flight starts only for at least :data:`MIN_EXTRA_CALL_BATCH` waiting
    sends. Under load, HTTP costs are paid per batch rather than per event;
    when idle, a send goes at once.
    """

    def __init__(self, instance_name: str, event_writers: Sequence[str], persister: EventPersister | None,
                 rpc: RpcClient | None, clock: Any = None, follower: ShardFollower | None = None,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S, max_rpc_in_flight: int = MAX_RPC_IN_FLIGHT,
                 min_extra_call_batch: int = MIN_EXTRA_CALL_BATCH) -> None:
        if max_rpc_in_flight < 1:
            raise ValueError(f"max_rpc_in_flight must be at least 1, got {max_rpc_in_flight}")
        if min_extra_call_batch < 1:
            raise ValueError(f"min_extra_call_batch must be at least 1, got {min_extra_call_batch}")
        self.instance_name = instance_name
        self.event_writers = list(event_writers)
        self.persister = persister
        self.rpc = rpc
        self.clock = clock
        self.follower = follower
        self.max_wait_s = max_wait_s
        self._outbox: dict[str, list[tuple[EventSpec, Deferred[PersistResult]]]] = {}
        self._flush_scheduled: set[str] = set()
        self.max_rpc_in_flight = max_rpc_in_flight
        self.min_extra_call_batch = min_extra_call_batch
        #: persist_events calls running, per persister.
        self._in_flight: dict[str, int] = {}
        #: Sends re-routed after a persister refused them for a stale map, and sends held during hand-overs.
        self.rerouted = 0
        self.held = 0

    def owner_of(self, room_id: str) -> str:
        if self.follower is not None:
            return self.follower.state.current.owner(room_id)
        return shard_for(room_id, self.event_writers)

    async def persist(self, specs: list[EventSpec]) -> list[PersistResult]:
        """Persist ``specs`` at their rooms' owners; one result per event, in order."""
        if self.follower is None:
            return await self._persist_at(specs, self.owner_of)
        return await self._persist_following(specs, self.follower)

    async def _persist_following(self, specs: list[EventSpec], follower: ShardFollower) -> list[PersistResult]:
        results: list[PersistResult | None] = [None] * len(specs)
        todo = list(range(len(specs)))
        deadline = self.clock.seconds() + self.max_wait_s
        for _ in range(MAX_REROUTES):
            state = follower.state
            held = [i for i in todo if state.moving(specs[i].room_id)]
            ready = [i for i in todo if not state.moving(specs[i].room_id)]
            retry: list[int] = []
            if ready:
                try:
                    got: list[PersistResult] | None = await self._persist_at([specs[i] for i in ready],
                                                                             state.current.owner)
                except WrongPersister:
                    got = None
                except HttpApiError as e:
                    if e.errcode not in REROUTE_ERRCODES:
                        raise
                    got = None
                if got is None:
                    retry = ready
                else:
                    for i, result in zip(ready, got, strict=True):
                        if result.error is not None and result.error.errcode in REROUTE_ERRCODES:
                            retry.append(i)
                        else:
                            results[i] = result
            todo = sorted(held + retry)
            if not todo:
                break
            remaining = deadline - self.clock.seconds()
            if remaining <= 0:
                break
            if retry:
                self.rerouted += len(retry)
                SENDS_REROUTED.inc(len(retry))
                await follower.reload()
            if held or (retry and all(follower.state.moving(specs[i].room_id) for i in retry)):
                waiting = len(todo)
                self.held += waiting
                SENDS_HELD.inc(waiting)
                SENDS_WAITING.inc(waiting)
                try:
                    await follower.wait_for_change(remaining)
                finally:
                    SENDS_WAITING.dec(waiting)
        if todo:
            retry_ms = 1000
            raise HttpApiError(503, "M_ROOM_MOVING", f"room {specs[todo[0]].room_id} is moving to another event "
                               f"persister; retry in {retry_ms} ms", retry_after_ms=retry_ms)
        return [r for r in results if r is not None]

    async def _persist_at(self, specs: list[EventSpec], owner_of: Any) -> list[PersistResult]:
        by_owner: dict[str, list[int]] = {}
        for i, spec in enumerate(specs):
            by_owner.setdefault(owner_of(spec.room_id), []).append(i)
        results: list[PersistResult | None] = [None] * len(specs)
        for owner, indexes in by_owner.items():
            batch = [specs[i] for i in indexes]
            if owner == self.instance_name and self.persister is not None:
                got = await self.persister.persist(batch)
            else:
                if self.rpc is None:
                    raise HttpApiError(502, "M_UNKNOWN", f"cannot reach event persister {owner!r}")
                if len(batch) == 1:  # one event (a client's send): no DeferredList to gather one result
                    got = [await self._queue(owner, batch[0])]
                else:
                    got = await gatherResults([self._queue(owner, spec) for spec in batch],
                                              consumeErrors=True).addErrback(_first_error)
            for i, result in zip(indexes, got, strict=True):
                results[i] = result
        return [r for r in results if r is not None]

    def _queue(self, owner: str, spec: EventSpec) -> Deferred[PersistResult]:
        d: Deferred[PersistResult] = Deferred()
        pending = self._outbox.setdefault(owner, [])
        pending.append((spec, d))
        if owner not in self._flush_scheduled and self._may_call(owner, len(pending)):
            self._flush_scheduled.add(owner)
            if self.clock is None:
                self._flush(owner)
            else:
                self.clock.callLater(0, self._flush, owner)
        return d

    def _flush(self, owner: str) -> None:
        self._flush_scheduled.discard(owner)
        pending = self._outbox.get(owner)
        while pending and self._may_call(owner, len(pending)):
            chunk, pending[:] = pending[:MAX_RPC_BATCH], pending[MAX_RPC_BATCH:]
            self._in_flight[owner] = self._in_flight.get(owner, 0) + 1
            Deferred.fromCoroutine(self._call(owner, chunk))
        if not pending:
            self._outbox.pop(owner, None)

    def _may_call(self, owner: str, waiting: int) -> bool:
        """Whether ``waiting`` sends for ``owner`` may start a call now."""
        in_flight = self._in_flight.get(owner, 0)
        return in_flight == 0 or (in_flight < self.max_rpc_in_flight and waiting >= self.min_extra_call_batch)

    async def _call(self, owner: str, chunk: list[tuple[EventSpec, Deferred[PersistResult]]]) -> None:
        try:
            await self._call_once(owner, chunk)
        finally:
            self._in_flight[owner] -= 1
            if self._outbox.get(owner):
                self._flush(owner)  # the sends that waited for this call go now

    async def _call_once(self, owner: str, chunk: list[tuple[EventSpec, Deferred[PersistResult]]]) -> None:
        assert self.rpc is not None
        try:
            raw = await self.rpc.call(owner, "persist_events", {"events": [s.to_json() for s, _ in chunk]})
            results = [result_from_json(r) for r in raw]
            if len(results) != len(chunk):
                raise HttpApiError(502, "M_UNKNOWN", f"{owner!r} answered {len(results)} results for {len(chunk)} events")
        except Exception:
            failure = Failure()
            for _, d in chunk:
                d.errback(failure)
            return
        for (_, d), result in zip(chunk, results, strict=True):
            d.callback(result)


def result_to_json(result: PersistResult) -> dict[str, Any]:
    """A persist result for the internal RPC: a refusal as ``[status, errcode, message]``."""
    error = result.error
    return {
        "event_id": result.event_id,
        "stream_ordering": result.stream_ordering,
        "instance_name": result.instance_name,
        "error": None if error is None else [refusal_status(error), error.errcode, error.msg],
        "duplicate": result.duplicate,
    }


def result_from_json(data: dict[str, Any]) -> PersistResult:
    """A persist result another process answered (see :func:`result_to_json`).

    Raises:
        ValueError: the error's status is no refusal's.
    """
    error = data.get("error")
    return PersistResult(data.get("event_id"), data.get("stream_ordering"), data["instance_name"],
                         refusal_from_status(*error) if error else None, bool(data.get("duplicate")))


def _first_error(failure: Failure) -> Failure:
    inner: Failure = failure.value.subFailure  # type: ignore[union-attr]
    return inner


def serve_persist(server: RpcServer, persister: EventPersister) -> None:
    """Expose ``persist_events`` (and its one-event form ``send_event``) on this persister's internal listener.

    A batch with any event for a room this persister does not own is refused
    whole -- 409 ``M_WRONG_PERSISTER`` naming the owner in ``owner`` -- before
    any of its events is queued, so a misrouted batch never half-persists.
    """

    async def persist_events(args: Any) -> Any:
        events = args.get("events") if isinstance(args, dict) else None
        if not isinstance(events, list) or not events or not all(isinstance(e, dict) for e in events):
            raise HttpApiError(400, "M_BAD_JSON", "persist_events needs a non-empty list of events")
        specs = [EventSpec.from_json(e) for e in events]
        results = await persister.persist(specs)  # refuses the whole call if any room is another's
        return [result_to_json(r) for r in results]

    async def send_event(args: Any) -> Any:
        event = args.get("event") if isinstance(args, dict) else None
        if not isinstance(event, dict):
            raise HttpApiError(400, "M_BAD_JSON", "send_event needs an event object")
        (result,) = await persist_events({"events": [event]})
        return result

    server.register("persist_events", persist_events)
    server.register("send_event", send_event)
