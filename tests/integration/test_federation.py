"""Two synflow deployments federating over loopback, each with sharded persisters and senders."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.tools.client import ApiError, Client, new_pool
from tests.cluster import Cluster, free_port, sleep, wait_until

WRITERS = ("persister1", "persister2")
SENDERS = ("sender1", "sender2")


def messages(cluster: Cluster) -> list[tuple[str, str, str]]:
    """(room_id, event_id, origin) of every message in a deployment's database, in stream order."""
    return cluster.query("SELECT room_id, event_id, origin FROM events WHERE type = 'm.room.message' "
                         "ORDER BY stream_ordering")


class Side:
    """One deployment of the pair."""

    def __init__(self, testcase, name: str, engine: str, peer_name: str, peer_port: int, fed_port: int,
                 federation: dict) -> None:
        self.name = name
        self.fed_port = fed_port
        self.client_port = free_port()
        self.cluster = Cluster(
            testcase, engine=engine, writers=WRITERS, server_name=name, extra_instances=SENDERS,
            shared={
                "federation_sender_instances": list(SENDERS),
                "federation": {"destinations": {peer_name: f"http://127.0.0.1:{peer_port}"}, **federation},
            },
        )

    @inlineCallbacks
    def start(self):
        c = self.cluster
        yield c.start_master(listeners=[
            {"resources": ["client"], "endpoint": f"tcp:{self.client_port}:interface=127.0.0.1"},
            {"resources": ["federation"], "endpoint": f"tcp:{self.fed_port}:interface=127.0.0.1"},
        ])
        for name in WRITERS:
            c.start_twistd(name, "event_persister")
        for name in SENDERS:
            c.start_twistd(name, "federation_sender")
        for name in (*WRITERS, *SENDERS):
            yield c.wait_for_port(c.instance_ports[name], name)

    @inlineCallbacks
    def stop(self):
        for name in (*SENDERS, *WRITERS, "master"):
            yield self.cluster.stop(name)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"


