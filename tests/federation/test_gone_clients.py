"""A federation endpoint whose caller disconnected before the answer writes nothing and logs no error.

Each endpoint is served by a real ``HTTPChannel`` on a string transport:
the request arrives, its work is held, the connection is lost, then the
work finishes. The answer must be dropped (twisted.web's ``Request`` marks a
lost client; writing to it and finishing it would raise), and the next
caller is served as usual.
"""

from __future__ import annotations

import gc
import json
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site

from synflow.federation.auth import FEDERATION_PREFIX, FederationAuthResource, require_origin
from synflow.federation.keyring import KeyRing
from synflow.federation.keys import server_keys_response
from synflow.federation.missing_events import GET_MISSING_EVENTS_PREFIX, MissingEventsResource
from synflow.http.site import PrefixRoot
from tests.federation.fakes import mount_send
from tests.federation.test_auth import KEYS, ME, SEND, signed
from tests.federation.test_inbound import ORIGIN, Receiver, body


def _connect(site: Site) -> tuple[Any, StringTransport]:
    channel = site.buildProtocol(None)
    channel.callLater = Clock().callLater  # its idle timeout: not on the global reactor
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport


def _request(method: str, path: str, payload: bytes, authorization: bytes | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {ME}\r\nContent-Type: application/json\r\n"
    if authorization is not None:
        head += f"Authorization: {authorization.decode()}\r\n"
    return (head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


class GoneClientTest(SynchronousTestCase):
    def _gone_then(self, site: Site, request: bytes, release: Any) -> None:
        """Send ``request``, drop the connection, then ``release()`` the held work: nothing written, nothing
        logged at WARNING or above, no error left in the log."""
        channel, transport = _connect(site)
        channel.dataReceived(request)
        self.assertEqual(transport.value(), b"", "answered before the held work finished")
        channel.connectionLost(Failure(ConnectionDone()))
        with self.assertNoLogs("synflow", level="WARNING"):
            release()
        self.assertEqual(transport.value(), b"")
        gc.collect()  # a failure left in a dropped Deferred is logged when it is collected
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_send_answered_after_the_origin_left(self) -> None:
        """``PUT /send``: the transaction still persists; its answer is dropped; the next one is answered."""
        receiver = Receiver()
        receiver.hold = []
        site = Site(mount_send(receiver.handler.resource()))
        path = SEND + "/t1"

        def release() -> None:
            while receiver.hold:
                receiver.hold.pop().callback(None)

        self._gone_then(site, _request("PUT", path, body()), release)
        self.assertEqual(receiver.persisted, [(ORIGIN, "$ev1")])
        receiver.hold = None
        channel, transport = _connect(site)
        channel.dataReceived(_request("PUT", SEND + "/t2", body()))
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 "), transport.value())

    def test_gate_authenticated_after_the_origin_left(self) -> None:
        """The signature gate, still fetching the origin's key when the origin left: the endpoint behind it
        is not run and nothing is answered."""
        clock = Clock()
        clock.advance(1_700_000_000)
        fetching: list[Deferred[Any]] = []

        def fetch(server: str) -> Deferred[Any]:
            d: Deferred[Any] = Deferred()
            fetching.append(d)
            return d

        receiver = Receiver()
        gate = FederationAuthResource(ME, KeyRing(fetch, clock),
                                      {SEND: receiver.handler.resource(origin_of=require_origin)}, allowed_origins=[ORIGIN])
        root = PrefixRoot()
        root.mount(FEDERATION_PREFIX, gate)
        raw = body()

        def release() -> None:
            fetching.pop().callback(server_keys_response(ORIGIN, KEYS[ORIGIN], int(clock.seconds() * 1000)))

        self._gone_then(Site(root), _request("PUT", SEND + "/t1", raw, signed(json.loads(raw))), release)
        self.assertEqual(receiver.persisted, [])

    def test_missing_events_answered_after_the_origin_left(self) -> None:
        """``get_missing_events``: the walk's answer is dropped."""
        walks: list[Deferred[Any]] = []

        class _HeldStore:
            def missing_events(self, parsed: Any, origin: str) -> Deferred[Any]:
                d: Deferred[Any] = Deferred()
                walks.append(d)
                return d

        root = PrefixRoot()
        root.mount(GET_MISSING_EVENTS_PREFIX, MissingEventsResource(_HeldStore(), allowed_origins=None))  # type: ignore[arg-type]
        payload = json.dumps({"latest_events": [f"$e1:{ORIGIN}"]}).encode()
        path = f"{GET_MISSING_EVENTS_PREFIX}/%21room%3A{ORIGIN}"
        auth = f'X-Matrix origin="{ORIGIN}",key="ed25519:a_1",sig="x"'.encode()
        self._gone_then(Site(root), _request("POST", path, payload, auth), lambda: walks.pop().callback([]))
