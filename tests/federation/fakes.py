"""In-memory stand-ins for the federation sender's collaborators.

* :class:`FakeDestinationStore` -- ``destinations``, ``destination_rooms``
  and each event's destinations in dicts, with the exact semantics the SQL store must have (see
  :class:`~synflow.federation.interfaces.DestinationStore`);
* :class:`FakeTransport` -- records every transaction and answers from a
  script (succeed, fail, or hold until released);
* :class:`TreqRemote` -- the same recording and script, as a remote server's
  ``/send`` resource behind the real
  :class:`~synflow.federation.transport.TreqFederationTransport` on
  :class:`treq.testing.StubTreq` (``Harness(treq=True)``);
* :class:`Events` -- a multi-writer events stream with a shared sequence and
  per-writer completion, producing :class:`Pdu` values;
* :class:`Harness` -- a :class:`FederationSender` on a ``Clock`` over the fakes
  (or over treq and :class:`TreqRemote`).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import unquote

import attrs
from treq.testing import StubTreq
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from synflow.config import BackoffSection, FederationConfig
from synflow.federation.interfaces import DestinationRecord, Edu, Pdu, TransactionFailed
from synflow.federation.policy import RetryState
from synflow.federation.sender import FederationSender
from synflow.federation.transport import TreqFederationTransport
from synflow.tokens import StreamToken

LOCAL = "local.test"


def _key(pdu: Pdu) -> tuple[int, int]:
    return (pdu.stream_ordering, pdu.instance_id)


class FakeDestinationStore:
    """The destinations store in memory, with optional holds on catch-up reads."""

    def __init__(self) -> None:
        self.records: dict[str, DestinationRecord] = {}
        self.rooms: dict[tuple[str, str], Pdu] = {}
        #: Every event recorded for each destination (the ``events.destinations`` lists).
        self.events: dict[str, list[Pdu]] = defaultdict(list)
        self.event_reads: list[tuple[str, StreamToken, StreamToken, int]] = []
        self.catch_up_reads: list[tuple[str, StreamToken, StreamToken, int]] = []
        self.positions: dict[str, list[StreamToken]] = defaultdict(list)
        self.hold_reads = False
        self.held_reads: list[tuple[Deferred[list[Pdu]], Any]] = []

    # -- what the lead's event follower does -----------------------------------------

    def record_pdu(self, pdu: Pdu, destinations: Iterable[str]) -> None:
        """Upsert ``destination_rooms`` (the latest event of the room per destination); list the event."""
        for d in destinations:
            self.events[d].append(pdu)
            old = self.rooms.get((d, pdu.room_id))
            if old is None or _key(old) < _key(pdu):
                self.rooms[(d, pdu.room_id)] = pdu

    # -- DestinationStore ----------------------------------------------------------------

    def get_destination(self, destination: str) -> Deferred[DestinationRecord | None]:
        return succeed(self.records.get(destination))

    def set_retry(self, destination: str, retry: RetryState) -> Deferred[None]:
        old = self.records.get(destination, DestinationRecord(destination))
        self.records[destination] = attrs.evolve(old, retry=retry)
        return succeed(None)

    def set_last_successful(self, destination: str, token: StreamToken) -> Deferred[None]:
        old = self.records.get(destination, DestinationRecord(destination))
        if old.last_successful is not None and not old.last_successful.is_before_or_eq(token):
            raise AssertionError(f"last_successful moved back: {old.last_successful} -> {token}")
        self.records[destination] = attrs.evolve(old, last_successful=token)
        self.positions[destination].append(token)
        return succeed(None)

    def needed(self, destination: str, after: StreamToken, upto: StreamToken) -> list[Pdu]:
        """The entries of ``destination`` in ``(after, upto]``, by (stream_ordering, instance)."""
        hits = [
            p
            for (d, _), p in self.rooms.items()
            if d == destination
            and not after.covers(p.instance_id, p.stream_ordering)
            and upto.covers(p.instance_id, p.stream_ordering)
        ]
        return sorted(hits, key=_key)

    def get_catch_up_pdus(
        self, destination: str, after: StreamToken, upto: StreamToken, limit: int
    ) -> Deferred[list[Pdu]]:
        self.catch_up_reads.append((destination, after, upto, limit))
        if self.hold_reads:
            d: Deferred[list[Pdu]] = Deferred()
            self.held_reads.append((d, (destination, after, upto, limit, self.needed)))
            return d
        return succeed(self.needed(destination, after, upto)[:limit])

    def owed_events(self, destination: str, after: StreamToken, upto: StreamToken) -> list[Pdu]:
        """Every event of ``destination`` in ``(after, upto]``, by (stream_ordering, instance)."""
        hits = [
            p for p in self.events.get(destination, [])
            if not after.covers(p.instance_id, p.stream_ordering) and upto.covers(p.instance_id, p.stream_ordering)
        ]
        return sorted(hits, key=_key)

    def count_catch_up_events(
        self, destination: str, after: StreamToken, upto: StreamToken, limit: int
    ) -> Deferred[int]:
        return succeed(min(limit, len(self.owed_events(destination, after, upto))))

    def get_catch_up_events(
        self, destination: str, after: StreamToken, upto: StreamToken, limit: int
    ) -> Deferred[list[Pdu]]:
        self.event_reads.append((destination, after, upto, limit))
        if self.hold_reads:
            d: Deferred[list[Pdu]] = Deferred()
            self.held_reads.append((d, (destination, after, upto, limit, self.owed_events)))
            return d
        return succeed(self.owed_events(destination, after, upto)[:limit])

    def release_read(self) -> None:
        """Answer the oldest held catch-up read with what the store holds now."""
        d, (destination, after, upto, limit, read) = self.held_reads.pop(0)
        d.callback(read(destination, after, upto)[:limit])

    def outstanding_destinations(self, upto: StreamToken) -> Deferred[list[str]]:
        out = set()
        for (d, _), p in self.rooms.items():
            record = self.records.get(d)
            after = record.last_successful if record and record.last_successful else StreamToken.at(0)
            if not after.covers(p.instance_id, p.stream_ordering) and upto.covers(
                p.instance_id, p.stream_ordering
            ):
                out.add(d)
        return succeed(sorted(out))


@attrs.frozen
class Sent:
    """One call to ``send_transaction``."""

    destination: str
    txn_id: str
    body: dict[str, Any] = attrs.field(eq=False)
    at: float

    @property
    def event_ids(self) -> list[str]:
        return [p["event_id"] for p in self.body["pdus"]]

    @property
    def edu_count(self) -> int:
        return len(self.body.get("edus", []))


class _Recorder:
    """What :class:`FakeTransport` and :class:`TreqRemote` share: the record of
    transactions, the per-destination script and the in-flight counts."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.sent: list[Sent] = []
        self.script: dict[str, list[Any]] = defaultdict(list)
        self.default: Any = "ok"
        self.in_flight: dict[str, int] = defaultdict(int)
        self.max_in_flight: dict[str, int] = defaultdict(int)

    def _arrived(self, destination: str, txn_id: str, body: dict[str, Any]) -> tuple[Sent, Any]:
        """Record a transaction, now in flight; returns it and its scripted outcome."""
        sent = Sent(destination, txn_id, body, self.clock.seconds())
        self.sent.append(sent)
        self.in_flight[destination] += 1
        self.max_in_flight[destination] = max(self.max_in_flight[destination], self.in_flight[destination])
        script = self.script[destination]
        return sent, (script.pop(0) if script else self.default)

    def to(self, destination: str) -> list[Sent]:
        return [s for s in self.sent if s.destination == destination]

    def events_to(self, destination: str) -> list[str]:
        return [e for s in self.to(destination) for e in s.event_ids]