class FederationMixin:
    engine = "sqlite"
    timeout = 300
    federation: dict = {"wakeup_interval_s": 1.0, "request_timeout_s": 5.0,
                        "backoff": {"initial_s": 0.2, "multiplier": 2.0, "max_s": 4.0, "jitter": 0.1},
                        "catch_up_after_s": 1.5}

    @inlineCallbacks
    def pair(self):
        fed_a, fed_b = free_port(), free_port()
        self.a = Side(self, "a.test", self.engine, "b.test", fed_b, fed_a, self.federation)
        self.b = Side(self, "b.test", self.engine, "a.test", fed_a, fed_b, self.federation)
        yield self.a.start()
        yield self.b.start()
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)

    async def shared_rooms(self, n_rooms: int):
        alice = await Client(self.a.url, self.pool).register("alice")
        bob = await Client(self.b.url, self.pool).register("bob")
        rooms = []
        for _ in range(n_rooms):
            room = await alice.create_room()
            await alice.invite(room, bob.user_id)
            for _ in range(100):
                try:
                    await bob.join(room)
                    break
                except ApiError as e:
                    if e.code != 404:
                        raise
                    await sleep(0.1)
            else:
                self.fail(f"invite to {room} never reached b.test")
            rooms.append(room)
        return alice, bob, rooms

    @inlineCallbacks
    def test_both_directions_exactly_once_in_order(self):
        """Every message sent on either side is persisted on the other exactly once, in each origin's order."""
        yield self.pair()
        alice, bob, rooms = yield ensureDeferred(self.shared_rooms(12))
        rng = random.Random(1)
        for i in range(300):
            room = rng.choice(rooms)
            sender = alice if i % 2 else bob
            yield ensureDeferred(sender.send(room, {"body": f"m{i}"}, f"t{i}"))

        def converged():
            a, b = messages(self.a.cluster), messages(self.b.cluster)
            return len(a) == 300 and len(b) == 300

        yield wait_until(converged, 120, "both servers to hold all 300 messages")
        a_msgs, b_msgs = messages(self.a.cluster), messages(self.b.cluster)
        for side in (a_msgs, b_msgs):
            self.assertEqual(len({e for _, e, _ in side}), 300, "a message was persisted twice")
        for room in rooms:
            for origin in ("a.test", "b.test"):
                on_a = [e for r, e, o in a_msgs if r == room and o == origin]
                on_b = [e for r, e, o in b_msgs if r == room and o == origin]
                self.assertEqual(on_a, on_b, f"{origin}'s messages in {room} differ between the servers")

    @inlineCallbacks
    def test_outage_past_catch_up_threshold(self):
        """b.test is down past the catch-up threshold; when back it gets the latest message of every room, none twice."""
        yield self.pair()
        alice, bob, rooms = yield ensureDeferred(self.shared_rooms(8))
        for i, room in enumerate(rooms):
            yield ensureDeferred(alice.send(room, {"body": f"before {i}"}, f"b{i}"))
        yield wait_until(lambda: len(messages(self.b.cluster)) == len(rooms), 60, "the first messages to arrive")
        yield self.b.stop()
        latest = {}
        for i in range(80):
            room = rooms[i % len(rooms)]
            sent = yield ensureDeferred(alice.send(room, {"body": f"during {i}"}, f"d{i}"))
            latest[room] = sent["event_id"]
            yield sleep(0.1)  # about 8 s of sending: the backoff passes the 1.5 s threshold
        yield self.b.start()

        def caught_up():
            on_b = {e for _, e, _ in messages(self.b.cluster)}
            return all(e in on_b for e in latest.values())

        yield wait_until(caught_up, 120, "the latest message of every room to reach b.test")
        on_b = [e for _, e, _ in messages(self.b.cluster)]
        self.assertEqual(len(on_b), len(set(on_b)), "a message reached b.test twice")

    @inlineCallbacks
    def test_edus_delivered_and_acknowledged(self):
        """Typing EDUs reach the remote server; every sender acknowledges and the master trims its outbox."""
        yield self.pair()
        alice, bob, rooms = yield ensureDeferred(self.shared_rooms(4))
        for room in rooms:
            yield ensureDeferred(alice.typing(room, True))

        def received() -> float:
            text = urllib.request.urlopen(
                f"http://127.0.0.1:{self.b.cluster.instance_ports['master']}/metrics", timeout=5).read().decode()
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith('synflow_federation_edus_received_total{edu_type="m.typing"}'))

        yield wait_until(lambda: received() >= len(rooms), 60, "the typing EDUs to reach b.test")

        def outbox_rows() -> int:
            return self.a.cluster.query("SELECT count(*) FROM federation_outbox")[0][0]

        yield wait_until(lambda: outbox_rows() == 0, 60, "both senders' FEDERATION_ACKs to trim the outbox")

    @inlineCallbacks
    def test_inbound_garbage_rejected(self):
        """Malformed inbound transactions get 400/403 with an error body; nothing is persisted; the master serves on."""
        yield self.pair()
        url = f"http://127.0.0.1:{self.a.fed_port}/_matrix/federation/v1/send/"
        pdu = {"event_id": "$x:b.test", "room_id": "!r:a.test", "type": "m.room.message", "sender": "@bob:b.test",
               "content": {}, "origin_server_ts": 1}
        cases = [
            (b"{not json", 400),
            (json.dumps({"origin": "b.test", "pdus": [pdu] * 51}).encode(), 400),
            (json.dumps({"origin": "b.test", "pdus": [], "edus": [{"edu_type": "x", "content": {}}] * 101}).encode(), 400),
            (json.dumps({"origin": "evil.test", "pdus": [pdu]}).encode(), 403),
            (json.dumps({"origin": "b.test", "pdus": [{"event_id": 5}]}).encode(), 400),
            (b'{"origin": "b.test", "pdus": []' + b" " * 3_000_000 + b"}", 400),
        ]
        for i, (body, code) in enumerate(cases):
            request = urllib.request.Request(url + f"bad{i}", data=body, method="PUT",
                                             headers={"Content-Type": "application/json"})
            with self.assertRaises(urllib.error.HTTPError) as cm:
                urllib.request.urlopen(request, timeout=30)
            self.assertIn(cm.exception.code, (code, 413))
            error = json.loads(cm.exception.read())
            self.assertIn("errcode", error)
        self.assertEqual(messages(self.a.cluster), [])
        alice = yield ensureDeferred(Client(self.a.url, self.pool).register("alice"))
        room = yield ensureDeferred(alice.create_room())
        yield ensureDeferred(alice.send(room, {"body": "still serving"}, "t1"))


class SqliteFederationTest(FederationMixin, TestCase):
    engine = "sqlite"


class PostgresFederationTest(FederationMixin, TestCase):
    engine = "postgres"
