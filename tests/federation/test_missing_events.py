"""get_missing_events: the request's bounds, the walk on real databases, the resource over real HTTP, and the gap filler.

The origin's events are written by the persister's own SQL
(:mod:`tests.federation.sql`) on SQLite and PostgreSQL. The resource is
served on a loopback port and asked through the real
:class:`~synflow.federation.transport.TreqFederationTransport`, so the
request is the one a receiving synflow sends; the receiving side's
:class:`~synflow.federation.gaps.GapFiller` runs over it with an in-memory
record of what the receiver has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site

from synflow.errors import HttpApiError
from synflow.events.persist import EventSpec
from synflow.federation.gaps import GapFiller, check_reply
from synflow.federation.interfaces import TransactionFailed
from synflow.federation.missing_events import (
    GET_MISSING_EVENTS_PREFIX,
    MAX_EVENT_IDS,
    MAX_ID_BYTES,
    MAX_LIMIT,
    MissingEventsResource,
    SqlMissingEventsStore,
    parse_missing_events_request,
)
from synflow.federation.transport import TreqFederationTransport, build_treq_client
from synflow.http.site import PrefixRoot
from synflow.storage.instances import InstanceMap
from tests.dbutil import make_database
from tests.federation.sql import SERVER, create_room, member, message, persist

ROOM = f"!room:{SERVER}"
ALICE = f"@alice:{SERVER}"
R1, R2 = "r1.test", "r2.test"


def eid(i: int) -> str:
    return f"$so{i}:{SERVER}"


def request(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


class ParseTest(SynchronousTestCase):
    def test_a_full_request(self):
        """A well-formed request is read whole; a limit above the bound is lowered to it."""
        r = parse_missing_events_request(ROOM, request(earliest_events=["$a"], latest_events=["$b", "$b"],
                                                       limit=10_000, min_depth=3))
        self.assertEqual((r.room_id, r.earliest_events, r.latest_events, r.limit, r.min_depth),
                         (ROOM, ("$a",), ("$b",), MAX_LIMIT, 3))
        self.assertEqual(parse_missing_events_request(ROOM, request(latest_events=["$b"])).limit, 10)

    def test_each_bad_field_is_refused_with_what_is_wrong(self):
        """Every unbounded or ill-typed field is a 400 naming it."""
        long_id = "$" + "x" * MAX_ID_BYTES
        cases = [
            (b"{nope", "M_NOT_JSON", "not valid JSON"),
            (b'{"latest_events": ["$a"], "limit": NaN}', "M_NOT_JSON", "NaN"),
            (request(), "M_MISSING_PARAM", "latest_events"),
            (request(latest_events="$a"), "M_BAD_JSON", "latest_events must be an array"),
            (request(latest_events=[5]), "M_BAD_JSON", "latest_events[0]"),
            (request(latest_events=[long_id]), "M_BAD_JSON", "more than 255"),
            (request(latest_events=["$\ud800"]), "M_BAD_JSON", "not valid UTF-8"),
            (request(latest_events=[f"${i}" for i in range(MAX_EVENT_IDS + 1)]), "M_BAD_JSON", "more than 20"),
            (request(latest_events=["$a"], earliest_events=[""]), "M_BAD_JSON", "earliest_events[0]"),
            (request(latest_events=["$a"], limit=-1), "M_BAD_JSON", "limit must be in"),
            (request(latest_events=["$a"], limit=2**60), "M_BAD_JSON", "limit must be in"),
            (request(latest_events=["$a"], limit=True), "M_BAD_JSON", "limit must be an integer"),
            (request(latest_events=["$a"], min_depth=1.5), "M_BAD_JSON", "min_depth must be an integer"),
            (b"[]", "M_BAD_JSON", "not an object"),
            (b" " * (64 * 1024 + 1), "M_TOO_LARGE", "bytes"),
        ]
        for body, errcode, fragment in cases:
            with self.assertRaises(HttpApiError, msg=body[:60]) as cm:
                parse_missing_events_request(ROOM, body)
            self.assertEqual((cm.exception.code, cm.exception.errcode), (400, errcode), body[:60])
            self.assertIn(fragment, cm.exception.msg)

    @given(st.integers(0, MAX_EVENT_IDS), st.integers(1, MAX_ID_BYTES - 1), st.integers(0, 2**53 - 1))
    def test_everything_within_the_bounds_is_accepted(self, n, length, limit):
        """ID lists up to the bound, IDs up to 255 bytes and any limit in range are accepted, the limit capped."""
        ids = [f"${i:0{length}d}"[:length + 1] for i in range(max(n, 1))]
        r = parse_missing_events_request(ROOM, request(latest_events=ids, earliest_events=ids[:n], limit=limit))
        self.assertEqual(r.limit, min(limit, MAX_LIMIT))
        self.assertLessEqual(len(r.latest_events), MAX_EVENT_IDS)


async def origin_room(db: Any) -> dict[str, list[int]]:
    """The origin's public room: r1.test joins after the creation, r2.test later; returns stream IDs by phase."""
    specs = [*create_room(ROOM, ALICE), public(ROOM, ALICE), member(ROOM, f"@bob:{R1}", "join")]  # 1-4
    specs += [message(ROOM, ALICE, f"m{i}") for i in range(8)]  # 5-12
    specs += [member(ROOM, f"@carol:{R2}", "join")]  # 13
    specs += [message(ROOM, ALICE, f"n{i}") for i in range(4)]  # 14-17
    await InstanceMap(db).ids_for(["persister1"])
    await persist(db, "persister1", list(enumerate(specs, start=1)))
    return {"before_r1": [1, 2, 3], "messages": list(range(5, 13)), "after_r2": list(range(14, 18))}