class FakeTransport(_Recorder):
    """Records transactions; answers each from a per-destination script.

    A script entry is ``"ok"``, ``"hold"`` (answered by :meth:`release`) or
    an exception to fail with. Without a script entry the default applies.
    """

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.held: list[tuple[Sent, Deferred[dict[str, Any]]]] = []

    def send_transaction(self, destination: str, txn_id: str, body: dict[str, Any]) -> Deferred[dict[str, Any]]:
        sent, outcome = self._arrived(destination, txn_id, body)
        if outcome == "hold":
            d: Deferred[dict[str, Any]] = Deferred()
            self.held.append((sent, d))
            return d
        self.in_flight[destination] -= 1
        if outcome == "ok":
            return succeed(_ok(body))
        return fail(outcome)

    def release(self, outcome: Any = "ok") -> Sent:
        """Answer the oldest held transaction (``"ok"`` or an exception)."""
        sent, d = self.held.pop(0)
        self.in_flight[sent.destination] -= 1
        if outcome == "ok":
            d.callback(_ok(sent.body))
        else:
            d.errback(outcome)
        return sent


def _ok(body: dict[str, Any]) -> dict[str, Any]:
    return {"pdus": {p["event_id"]: {} for p in body["pdus"]}}


class TreqRemote(_Recorder, Resource):
    """Remote servers' ``/send`` endpoint, answering like :class:`FakeTransport`'s script.

    Mounted at ``/_matrix/federation/v1/send`` behind a
    :class:`~treq.testing.StubTreq`, it sees what the real treq transport
    sends: the destination is the request's ``Host``, the transaction ID the
    URL's last segment (unquoted), the body the JSON sent. ``"ok"`` answers
    200 with every PDU accepted; ``"hold"`` answers nothing until
    :meth:`release`; an exception answers 500 with an error body; an int
    answers that status. Requests are in flight from the moment they arrive
    until answered.
    """

    isLeaf = True

    def __init__(self, clock: Clock) -> None:
        _Recorder.__init__(self, clock)
        Resource.__init__(self)
        self.stub: StubTreq | None = None
        self.held: list[tuple[Sent, Any]] = []

    def render_PUT(self, request: Any) -> Any:
        destination = request.getHeader(b"host").decode().partition(":")[0]
        txn_id = unquote(request.postpath[-1].decode())
        sent, outcome = self._arrived(destination, txn_id, json.loads(request.content.read()))
        if outcome == "hold":
            self.held.append((sent, request))
            return NOT_DONE_YET
        self.in_flight[destination] -= 1
        code, reply = self._reply(sent, outcome)
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(reply).encode()

    def release(self, outcome: Any = "ok") -> Sent:
        """Answer the oldest held transaction and let the client see the reply."""
        sent, request = self.held.pop(0)
        self.in_flight[sent.destination] -= 1
        code, reply = self._reply(sent, outcome)
        request.setResponseCode(code)
        request.setHeader(b"content-type", b"application/json")
        request.write(json.dumps(reply).encode())
        request.finish()
        self.flush()
        return sent

    def flush(self) -> None:
        """Deliver what the in-memory connections hold (replies, and requests they led to)."""
        assert self.stub is not None
        self.stub.flush()

    @staticmethod
    def _reply(sent: Sent, outcome: Any) -> tuple[int, dict[str, Any]]:
        if outcome == "ok":
            return 200, _ok(sent.body)
        if isinstance(outcome, int):
            return outcome, {"errcode": "M_UNKNOWN", "error": f"scripted {outcome}"}
        return 500, {"errcode": "M_UNKNOWN", "error": str(outcome)}


