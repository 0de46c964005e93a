"""Sender to receiver over treq's StubTreq: stable transaction IDs meet receiver dedupe, signed requests meet the gate."""

from __future__ import annotations

from typing import Any

from signedjson.key import generate_signing_key
from treq.testing import StubTreq
from twisted.internet.defer import succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from synflow.federation.auth import FEDERATION_PREFIX, FederationAuthResource, require_origin
from synflow.federation.keyring import KeyRing
from synflow.federation.keys import server_keys_response
from synflow.federation.transport import TreqFederationTransport, signer
from synflow.http.site import PrefixRoot
from tests.federation.fakes import LOCAL, Harness, mount_send
from tests.federation.test_inbound import Receiver

REMOTE = "remote.test"
SEND = "/_matrix/federation/v1/send"


class LosesFirstReply(Resource):
    """The remote processes the first request but its reply is lost (answered 500)."""

    isLeaf = True

    def __init__(self, inner: Resource, receiver: Receiver) -> None:
        super().__init__()
        self.inner = inner
        self.receiver = receiver
        self.txn_ids: list[str] = []

    def render(self, request: Any) -> Any:
        txn_id = request.postpath[0].decode()
        self.txn_ids.append(txn_id)
        if len(self.txn_ids) == 1:
            self.receiver.handler.on_send(None, txn_id, request.content.read())
            request.setResponseCode(500)
            return b'{"errcode": "M_UNKNOWN", "error": "lost"}'
        return self.inner.render(request)


class EndToEndTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.receiver = Receiver(allowed_origins=None)

    def test_500_then_200_reuses_the_txn_id_and_the_receiver_persists_once(self):
        """A transaction answered 500 then 200 is sent twice with one ID; the deduping receiver persists once."""
        flaky = LosesFirstReply(self.receiver.handler.resource(), self.receiver)
        h = self._with_transport(flaky)
        h.settle(REMOTE)
        pdu = h.send("!r", [REMOTE])
        self.assertEqual(len(flaky.txn_ids), 1)
        self.assertTrue(h.sender.queue(REMOTE).backing_off)
        h.clock.advance(10)
        self.assertEqual(len(flaky.txn_ids), 2)
        self.assertEqual(flaky.txn_ids[0], flaky.txn_ids[1])
        self.assertEqual(self.receiver.persisted, [("local.test", pdu.event_id)])
        self.assertFalse(h.sender.queue(REMOTE).backing_off)
        self.assertEqual([t.txn_id for t in h.sent_callbacks], flaky.txn_ids[:1])

    def test_batches_arrive_in_order(self):
        """120 events queued behind a slow transaction reach the receiver in order as 1, 50, 50, 19."""
        self.receiver.hold = []
        h = self._with_transport(self.receiver.handler.resource())
        h.settle(REMOTE)
        sent = [h.send(f"!r{i % 7}", [REMOTE]) for i in range(120)]
        for _ in range(500):
            if not self.receiver.hold:
                break
            self.receiver.hold.pop(0).callback(None)
            self.stub.flush()
        self.assertEqual([e for _, e in self.receiver.persisted], [p.event_id for p in sent])
        self.assertEqual([len(t.pdus) for t in h.sent_callbacks], [1, 50, 50, 19])
        self.assertEqual(len(self.receiver.store.responses), 4)

    def test_signed_transactions_pass_the_gate(self):
        """The sender's real transport signs each /send; the receiver's gate fetches its key and accepts it."""
        key = generate_signing_key("a_1")
        clock = Clock()
        clock.advance(1_000_000)
        receiver = Receiver(allowed_origins=[LOCAL])
        keyring = KeyRing(lambda server: succeed(server_keys_response(server, key, int(clock.seconds() * 1000))),
                          clock)
        gate = FederationAuthResource(REMOTE, keyring, {SEND: receiver.handler.resource(origin_of=require_origin)})
        root = PrefixRoot()
        root.mount(FEDERATION_PREFIX, gate)
        self.stub = StubTreq(root)
        transport = TreqFederationTransport(self.stub, {}, clock, 30.0, auth_headers=signer(LOCAL, key))
        h = Harness(clock=clock, transport=transport)
        h.settle(REMOTE)
        sent = [h.send("!r", [REMOTE]) for _ in range(3)]
        for _ in range(10):
            self.stub.flush()
            clock.advance(0)
        self.assertEqual(receiver.persisted, [(LOCAL, p.event_id) for p in sent])
        self.assertEqual({origin for origin, _ in receiver.store.responses}, {LOCAL})

    def _with_transport(self, leaf: Resource) -> Harness:
        clock = Clock()
        clock.advance(1_000_000)
        self.stub = StubTreq(mount_send(leaf))
        transport = TreqFederationTransport(self.stub, {}, clock, 30.0)
        return Harness(clock=clock, transport=transport)
