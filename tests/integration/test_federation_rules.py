"""The room rules across two real synflow deployments (twistd processes, real TCP).

The shared-room flow the demo and the workload use -- the creator invites a
remote user, the invite's PDU reaches the remote server, the user joins
through their own server, the join's PDU is accepted by the room's server --
works under the rules; a PDU that breaks them is refused and changes nothing.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.federation.keys import load_or_create_signing_key
from synflow.federation.signing import auth_header
from synflow.tools.client import ApiError, Client, new_pool
from tests.cluster import free_port, sleep, wait_until
from tests.integration.test_federation import Side, messages

FEDERATION = {"wakeup_interval_s": 1.0, "request_timeout_s": 5.0,
              "backoff": {"initial_s": 0.2, "multiplier": 2.0, "max_s": 4.0, "jitter": 0.1}}


def _put(url: str, body: dict[str, Any], authorization: bytes | None = None) -> tuple[int, dict[str, Any]]:
    """PUT JSON (with an ``Authorization`` header if given); the status and the JSON answer, whatever the status."""
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization.decode()
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class FederationRulesTest(TestCase):
    timeout = 300

    @inlineCallbacks
    def setUp(self) -> Any:
        fed_a, fed_b = free_port(), free_port()
        self.a = Side(self, "a.test", "sqlite", "b.test", fed_b, fed_a, FEDERATION)
        self.b = Side(self, "b.test", "sqlite", "a.test", fed_a, fed_b, FEDERATION)
        yield self.a.start()
        yield self.b.start()
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)

    async def _join_when_invited(self, user: Client, room: str) -> None:
        """Join through the user's own server once the invite's PDU has made the room known there."""
        for _ in range(300):
            try:
                await user.join(room)
                return
            except ApiError as e:
                if e.code != 404:
                    raise
            await sleep(0.1)
        self.fail(f"the invite to {room} never reached {user.base_url}")

    @inlineCallbacks
    def test_shared_room_flow_and_forged_pdus(self) -> None:
        """Invite, remote join and messages both ways work under the rules; an uninvited remote user and forged PDUs are refused."""
        yield ensureDeferred(self._flow())

    async def _flow(self) -> None:
        alice = await Client(self.a.url, self.pool).register("alice")
        bob = await Client(self.b.url, self.pool).register("bob")
        eve = await Client(self.b.url, self.pool).register("eve")
        assert bob.user_id is not None and alice.user_id is not None
        room = await alice.create_room()
        # b.test has never heard of the room: nothing to join yet.
        with self.assertRaises(ApiError) as caught:
            await bob.join(room)
        self.assertEqual(caught.exception.code, 404)
        await alice.invite(room, bob.user_id)
        await self._join_when_invited(bob, room)
        # b.test knows the room now, but eve was never invited to it.
        with self.assertRaises(ApiError) as caught:
            await eve.join(room)
        self.assertEqual((caught.exception.code, caught.exception.errcode), (403, "M_FORBIDDEN"))

        async def members_on_a() -> list[str]:
            return list((await alice.members(room))["members"])

        await wait_until_async(lambda: members_on_a(), sorted([alice.user_id, bob.user_id]), "bob's join on a.test")
        for i in range(5):
            await alice.send(room, {"body": f"a{i}"}, f"a{i}")
            await bob.send(room, {"body": f"b{i}"}, f"b{i}")
        await wait_until(lambda: len(messages(self.a.cluster)) == 10 and len(messages(self.b.cluster)) == 10, 120,
                         "every message on both servers")
        self.assertEqual(sorted(e for _, e, _ in messages(self.a.cluster)),
                         sorted(e for _, e, _ in messages(self.b.cluster)))

        # b.test (or anyone posting as it) now tries what the rules forbid.
        def pdu(n: int, sender: str, event_type: str, content: dict[str, Any], state_key: str | None = None,
                room_id: str = room) -> dict[str, Any]:
            p = {"event_id": f"$forged{n}:b.test", "room_id": room_id, "type": event_type, "sender": sender,
                 "content": content, "origin_server_ts": 1, "prev_events": [], "depth": 1}
            if state_key is not None:
                p["state_key"] = state_key
            return p

        forged = [
            pdu(1, bob.user_id, "m.room.member", {"membership": "leave"}, alice.user_id),  # a kick without power
            pdu(2, bob.user_id, "m.room.member", {"membership": "invite"}, alice.user_id),  # invite as a kick
            pdu(3, "@carol:b.test", "m.room.member", {"membership": "join"}, "@carol:b.test"),  # never invited
            pdu(4, alice.user_id, "m.room.message", {"body": "not from alice"}),  # a.test's user, from b.test
            pdu(5, bob.user_id, "m.room.message", {"body": "new room"}, room_id="!made-up:b.test"),  # unknown room
            pdu(6, bob.user_id, "m.room.message", {"n": 2**60}),  # out of range
        ]
        path = "/_matrix/federation/v1/send/forged1"
        url = f"http://127.0.0.1:{self.a.fed_port}{path}"
        transaction = {"origin": "b.test", "origin_server_ts": 1, "pdus": forged}
        # Unsigned, the transaction is refused whole: its origin is not proven.
        self.assertEqual(_put(url, transaction)[0], 401)
        # Signed with b.test's own key (b.test itself misbehaving), it reaches the rules: each PDU is refused.
        b_key = load_or_create_signing_key(os.path.join(self.b.cluster.shared["data_dir"], "signing.key"))
        code, reply = _put(url, transaction, auth_header("b.test", "a.test", b_key, "PUT", path, transaction))
        self.assertEqual(code, 200, reply)
        self.assertEqual(set(reply["pdus"]), {p["event_id"] for p in forged})
        for p in forged:
            self.assertIn("error", reply["pdus"][p["event_id"]], p)
        self.assertEqual(await members_on_a(), sorted([alice.user_id, bob.user_id]))
        self.assertEqual(len(messages(self.a.cluster)), 10)
        self.assertEqual(self.a.cluster.query("SELECT event_id FROM events WHERE event_id LIKE '$forged%'"), [])
        self.assertEqual(self.a.cluster.query("SELECT room_id FROM rooms WHERE room_id = '!made-up:b.test'"), [])
        # Still federating after the refusals.
        sent = await alice.send(room, {"body": "after"}, "after")
        await wait_until(lambda: any(e == sent["event_id"] for _, e, _ in messages(self.b.cluster)), 60,
                         "a message after the forged transaction")


async def wait_until_async(read: Any, expected: Any, what: str, timeout_s: float = 60.0) -> None:
    """Poll an async ``read()`` until it returns ``expected``."""
    got = None
    for _ in range(int(timeout_s / 0.1)):
        got = await read()
        if got == expected:
            return
        await sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: last {got!r}, expected {expected!r}")