def public(room: str, sender: str) -> EventSpec:
    """The creator opens the room: remote users may join without an invite."""
    return EventSpec(room, "m.room.join_rules", sender, {"join_rule": "public"}, state_key="", origin=SERVER)


class Served:
    """The origin's get_missing_events on a loopback port, and the transport a receiver uses to ask it."""

    def __init__(self, testcase: TestCase, db: Any, allowed: Sequence[str] | None = (R1, R2)) -> None:
        root = PrefixRoot()
        root.mount(GET_MISSING_EVENTS_PREFIX, MissingEventsResource(SqlMissingEventsStore(db, SERVER),
                                                                    allowed_origins=allowed))
        site = Site(root)
        site.noisy = False
        self.port = reactor.listenTCP(0, site, interface="127.0.0.1")
        testcase.addCleanup(self.port.stopListening)
        self.url = f"http://127.0.0.1:{self.port.getHost().port}"
        self.client = build_treq_client(reactor, persistent=False)

    def transport(self, asker: str) -> TreqFederationTransport:
        return TreqFederationTransport(self.client, {SERVER: self.url}, reactor, 10.0, server_name=asker)

    async def ask(self, asker: str, **body: Any) -> list[str]:
        reply = await self.transport(asker).get_missing_events(SERVER, ROOM, body)
        return [e["event_id"] for e in reply["events"]]

    async def raw(self, body: bytes, headers: dict[bytes, list[bytes]], room: str = ROOM) -> tuple[int, Any]:
        from urllib.parse import quote

        response = await self.client.post(f"{self.url}{GET_MISSING_EVENTS_PREFIX}/{quote(room, safe='')}",
                                          data=body, headers=headers)
        return response.code, json.loads(await response.content())


