"""The federation gate: only correctly signed requests reach any federation endpoint.

The real gate, key ring, ``/send`` resource and handler run on
:class:`treq.testing.StubTreq`; the receiving server is ``local.test`` and
the signing peers are ``remote.test`` and ``other.test``. Every forgery is
answered 401 (or 403 for an unlisted origin) and leaves nothing persisted,
remembered or reported.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from signedjson.key import generate_signing_key
from treq.testing import StubTreq
from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from synflow.federation.auth import (
    FEDERATION_PREFIX,
    KEY_PATH,
    MAX_JSON_DEPTH,
    FederationAuthResource,
    ServerKeyResource,
    authenticated_origin,
    require_origin,
)
from synflow.federation.keyring import KeyRing
from synflow.federation.keys import parse_server_keys, server_keys_response
from synflow.federation.signing import MAX_AUTH_HEADERS, auth_header
from synflow.http.site import PrefixRoot
from tests.federation.test_inbound import ORIGIN, Receiver, body, pdu

ME = "local.test"
OTHER = "other.test"
SEND = "/_matrix/federation/v1/send"
LATER = "/_matrix/federation/v1/added_later"
KEYS = {ORIGIN: generate_signing_key("a_1"), OTHER: generate_signing_key("a_1")}
MY_KEY = generate_signing_key("a_1")


class AddedLater(Resource):
    """An endpoint mounted behind the gate, standing for one another change adds later."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.origins: list[str | None] = []

    def render(self, request: Any) -> bytes:
        self.origins.append(authenticated_origin(request))
        return b"{}"