def mount_send(leaf: Resource) -> Resource:
    """A root with ``leaf`` at ``/_matrix/federation/v1/send``."""
    root = Resource()
    node = root
    for name in (b"_matrix", b"federation", b"v1"):
        child = Resource()
        node.putChild(name, child)
        node = child
    node.putChild(b"send", leaf)
    return root


def unreachable() -> TransactionFailed:
    return TransactionFailed("connection refused", retriable=True)


class Events:
    """A multi-writer events stream: one shared sequence, per-writer completion.

    ``persist`` takes the next ID for a writer; the event completes at once
    unless ``complete=False`` (then :meth:`complete` finishes it). A writer's
    position is just below its oldest incomplete ID, or, when it has none,
    the highest ID allocated by anyone (an idle writer never holds others
    back). :meth:`position` is the vector clock.
    """

    def __init__(self, writers: Sequence[int] = (1,)) -> None:
        self.next_id = 0
        self.writers = list(writers)
        self.pending: dict[int, set[int]] = {w: set() for w in writers}

    def persist(self, room: str, writer: int = 1, *, complete: bool = True, name: str | None = None) -> Pdu:
        self.next_id += 1
        so = self.next_id
        event_id = name or f"$e{so}"
        pdu = Pdu(
            event_id, room, writer, so,
            {"event_id": event_id, "room_id": room, "type": "m.room.message", "sender": "@u:" + LOCAL,
             "content": {"body": event_id}, "origin_server_ts": so},
        )
        if not complete:
            self.pending[writer].add(so)
        return pdu

    def complete(self, pdu: Pdu) -> None:
        self.pending[pdu.instance_id].discard(pdu.stream_ordering)

    def position(self) -> StreamToken:
        return StreamToken.from_positions(
            {w: (min(p) - 1 if p else self.next_id) for w, p in self.pending.items()}
        )