class WalkTestsMixin:
    engine: str

    async def test_the_requesters_events_between_earliest_and_latest_oldest_first(self) -> None:
        """The walk returns, oldest first, the events created here that the requester was sent, between the two ends."""
        db = await make_database(self, self.engine)
        await origin_room(db)
        served = Served(self, db)
        got = await served.ask(R1, earliest_events=[eid(6)], latest_events=[eid(12)], limit=50)
        self.assertEqual(got, [eid(i) for i in range(7, 12)])
        # No earliest event: back to r1.test's arrival, never before it (create, alice's join and the
        # join rule were not its).
        got = await served.ask(R1, latest_events=[eid(17)], limit=50)
        self.assertEqual(got, [eid(i) for i in (*range(5, 13), 14, 15, 16)])
        # r2.test joined at 13 (its own event, which the walk passes through): it gets only what came after.
        got = await served.ask(R2, latest_events=[eid(17)], limit=50)
        self.assertEqual(got, [eid(i) for i in (14, 15, 16)])

    async def test_limit_keeps_the_events_nearest_the_latest_and_min_depth_stops_the_walk(self) -> None:
        """A limit returns the events just before the latest; min_depth leaves out anything lower."""
        db = await make_database(self, self.engine)
        await origin_room(db)
        served = Served(self, db)
        self.assertEqual(await served.ask(R1, latest_events=[eid(12)], limit=3), [eid(9), eid(10), eid(11)])
        self.assertEqual(await served.ask(R1, latest_events=[eid(12)], limit=50, min_depth=10),
                         [eid(10), eid(11)])
        self.assertEqual(await served.ask(R1, latest_events=[eid(12)], limit=0), [])
        self.assertEqual(await served.ask(R1, latest_events=["$unknown:x"], limit=50), [])

    async def test_a_server_with_no_member_in_the_room_is_refused(self) -> None:
        """An allowed server with no joined member gets 403 M_FORBIDDEN and no events."""
        db = await make_database(self, self.engine)
        await origin_room(db)
        served = Served(self, db, allowed=None)
        with self.assertRaises(TransactionFailed) as cm:
            await served.ask("stranger.test", latest_events=[eid(12)])
        self.assertIn("403", cm.exception.reason)
        self.assertIn("M_FORBIDDEN", cm.exception.reason)

    async def test_unauthenticated_disallowed_and_malformed_requests(self) -> None:
        """No origin is 401, a disallowed one 403, a bad body 400, each with a JSON error; the resource serves on."""
        db = await make_database(self, self.engine)
        await origin_room(db)
        served = Served(self, db)
        ok = request(latest_events=[eid(12)], limit=2)
        as_r1 = {b"Authorization": [b"X-Matrix origin=r1.test,destination=local.test"]}
        cases = [
            (ok, {}, 401, "M_UNAUTHORIZED"),
            (ok, {b"Authorization": [b'X-Matrix origin="evil.test",destination=local.test']}, 403, "M_FORBIDDEN"),
            (b"{", as_r1, 400, "M_NOT_JSON"),
            (request(latest_events=[7]), as_r1, 400, "M_BAD_JSON"),
        ]
        for body, headers, code, errcode in cases:
            self.assertEqual((await served.raw(body, headers))[0], code, (body, headers))
            self.assertEqual((await served.raw(body, headers))[1]["errcode"], errcode)
        self.assertEqual((await served.raw(ok, as_r1, room="x" * 300))[1]["errcode"], "M_BAD_JSON")
        code, reply = await served.raw(ok, as_r1)
        self.assertEqual((code, [e["event_id"] for e in reply["events"]]), (200, [eid(10), eid(11)]))

    async def test_gap_filler_pulls_pages_and_persists_oldest_first_before_the_pdu(self) -> None:
        """A PDU whose predecessor is unknown has the gap pulled in pages and persisted in room order, then itself."""
        db = await make_database(self, self.engine)
        await origin_room(db)
        served = Served(self, db)
        receiver = Receiver(known={eid(6)})
        filler = GapFiller(receiver, served.transport(R1), receiver.persist, page_limit=2)
        pdu = await origin_pdu(db, 12)
        await filler.persist_pdu(SERVER, pdu)
        self.assertEqual(receiver.persisted, [eid(i) for i in range(7, 13)])
        self.assertEqual(receiver.earliest, [[eid(6)]])
        # A bound smaller than the gap: the nearest events are pulled, the PDU persisted anyway.
        receiver = Receiver(known=set())
        filler = GapFiller(receiver, served.transport(R1), receiver.persist, max_per_gap=3, page_limit=2)
        await filler.persist_pdu(SERVER, pdu)
        self.assertEqual(receiver.persisted, [eid(9), eid(10), eid(11), eid(12)])


async def origin_pdu(db: Any, stream_id: int) -> dict[str, Any]:
    """The PDU of one of the origin's events, as its sender sends it."""
    from synflow.federation.storage import SqlDestinationStore
    from synflow.tokens import StreamToken

    pdus = await SqlDestinationStore(db).get_catch_up_events(R1, StreamToken.at(stream_id - 1),
                                                             StreamToken.at(stream_id), 1)
    return dict(pdus[0].json)


class Receiver:
    """The receiving server's side, in memory: the events it has, and what it persists in order."""

    def __init__(self, known: set[str], room_known: bool = True) -> None:
        self.known = set(known)
        self.persisted: list[str] = []
        self.earliest: list[list[str]] = []
        self._room_known = room_known

    def unknown_events(self, event_ids: Sequence[str]) -> Deferred[set[str]]:
        return succeed(set(event_ids) - self.known)

    def room_known(self, room_id: str) -> Deferred[bool]:
        return succeed(self._room_known)

    def latest_event_from(self, room_id: str, origin: str) -> Deferred[str | None]:
        mine = sorted((e for e in self.known if e.endswith(f":{origin}")),
                      key=lambda e: int(re.sub(r"\D", "", e.split(":")[0]) or 0))
        self.earliest.append(mine[-1:])
        return succeed(mine[-1] if mine else None)

    def persist(self, origin: str, pdu: dict[str, Any]) -> None:
        if pdu.get("content", {}).get("refuse"):
            raise HttpApiError(403, "M_FORBIDDEN", "refused")
        self.persisted.append(pdu["event_id"])
        self.known.add(pdu["event_id"])


class SqliteWalkTest(WalkTestsMixin, TestCase):
    engine = "sqlite"


class PostgresWalkTest(WalkTestsMixin, TestCase):
    engine = "postgres"