class Gate:
    """local.test's federation listener: the gate over /send and a later endpoint, and the key endpoint."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.receiver = Receiver(allowed_origins=[ORIGIN, OTHER])
        self.later = AddedLater()
        self.fetches: list[str] = []
        self.keyring = KeyRing(self.fetch, self.clock)
        gate = FederationAuthResource(ME, self.keyring, {
            SEND: self.receiver.handler.resource(origin_of=require_origin),
            LATER: self.later,
        }, allowed_origins=[ORIGIN, OTHER])
        root = PrefixRoot()
        root.mount(FEDERATION_PREFIX, gate)
        root.mount(KEY_PATH, ServerKeyResource(ME, MY_KEY, self.clock))
        self.stub = StubTreq(root)

    def fetch(self, server: str) -> Any:
        self.fetches.append(server)
        return succeed(server_keys_response(server, KEYS[server], int(self.clock.seconds() * 1000)))

    def request(self, method: str, path: str, raw: bytes | None, headers: list[bytes] | None = None) -> tuple[int, Any]:
        hdrs = {b"Content-Type": [b"application/json"]}
        if headers:
            hdrs[b"Authorization"] = headers
        d = self.stub.request(method, "http://local.test" + path, data=raw, headers=hdrs)
        self.stub.flush()
        response = self.successResultOf(d)
        d = response.content()
        self.stub.flush()
        return response.code, json.loads(self.successResultOf(d))

    def successResultOf(self, d: Any) -> Any:
        results: list[Any] = []
        d.addBoth(results.append)
        assert results, "no result"
        if hasattr(results[0], "raiseException"):
            results[0].raiseException()
        return results[0]

    def nothing_happened(self) -> bool:
        r = self.receiver
        return (r.persisted, r.store.responses, r.up) == ([], {}, [])


def signed(content: Any, *, origin: str = ORIGIN, destination: str = ME, key: Any = None,
           method: str = "PUT", uri: str = SEND + "/t1") -> bytes:
    return auth_header(origin, destination, key or KEYS[origin], method, uri, content)


class GateTest(SynchronousTestCase):
    def setUp(self):
        self.gate = Gate()

    def test_signed_send_is_accepted_as_its_origin(self):
        """A correctly signed /send is persisted and deduplicated under the authenticated origin."""
        raw = body()
        code, reply = self.gate.request("PUT", SEND + "/t1", raw, [signed(json.loads(raw))])
        self.assertEqual((code, reply), (200, {"pdus": {"$ev1": {}}}))
        self.assertEqual(self.gate.receiver.persisted, [(ORIGIN, "$ev1")])
        self.assertEqual(set(self.gate.receiver.store.responses), {(ORIGIN, "t1")})
        self.assertEqual(self.gate.fetches, [ORIGIN])

    def test_forgeries_are_refused_and_change_nothing(self):
        """No, wrong, other-key, replayed, mismatched and malformed signatures get 401 M_UNAUTHORIZED."""
        content = json.loads(body())
        intruder = generate_signing_key("a_1")
        cases = {
            "no signature": [],
            "signature over other content": [signed({**content, "pdus": []})],
            "signed by a key that is not the origin's": [signed(content, key=intruder)],
            "signed for another destination (replayed)": [signed(content, destination="elsewhere.test")],
            "replayed, header destination rewritten": [
                signed(content, destination="elsewhere.test").replace(b"elsewhere.test", ME.encode())],
            "signed for another path": [signed(content, uri=SEND + "/t2")],
            "signed for another method": [signed(content, method="POST")],
            "claims other.test, signed with remote.test's key": [
                signed(content, key=KEYS[ORIGIN]).replace(ORIGIN.encode(), OTHER.encode(), 1)],
            "body origin is not the signed origin": [signed(content, origin=OTHER)],
            "unknown key ID": [signed(content).replace(b"ed25519:a_1", b"ed25519:zz")],
            "malformed header": [b"X-Matrix origin"],
            "too many headers": [signed(content)] * (MAX_AUTH_HEADERS + 1),
        }
        for name, headers in cases.items():
            code, reply = self.gate.request("PUT", SEND + "/t1", json.dumps(content).encode(), headers)
            self.assertEqual((code, reply["errcode"]), (401, "M_UNAUTHORIZED"), name)
            self.assertTrue(self.gate.nothing_happened(), name)

    def test_unlisted_origin_is_forbidden_before_any_key_fetch(self):
        """An origin not allowed to federate gets 403 and makes this server fetch nothing."""
        content = json.loads(body(origin="evil.test"))
        header = auth_header("evil.test", ME, generate_signing_key("a_1"), "PUT", SEND + "/t1", content)
        code, reply = self.gate.request("PUT", SEND + "/t1", json.dumps(content).encode(), [header])
        self.assertEqual((code, reply["errcode"]), (403, "M_FORBIDDEN"))
        self.assertEqual(self.gate.fetches, [])
        self.assertTrue(self.gate.nothing_happened())

    def test_dedupe_cannot_be_poisoned(self):
        """A forger's transaction under remote.test's next ID neither persists nor blocks the real one."""
        forged = json.loads(body(pdus=[pdu(666)]))
        for headers in ([], [signed(forged, key=generate_signing_key("a_1"))]):
            code, _ = self.gate.request("PUT", SEND + "/t1", json.dumps(forged).encode(), headers)
            self.assertEqual(code, 401)
        # other.test, a peer with a valid key, sends its own t1 without a body origin: it is other.test's.
        mine = {"origin_server_ts": 1, "pdus": [pdu(7, sender="@u:other.test")]}
        code, _ = self.gate.request("PUT", SEND + "/t1", json.dumps(mine).encode(), [signed(mine, origin=OTHER)])
        self.assertEqual(code, 200)
        real = json.loads(body())
        code, reply = self.gate.request("PUT", SEND + "/t1", json.dumps(real).encode(), [signed(real)])
        self.assertEqual((code, reply), (200, {"pdus": {"$ev1": {}}}))
        self.assertEqual(self.gate.receiver.persisted, [(OTHER, "$ev7"), (ORIGIN, "$ev1")])
        self.assertEqual(set(self.gate.receiver.store.responses), {(OTHER, "t1"), (ORIGIN, "t1")})

    def test_endpoints_added_later_are_behind_the_gate(self):
        """Any endpoint mounted in the gate sees only authenticated requests, with their origin."""
        code, reply = self.gate.request("GET", LATER, None)
        self.assertEqual((code, reply["errcode"]), (401, "M_UNAUTHORIZED"))
        self.assertEqual(self.gate.later.origins, [])
        header = signed(None, method="GET", uri=LATER)
        self.assertEqual(self.gate.request("GET", LATER, None, [header]), (200, {}))
        self.assertEqual(self.gate.later.origins, [ORIGIN])

    def test_unmounted_federation_path_is_404_after_authentication(self):
        """A signed request for an unknown federation path is 404; unsigned it is 401."""
        self.assertEqual(self.gate.request("GET", "/_matrix/federation/v9/x", None)[0], 401)
        header = signed(None, method="GET", uri="/_matrix/federation/v9/x")
        self.assertEqual(self.gate.request("GET", "/_matrix/federation/v9/x", None, [header])[0], 404)

    def test_non_json_body_is_400(self):
        """A body that is not JSON cannot be signed and gets 400 M_NOT_JSON."""
        code, reply = self.gate.request("PUT", SEND + "/t1", b"{not json", [signed({})])
        self.assertEqual((code, reply["errcode"]), (400, "M_NOT_JSON"))
        self.assertTrue(self.gate.nothing_happened())

    def test_unencodable_or_deep_content_is_refused_cleanly(self):
        """A lone surrogate (no signer can encode it) gets 401; nesting past MAX_JSON_DEPTH gets 400."""
        raw = b'{"origin": "remote.test", "origin_server_ts": 1, "pdus": [], "x": "\\ud800"}'
        header = signed({"origin": ORIGIN, "origin_server_ts": 1, "pdus": []})
        self.assertEqual(self.gate.request("PUT", SEND + "/t1", raw, [header])[0], 401)
        deep = b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}"
        code, reply = self.gate.request("PUT", SEND + "/t1", deep, [header])
        self.assertEqual((code, reply["errcode"]), (400, "M_BAD_JSON"))
        edge = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
        self.assertEqual(self.gate.request("PUT", SEND + "/t1", edge, [header])[0], 401)
        self.assertTrue(self.gate.nothing_happened())

    @settings(max_examples=60, deadline=None)
    @given(content=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
        max_leaves=12))
    def test_any_json_with_a_stale_signature_is_401(self, content: Any):
        """Arbitrary JSON bodies under a signature over other content get 401, never a 500."""
        gate = Gate()
        code, reply = gate.request("PUT", SEND + "/t1", json.dumps(content).encode(), [signed({"other": True})])
        self.assertEqual((code, reply["errcode"]), (401, "M_UNAUTHORIZED"))
        self.assertTrue(gate.nothing_happened())

    def test_send_resource_alone_refuses_unauthenticated(self):
        """Mounted without the gate, /send with require_origin still answers 401."""
        receiver = Receiver()
        stub = StubTreq(PrefixRoot())
        root = PrefixRoot()
        root.mount(SEND, receiver.handler.resource(origin_of=require_origin))
        stub = StubTreq(root)
        response = self.successResultOf(stub.put("http://local.test" + SEND + "/t1", data=body()))
        self.assertEqual(response.code, 401)
        self.assertEqual(receiver.persisted, [])

    def test_key_endpoint_is_public_and_self_signed(self):
        """GET /_matrix/key/v2/server needs no signature and returns a verifiable response."""
        code, reply = self.gate.request("GET", KEY_PATH, None)
        self.assertEqual(code, 200)
        keys = parse_server_keys(ME, reply, int(self.gate.clock.seconds() * 1000))
        self.assertEqual(list(keys.keys), ["ed25519:a_1"])
