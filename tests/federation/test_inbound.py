"""Inbound /send: validation of garbage, dedupe on (origin, txn_id), the HTTP resource."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from treq.testing import StubTreq
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import HttpApiError
from synflow.federation.inbound import InboundTransactionHandler, validate_transaction
from synflow.http.server import JsonResource
from synflow.http.site import HealthResource, build_site
from tests.federation.fakes import mount_send

ORIGIN = "remote.test"


def pdu(n: int, **overrides: Any) -> dict[str, Any]:
    p = {
        "event_id": f"$ev{n}", "room_id": "!room:remote.test", "type": "m.room.message",
        "sender": "@u:remote.test", "content": {"body": str(n)}, "origin_server_ts": 1000 + n,
    }
    p.update(overrides)
    return {k: v for k, v in p.items() if v is not _DROP}


_DROP = object()


def body(pdus: list[Any] | None = None, edus: list[Any] | None = None, **overrides: Any) -> bytes:
    b: dict[str, Any] = {"origin": ORIGIN, "origin_server_ts": 5, "pdus": [pdu(1)] if pdus is None else pdus}
    if edus is not None:
        b["edus"] = edus
    b.update(overrides)
    return json.dumps({k: v for k, v in b.items() if v is not _DROP}).encode()


class FakeDedupeStore:
    def __init__(self) -> None:
        self.responses: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}

    def get_response(self, origin: str, txn_id: str) -> Deferred[tuple[int, dict[str, Any]] | None]:
        return succeed(self.responses.get((origin, txn_id)))

    def store_response(self, origin: str, txn_id: str, code: int, body: dict[str, Any]) -> Deferred[None]:
        self.responses[(origin, txn_id)] = (code, body)
        return succeed(None)


class Receiver:
    """A handler over fakes that records what it persisted."""

    def __init__(self, **kwargs: Any) -> None:
        self.store = FakeDedupeStore()
        self.persisted: list[tuple[str, str]] = []
        self.up: list[str] = []
        self.fail_event: str | None = None
        self.hold: list[Deferred[None]] | None = None
        kwargs.setdefault("allowed_origins", [ORIGIN, "other.test"])
        kwargs.setdefault("max_body_bytes", 20_000)
        self.handler = InboundTransactionHandler(self.store, self.persist, self.up.append, **kwargs)

    def persist(self, origin: str, p: dict[str, Any]) -> Deferred[None] | None:
        if p["event_id"] == self.fail_event:
            raise HttpApiError(403, "M_FORBIDDEN", "not allowed in this room")
        self.persisted.append((origin, p["event_id"]))
        if self.hold is not None:
            d: Deferred[None] = Deferred()
            self.hold.append(d)
            return d
        return None


def deep(levels: int) -> bytes:
    return body(pdus=[pdu(1, content={"x": json.loads("[" * levels + "]" * levels)})])


GARBAGE = [
    ("bad JSON", None, b"{not json", 400, "M_NOT_JSON"),
    ("invalid UTF-8", None, b'{"origin": "\xff\xfe"}', 400, "M_NOT_JSON"),
    ("NaN", None, b'{"origin": "remote.test", "origin_server_ts": NaN, "pdus": []}', 400, "M_NOT_JSON"),
    ("not an object", None, b"[1, 2]", 400, "M_BAD_JSON"),
    ("missing origin", None, body(origin=_DROP), 400, "M_BAD_JSON"),
    ("ill-typed origin", None, body(origin=7), 400, "M_BAD_JSON"),
    ("unlisted origin", None, body(origin="evil.test"), 400, "M_FORBIDDEN"),
    ("origin not the authenticated one", "other.test", body(), 401, "M_UNAUTHORIZED"),
    ("51 PDUs", None, body(pdus=[pdu(i) for i in range(51)]), 400, "M_TOO_LARGE"),
    ("101 EDUs", None, body(edus=[{"edu_type": "m.t", "content": {}}] * 101), 400, "M_TOO_LARGE"),
    ("oversized body", None, body(pdus=[pdu(1, content={"x": "y" * 30_000})]), 400, "M_TOO_LARGE"),
    ("deep nesting", None, deep(80), 400, "M_BAD_JSON"),
    ("very deep nesting", None, b'{"origin": "remote.test", "a": ' + b"[" * 9_000 + b"]" * 9_000 + b"}",
     400, "M_BAD_JSON"),
    ("pdus missing", None, body(pdus=_DROP), 400, "M_BAD_JSON"),
    ("edus not a list", None, body(edus={"a": 1}), 400, "M_BAD_JSON"),
    ("origin_server_ts a bool", None, body(origin_server_ts=True), 400, "M_BAD_JSON"),
    ("PDU not an object", None, body(pdus=["$ev1"]), 400, "M_BAD_JSON"),
    ("PDU without event_id", None, body(pdus=[pdu(1, event_id=_DROP)]), 400, "M_BAD_JSON"),
    ("PDU with an empty event_id", None, body(pdus=[pdu(1, event_id="")]), 400, "M_BAD_JSON"),
    ("Infinity outside the PDUs", None, b'{"origin": "remote.test", "origin_server_ts": 5, "pdus": [], "x": 1e999}',
     400, "M_BAD_JSON"),
    ("out-of-range transaction timestamp", None, body(origin_server_ts=2**53), 400, "M_BAD_JSON"),
    ("EDU without edu_type", None, body(edus=[{"content": {}}]), 400, "M_BAD_JSON"),
]


class ValidationTest(SynchronousTestCase):
    def test_garbage_is_refused_and_nothing_persisted(self):
        """Each kind of garbage gets its 4xx with {errcode, error}; nothing is persisted or remembered."""
        for name, origin, raw, code, errcode in GARBAGE:
            r = Receiver()
            got_code, got = self.successResultOf(r.handler.on_send(origin, "txn1", raw))
            self.assertEqual((got_code, got.get("errcode")), (code, errcode), name)
            self.assertEqual(set(got), {"errcode", "error"}, name)
            self.assertIsInstance(got["error"], str)
            self.assertEqual((r.persisted, r.store.responses, r.up), ([], {}, []), name)

    def test_limits_are_inclusive(self):
        """Exactly 50 PDUs and 100 EDUs are accepted."""
        txn = validate_transaction(
            None, "t", body(pdus=[pdu(i) for i in range(50)], edus=[{"edu_type": "m.t", "content": {}}] * 100),
            allowed_origins=None, max_body_bytes=10**6,
        )
        self.assertEqual((len(txn.pdus), len(txn.edus)), (50, 100))

    def test_bad_transaction_id(self):
        """An empty or over-long transaction ID is refused with M_INVALID_PARAM."""
        for txn_id in ("", "x" * 256):
            with self.assertRaises(HttpApiError) as e:
                validate_transaction(None, txn_id, body(), allowed_origins=None, max_body_bytes=10**6)
            self.assertEqual(e.exception.errcode, "M_INVALID_PARAM")

    def test_any_origin_when_unrestricted(self):
        """With allowed_origins None any origin is accepted (and the state_key may be given)."""
        txn = validate_transaction(
            None, "t", body(origin="x.test", pdus=[pdu(1, state_key="")]), allowed_origins=None,
            max_body_bytes=10**6,
        )
        self.assertEqual((txn.origin, txn.txn_id, txn.origin_server_ts), ("x.test", "t", 5))

    @given(st.binary(max_size=300))
    def test_random_bytes_never_crash(self, raw):
        """Arbitrary bytes produce a 400 with an errcode, never an exception or a persist."""
        r = Receiver()
        code, got = self.successResultOf(r.handler.on_send(None, "t", raw))
        self.assertEqual(code, 400)
        self.assertIn("errcode", got)
        self.assertEqual(r.persisted, [])

    @given(st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
            st.sampled_from(["origin", "pdus", "edus", "origin_server_ts", "event_id", "content", "x"]),
            inner, max_size=4),
        max_leaves=20,
    ))
    def test_random_json_is_refused_cleanly(self, value):
        """Arbitrary JSON values are either refused with an errcode or are well-formed transactions."""
        r = Receiver(allowed_origins=None)
        code, got = self.successResultOf(r.handler.on_send(None, "t", json.dumps(value).encode()))
        if code == 200:
            self.assertIsInstance(value, dict)
            self.assertEqual(len(r.persisted), len({p["event_id"] for p in value["pdus"]}))
        else:
            self.assertEqual(code, 400)
            self.assertIn("errcode", got)
            self.assertEqual(r.persisted, [])


class DedupeTest(SynchronousTestCase):
    def test_accepted_transaction_persists_each_pdu_and_reports_the_origin_up(self):
        """A valid transaction persists its PDUs in order, answers {pdus: {id: {}}} and reports the origin up."""
        r = Receiver()
        code, got = self.successResultOf(r.handler.on_send(ORIGIN, "t1", body(pdus=[pdu(1), pdu(2)])))
        self.assertEqual((code, got), (200, {"pdus": {"$ev1": {}, "$ev2": {}}}))
        self.assertEqual(r.persisted, [(ORIGIN, "$ev1"), (ORIGIN, "$ev2")])
        self.assertEqual(r.up, [ORIGIN])

    def test_per_pdu_errors_are_in_the_response(self):
        """A PDU that fails to persist gets {"error": ...}; the others still succeed."""
        r = Receiver()
        r.fail_event = "$ev2"
        code, got = self.successResultOf(r.handler.on_send(None, "t1", body(pdus=[pdu(1), pdu(2), pdu(3)])))
        self.assertEqual(code, 200)
        self.assertEqual(got["pdus"], {"$ev1": {}, "$ev2": {"error": "not allowed in this room"}, "$ev3": {}})

    def test_a_pdu_that_cannot_be_persisted_now_fails_the_transaction_for_a_retry(self):
        """A persister unreachable (502) answers the whole transaction 503, unremembered; the retry persists the rest."""
        r = Receiver()
        edus: list[Any] = []
        unreachable: HttpApiError | None = HttpApiError(
            502, "M_UNKNOWN", "failed to talk to 'persister1' (ConnectionRefusedError)")

        def flaky(origin: str, p: dict[str, Any]) -> Any:
            if p["event_id"] == "$ev2" and unreachable is not None:
                raise unreachable
            return r.persist(origin, p)

        r.handler = InboundTransactionHandler(r.store, flaky, r.up.append, allowed_origins=[ORIGIN],
                                              on_edu=lambda o, e: edus.append(e))
        txn = body(pdus=[pdu(1), pdu(2), pdu(3)], edus=[{"edu_type": "m.t", "content": {}}])
        code, got = self.successResultOf(r.handler.on_send(ORIGIN, "t1", txn))
        self.assertEqual((code, got["errcode"]), (503, "M_UNKNOWN"))
        self.assertEqual((r.persisted, edus, r.store.responses), ([(ORIGIN, "$ev1")], [], {}))
        unreachable = None
        code, got = self.successResultOf(r.handler.on_send(ORIGIN, "t1", txn))
        self.assertEqual((code, got), (200, {"pdus": {"$ev1": {}, "$ev2": {}, "$ev3": {}}}))
        self.assertEqual([e for _, e in r.persisted], ["$ev1", "$ev1", "$ev2", "$ev3"])
        self.assertEqual(len(edus), 1)

    def test_rooms_side_by_side_each_in_order(self):
        """Each room's PDUs are persisted one after another, in order; the rooms' PDUs are persisted side by side."""
        r = Receiver()
        r.hold = []
        a, b = "!a:remote.test", "!b:remote.test"
        d = r.handler.on_send(ORIGIN, "t1", body(pdus=[pdu(1, room_id=a), pdu(2, room_id=a), pdu(3, room_id=b)]))
        self.assertEqual([e for _, e in r.persisted], ["$ev1", "$ev3"])  # $ev2 waits for $ev1
        r.hold.pop(0).callback(None)
        self.assertEqual([e for _, e in r.persisted], ["$ev1", "$ev3", "$ev2"])
        self.assertNoResult(d)
        for held in r.hold:
            held.callback(None)
        self.assertEqual(list(self.successResultOf(d)[1]["pdus"]), ["$ev1", "$ev2", "$ev3"])

    def test_a_room_that_cannot_be_persisted_now_stops_but_other_rooms_go_on(self):
        """A PDU that cannot be persisted now stops its room's later PDUs; other rooms' are persisted; 503."""
        r = Receiver()
        a, b = "!a:remote.test", "!b:remote.test"

        def flaky(origin: str, p: dict[str, Any]) -> Any:
            if p["event_id"] == "$ev1":
                raise HttpApiError(502, "M_UNKNOWN", "failed to talk to 'persister1'")
            return r.persist(origin, p)

        r.handler = InboundTransactionHandler(r.store, flaky, r.up.append, allowed_origins=[ORIGIN])
        txn = body(pdus=[pdu(1, room_id=a), pdu(2, room_id=a), pdu(3, room_id=b)])
        code, _ = self.successResultOf(r.handler.on_send(ORIGIN, "t1", txn))
        self.assertEqual(code, 503)
        self.assertEqual(r.persisted, [(ORIGIN, "$ev3")])

    def test_repeated_transaction_returns_the_same_response_and_persists_once(self):
        """The same (origin, txn_id) again gets the stored response and persists nothing more."""
        r = Receiver()
        r.fail_event = "$ev2"
        first = self.successResultOf(r.handler.on_send(ORIGIN, "t1", body(pdus=[pdu(1), pdu(2)])))
        again = self.successResultOf(r.handler.on_send(ORIGIN, "t1", body(pdus=[pdu(1), pdu(2)])))
        self.assertEqual(again, first)
        self.assertEqual(r.persisted, [(ORIGIN, "$ev1")])
        self.assertEqual(r.up, [ORIGIN, ORIGIN])
        other = self.successResultOf(r.handler.on_send("other.test", "t1", body(origin="other.test")))
        self.assertEqual(other[0], 200)
        self.assertEqual(len(r.persisted), 2)

    def test_duplicate_while_the_first_is_running_waits_for_it(self):
        """A copy arriving while the first is still persisting gets the same response; one persist."""
        r = Receiver()
        r.hold = []
        d1 = r.handler.on_send(ORIGIN, "t1", body())
        d2 = r.handler.on_send(ORIGIN, "t1", body())
        self.assertNoResult(d1)
        self.assertNoResult(d2)
        r.hold.pop().callback(None)
        self.assertEqual(self.successResultOf(d1), self.successResultOf(d2))
        self.assertEqual(r.persisted, [(ORIGIN, "$ev1")])

    def test_duplicate_event_in_one_transaction_is_persisted_once(self):
        """An event listed twice in one transaction is persisted once."""
        r = Receiver()
        code, got = self.successResultOf(r.handler.on_send(None, "t1", body(pdus=[pdu(1), pdu(1)])))
        self.assertEqual((code, got), (200, {"pdus": {"$ev1": {}}}))
        self.assertEqual(len(r.persisted), 1)


class ResourceTest(SynchronousTestCase):
    URL = "https://local.test/_matrix/federation/v1/send/"

    def test_resource_answers_json(self):
        """PUT /send/{txnId} answers the handler's JSON: 200 for a good transaction, 400 for garbage."""
        r = Receiver()
        stub = StubTreq(mount_send(r.handler.resource()))
        resp = self.successResultOf(stub.put(self.URL + "t%201", data=body()))
        self.assertEqual(resp.code, 200)
        self.assertTrue(resp.headers.getRawHeaders(b"content-type")[0].startswith(b"application/json"))
        self.assertEqual(self.successResultOf(resp.json()), {"pdus": {"$ev1": {}}})
        self.assertIn((ORIGIN, "t 1"), r.store.responses)
        resp = self.successResultOf(stub.put(self.URL + "t2", data=b"\xff"))
        self.assertEqual(resp.code, 400)
        self.assertEqual(self.successResultOf(resp.json())["errcode"], "M_NOT_JSON")

    def test_resource_passes_the_authenticated_origin(self):
        """The origin from origin_of(request) must match the body's origin, else 401 M_UNAUTHORIZED."""
        r = Receiver()
        stub = StubTreq(mount_send(r.handler.resource(origin_of=lambda request: "other.test")))
        resp = self.successResultOf(stub.put(self.URL + "t1", data=body()))
        self.assertEqual(resp.code, 401)
        self.assertEqual(self.successResultOf(resp.json())["errcode"], "M_UNAUTHORIZED")
        self.assertEqual(r.persisted, [])

    def test_resource_answers_async_handlers(self):
        """A slow persist is answered once it finishes."""
        r = Receiver()
        r.hold = []
        stub = StubTreq(mount_send(r.handler.resource()))
        d = stub.put(self.URL + "t1", data=body())
        self.assertNoResult(d)
        r.hold.pop().callback(None)
        stub.flush()
        self.assertEqual(self.successResultOf(d).code, 200)

    def test_resource_needs_a_transaction_id(self):
        """PUT /send without a transaction ID is a 404."""
        stub = StubTreq(mount_send(Receiver().handler.resource()))
        resp = self.successResultOf(stub.put(self.URL, data=body()))
        self.assertEqual(resp.code, 404)