def pdu(i: int, origin: str = SERVER, prev: Any = "default", **extra: Any) -> dict[str, Any]:
    body = {"event_id": f"$e{i}:{origin}", "room_id": ROOM, "type": "m.room.message", "sender": f"@u:{origin}",
            "content": {}, "origin_server_ts": 1, "depth": i,
            "prev_events": [f"$e{i - 1}:{origin}"] if prev == "default" else prev}
    body.update(extra)
    return body


class ScriptedTransport:
    """A get_missing_events transport answering from a list (a reply dict or an exception each)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.asked: list[dict[str, Any]] = []

    def get_missing_events(self, destination: str, room_id: str, body: dict[str, Any]) -> Deferred[Any]:
        self.asked.append(body)
        answer = self.answers.pop(0)
        return fail(answer) if isinstance(answer, Exception) else succeed(answer)


class GapFillerTest(SynchronousTestCase):
    def test_known_predecessors_need_no_request(self):
        """A PDU whose prev_events are all known is persisted without asking anything."""
        receiver = Receiver(known={"$e1:local.test"})
        transport = ScriptedTransport()
        self.successResultOf(GapFiller(receiver, transport, receiver.persist).persist_pdu(SERVER, pdu(2)))
        self.assertEqual((receiver.persisted, transport.asked), (["$e2:local.test"], []))

    def test_unknown_room_needs_no_request(self):
        """A PDU of a room the receiver does not have (an invite) is persisted without asking."""
        receiver = Receiver(known=set(), room_known=False)
        transport = ScriptedTransport()
        self.successResultOf(GapFiller(receiver, transport, receiver.persist).persist_pdu(SERVER, pdu(2)))
        self.assertEqual((receiver.persisted, transport.asked), (["$e2:local.test"], []))

    def test_failed_request_still_persists_the_pdu(self):
        """The origin failing to answer (or answering garbage) costs the gap, never the PDU."""
        for answer in (TransactionFailed("HTTP 404"), {"events": "nope"}, {"events": [{"event_id": 1}]},
                       {"events": [pdu(1, depth=2**60)]}, {"events": [pdu(1, prev=["x" * 300])]}):
            receiver = Receiver(known={"$e0:local.test"})
            filler = GapFiller(receiver, ScriptedTransport(answer), receiver.persist)
            self.successResultOf(filler.persist_pdu(SERVER, pdu(5)))
            self.assertEqual(receiver.persisted, ["$e5:local.test"], answer)

    def test_only_the_origins_own_unknown_events_are_persisted_in_depth_order(self):
        """Pulled events of another server, another room or already known are skipped; a refused one does not stop the rest."""
        receiver = Receiver(known={"$e0:local.test", "$e2:local.test"})
        reply = {"events": [pdu(3), pdu(1), pdu(2), pdu(9, origin="other.test"), pdu(4, room_id="!else:x"),
                            pdu(3, content={"refuse": True}, event_id="$r:local.test")]}
        filler = GapFiller(receiver, ScriptedTransport(reply), receiver.persist)
        self.successResultOf(filler.persist_pdu(SERVER, pdu(5)))
        self.assertEqual(receiver.persisted, ["$e1:local.test", "$e3:local.test", "$e5:local.test"])

    def test_a_pulled_event_that_cannot_be_persisted_now_fails_the_pdu_for_a_retry(self):
        """A persister unreachable (502) while persisting a pulled event fails the PDU with it, so the transaction is retried."""
        receiver = Receiver(known={"$e0:local.test"})

        def unreachable(origin: str, event: dict[str, Any]) -> None:
            if event["event_id"] == "$e2:local.test":
                raise HttpApiError(502, "M_UNKNOWN", "failed to talk to 'persister1'")
            receiver.persist(origin, event)

        filler = GapFiller(receiver, ScriptedTransport({"events": [pdu(1), pdu(2)]}), unreachable)
        d = filler.persist_pdu(SERVER, pdu(3))
        self.assertEqual(self.failureResultOf(d, HttpApiError).value.code, 502)
        self.assertEqual(receiver.persisted, ["$e1:local.test"])

    def test_ill_formed_prev_events_refuse_the_pdu(self):
        """prev_events that are not a bounded list of IDs are the PDU's own error; nothing is persisted."""
        for prev in ("$x", [1], ["$x"] * 21, ["y" * 256]):
            receiver = Receiver(known=set())
            d = GapFiller(receiver, ScriptedTransport(), receiver.persist).persist_pdu(SERVER, pdu(2, prev=prev))
            self.assertEqual(self.failureResultOf(d, HttpApiError).value.code, 400)
            self.assertEqual(receiver.persisted, [])

    def test_a_reply_longer_than_asked_is_refused(self):
        """A reply with more events than the limit is refused whole."""
        with self.assertRaises(HttpApiError):
            check_reply({"events": [pdu(i) for i in range(3)]}, 2)