def fast_config(**kwargs: Any) -> FederationConfig:
    """A federation config with a short, deterministic backoff."""
    backoff = kwargs.pop("backoff", BackoffSection(initial_s=10.0, multiplier=2.0, max_s=80.0, jitter=0.2))
    return FederationConfig(backoff=backoff, **kwargs)


class Harness:
    """A federation sender over the fakes, on a deterministic clock.

    ``events_position`` follows :attr:`position` (by default the events
    stream's vector clock, updated by :meth:`send`). With ``treq=True`` the
    sender's transport is the real :class:`TreqFederationTransport` on
    :class:`~treq.testing.StubTreq`, and :attr:`transport` is the
    :class:`TreqRemote` answering it (same recording and script API as
    :class:`FakeTransport`).
    """

    def __init__(
        self,
        *,
        config: FederationConfig | None = None,
        instances: Sequence[str] = (),
        instance_name: str = "sender1",
        writers: Sequence[int] = (1,),
        store: FakeDestinationStore | None = None,
        clock: Clock | None = None,
        transport: Any = None,
        events: Events | None = None,
        treq: bool = False,
    ) -> None:
        self.clock = clock or Clock()
        if clock is None:
            self.clock.advance(1_000_000)
        self.store = store or FakeDestinationStore()
        wire: Any
        if treq:
            remote = TreqRemote(self.clock)
            remote.stub = StubTreq(mount_send(remote))
            self.transport: Any = remote
            wire = TreqFederationTransport(remote.stub, {}, self.clock, 30.0)
        else:
            self.transport = transport if transport is not None else FakeTransport(self.clock)
            wire = self.transport
        self.events = events or Events(writers)
        self.position: StreamToken = self.events.position()
        self.sent_callbacks: list[Any] = []
        self.sender = FederationSender(
            server_name=LOCAL,
            instance_name=instance_name,
            instances=instances,
            store=self.store,
            transport=wire,
            clock=self.clock,
            rng=random.Random(1234),
            config=config or fast_config(),
            events_position=lambda: self.position,
            on_sent=self.sent_callbacks.append,
        )

    def send(self, room: str, destinations: Sequence[str], writer: int = 1, **kwargs: Any) -> Pdu:
        """Persist an event and hand it to the sender, as the lead's follower will."""
        pdu = self.events.persist(room, writer, **kwargs)
        self.deliver(pdu, destinations)
        return pdu

    def deliver(self, pdu: Pdu, destinations: Sequence[str]) -> None:
        """Record rows, advance the processed position, then notify."""
        self.store.record_pdu(pdu, destinations)
        self.position = self.position.merge(self.events.position())
        self.sender.notify_new_pdu(pdu, destinations)

    def edu(self, destination: str, n: int = 0) -> Edu:
        edu = Edu("m.test", {"n": n})
        self.sender.send_edu(destination, edu)
        return edu

    def settle(self, destination: str) -> None:
        """Let a fresh queue finish its start-up catch-up (nothing outstanding)."""
        self.sender.wake_destination(destination)
        assert not self.sender.queue(destination).catching_up


class EitherTransport:
    """A mixin for tests run twice: over :class:`FakeTransport` (``treq = False``)
    and over the real treq transport on StubTreq (``treq = True``)."""

    treq = False

    def harness(self, **kwargs: Any) -> Harness:
        """A harness over this class's transport."""
        return Harness(treq=self.treq, **kwargs)


def release_all(testcase: Any, h: Harness, limit: int = 100) -> None:
    """Answer held transactions (and those they lead to) until none is held; fail after ``limit``."""
    for _ in range(limit):
        if not h.transport.held:
            return
        h.transport.release()
    testcase.fail(f"still holding transactions after {limit} replies: the queue keeps sending")