class _Echo(JsonResource):
    """A client-API-like resource without a limit of its own: answers the body's size."""

    def __init__(self) -> None:
        super().__init__("/_synflow/client/v1")
        self.route("PUT", "/echo", self.on_echo)

    async def on_echo(self, request: Any) -> tuple[int, Any]:
        return 200, {"size": len(self.body(request))}


def exchange(site: Any, path: str, payload: bytes, *, chunked: bool = False) -> tuple[int, dict[str, Any]]:
    """One HTTP/1.1 request through the site's real HTTPChannel on a StringTransport: (status, JSON body)."""
    channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    channel.callLater = Clock().callLater  # the idle timeout must not touch the global reactor
    transport = StringTransport()
    channel.makeConnection(transport)
    head = f"PUT {path} HTTP/1.1\r\nHost: local.test\r\nContent-Type: application/json\r\n"
    if chunked:
        step = 700
        parts = [payload[i:i + step] for i in range(0, len(payload), step)]
        data = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
        channel.dataReceived((head + "Transfer-Encoding: chunked\r\n\r\n").encode() + data)
    else:
        channel.dataReceived((head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload)
    raw = transport.value()
    status = int(raw.split(b" ", 2)[1])
    match = re.search(rb"\{.*\}", raw.partition(b"\r\n\r\n")[2], re.S)
    assert match is not None, raw
    channel.connectionLost(None)
    return status, json.loads(match.group(0))


def padded(size: int) -> bytes:
    """A valid transaction body of exactly ``size`` bytes (padding inside a PDU's content)."""
    base = body(pdus=[pdu(1, content={"pad": ""})])
    out = body(pdus=[pdu(1, content={"pad": "x" * (size - len(base))})])
    assert len(out) == size
    return out


class SiteBodyLimitTest(SynchronousTestCase):
    """On a real site whose listener limit is below the federation one, /send applies its own limit."""

    SEND = "/_matrix/federation/v1/send/"

    def setUp(self) -> None:
        self.receiver = Receiver(max_body_bytes=2000)
        self.site = build_site(
            {"/_matrix/federation/v1/send": self.receiver.handler.resource(), "/_synflow/client/v1": _Echo()},
            health=HealthResource(lambda: []), max_body_bytes=1000,
        )

    def test_send_body_between_the_limits_is_accepted(self):
        """A 1500-byte /send body passes (the federation limit, 2000, applies, not the listener's 1000)."""
        for chunked in (False, True):
            code, got = exchange(self.site, self.SEND + f"t{chunked}", padded(1500), chunked=chunked)
            self.assertEqual((code, got), (200, {"pdus": {"$ev1": {}}}), chunked)
        self.assertEqual(len(self.receiver.store.responses), 2)

    def test_send_body_over_the_federation_limit_is_400_too_large(self):
        """A /send body over the federation limit gets 400 M_TOO_LARGE (never 413), however it is framed."""
        for size in (2001, 5000):
            for chunked in (False, True):
                code, got = exchange(self.site, self.SEND + "t1", padded(size), chunked=chunked)
                self.assertEqual((code, got["errcode"]), (400, "M_TOO_LARGE"), (size, chunked))
                self.assertIn("2000", got["error"])
        self.assertEqual((self.receiver.persisted, self.receiver.store.responses), ([], {}))

    def test_other_resources_keep_the_listener_limit(self):
        """On the same listener, a resource without its own limit still refuses bodies over 1000 bytes."""
        self.assertEqual(exchange(self.site, "/_synflow/client/v1/echo", b"{}"), (200, {"size": 0}))
        code, got = exchange(self.site, "/_synflow/client/v1/echo", padded(1500))
        self.assertEqual((code, got["errcode"]), (413, "M_TOO_LARGE"))
        self.assertIn("1000", got["error"])

    def test_larger_listener_limit_still_applies_the_federation_one(self):
        """With a listener limit above the federation limit, /send bodies over 2000 bytes still get 400."""
        site = build_site({"/_matrix/federation/v1/send": self.receiver.handler.resource()},
                          health=HealthResource(lambda: []), max_body_bytes=10_000)
        code, got = exchange(site, self.SEND + "t1", padded(3000))
        self.assertEqual((code, got["errcode"]), (400, "M_TOO_LARGE"))
        self.assertEqual(exchange(site, self.SEND + "t2", padded(1999))[0], 200)
