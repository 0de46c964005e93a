"""Two synflow deployments federating over loopback, each with sharded persisters and senders."""

from __future__ import annotations

import glob
import json
import os
import random
import urllib.error
import urllib.request
from collections import Counter

import treq
from signedjson.key import generate_signing_key
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from synflow.federation.keys import load_or_create_signing_key
from synflow.federation.signing import auth_header
from synflow.sharding import shard_for
from synflow.tools.client import ApiError, Client, new_pool
from tests import services
from tests.cluster import Cluster, free_port, read_jsonl, sleep, wait_until
from tests.spark._session import validate, violations

WRITERS = ("persister1", "persister2")
SENDERS = ("sender1", "sender2")


def messages(cluster: Cluster) -> list[tuple[str, str, str]]:
    """(room_id, event_id, origin) of every message in a deployment's database, in stream order."""
    return cluster.query("SELECT room_id, event_id, origin FROM events WHERE type = 'm.room.message' "
                         "ORDER BY stream_ordering")


def metric(cluster: Cluster, instance: str, sample: str, **labels: str) -> float:
    """The sum of a process's ``/metrics`` samples named ``sample`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{cluster.instance_ports[instance]}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


class SyncChain:
    """One user's chain of /sync calls, each from the previous ``next_batch``, collecting message event IDs.

    Its tokens are recorded in the deployment's audit log, so the Spark
    validator checks them afterwards; the test checks the chain saw every
    message exactly once.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.since: str | None = None
        self.events: list[str] = []
        self.stopped = False

    async def round(self, timeout_ms: int = 0) -> None:
        """One /sync from the current token."""
        result = await self.client.sync(since=self.since, timeout_ms=timeout_ms)
        self.events.extend(e["event_id"] for e in result["events"] if e["type"] == "m.room.message")
        self.since = result["next_batch"]

    async def follow(self) -> None:
        """Long-poll until :meth:`stop`."""
        while not self.stopped:
            await self.round(500)

    def stop(self) -> None:
        self.stopped = True

    async def until_seen(self, expected: set[str], rounds: int = 40, tolerate_errors: int = 0) -> None:
        """Sync until every event of ``expected`` was seen (at most ``rounds`` times).

        ``tolerate_errors`` request failures are retried after a pause (a
        restarted server drops the pool's kept-alive connections).
        """
        for _ in range(rounds):
            if set(self.events) >= expected:
                return
            try:
                await self.round(0)
            except ApiError:
                raise
            except Exception:
                if tolerate_errors <= 0:
                    raise
                tolerate_errors -= 1
                await sleep(0.5)


async def send_per_room(client: Client, rooms: list[str], per_room: int, label: str) -> list[str]:
    """Send ``per_room`` messages to each room, round-robin, 0.1 s apart; their event IDs in order."""
    sent = []
    for i in range(per_room * len(rooms)):
        result = await client.send(rooms[i % len(rooms)], {"body": f"{label} {i}"}, f"{label}{i}")
        sent.append(result["event_id"])
        await sleep(0.1)
    return sent


def assert_same_rooms_in_order(testcase: TestCase, origin: list[tuple[str, str, str]],
                               received: list[tuple[str, str, str]], origin_name: str) -> None:
    """``received`` holds each of ``origin_name``'s messages in ``origin`` exactly once, each room's in order."""
    mine = [(r, e) for r, e, o in origin if o == origin_name]
    got = [(r, e) for r, e, o in received if o == origin_name]
    testcase.assertEqual(len(got), len(set(got)), "a message was persisted twice")
    testcase.assertEqual(sorted(got), sorted(mine), "the receiver lacks a message, or has one never sent")
    for room in {r for r, _ in mine}:
        testcase.assertEqual([e for r, e in got if r == room], [e for r, e in mine if r == room],
                             f"{room}: the receiver's order differs from {origin_name}'s")


class FlakyDestination(Resource):
    """A federation endpoint in front of a real one that misbehaves on a fixed schedule.

    Request ``n`` (counting from 1) is, by ``n % 6``: 1 -- answered 500 without
    being forwarded; 3 -- forwarded after 1 s (slow); 4 -- forwarded, then
    answered 500 (the remote persisted it but the sender never hears so); 5 --
    held 6 s, longer than the sender's request timeout, then forwarded anyway;
    otherwise forwarded at once.
    """

    isLeaf = True

    def __init__(self, pool) -> None:
        super().__init__()
        self.target = ""
        self.pool = pool
        self.requests = 0
        self.faults: Counter[str] = Counter()

    def render(self, request):
        self.requests += 1
        n = self.requests
        body = request.content.read()
        gone = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        auth = request.requestHeaders.getRawHeaders(b"Authorization", [])
        d = ensureDeferred(self._handle(n, request.uri.decode(), body, auth))

        def answer(result):
            code, content = result
            if not gone:
                request.setResponseCode(code)
                request.setHeader(b"content-type", b"application/json")
                request.write(content)
                request.finish()

        d.addCallback(answer)
        d.addErrback(lambda f: answer((502, json.dumps({"errcode": "M_UNKNOWN", "error": f.getErrorMessage()}).encode())))
        return NOT_DONE_YET

    async def _handle(self, n: int, uri: str, body: bytes, auth: list[bytes]) -> tuple[int, bytes]:
        kind = n % 6
        injected = json.dumps({"errcode": "M_UNKNOWN", "error": "injected failure"}).encode()
        if kind == 1:
            self.faults["500, not forwarded"] += 1
            return 500, injected
        if kind in (3, 5):
            self.faults["slow (1 s)" if kind == 3 else "past the request timeout (6 s)"] += 1
            await sleep(1.0 if kind == 3 else 6.0)
        # The sender's signature covers the path and names b.test, so it verifies when passed on unchanged.
        response = await treq.put(self.target + uri, data=body,
                                  headers={"Content-Type": ["application/json"], "Authorization": auth},
                                  pool=self.pool)
        content = await response.content()
        if kind == 4:
            self.faults["forwarded, then 500"] += 1
            return 500, injected
        return response.code, content


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


class FederationPair:
    """Two deployments, a.test and b.test, federating; rooms alice (on a) shares with bob (on b)."""

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
        rooms = [await self.shared_room(alice, bob) for _ in range(n_rooms)]
        return alice, bob, rooms

    async def shared_room(self, alice: Client, bob: Client) -> str:
        """A room alice (on a.test) creates and invites bob (on b.test) to, once bob has joined it."""
        assert bob.user_id is not None
        room = await alice.create_room()
        await alice.invite(room, bob.user_id)
        for _ in range(100):
            try:
                await bob.join(room)
                return room
            except ApiError as e:
                if e.code != 404:
                    raise
                await sleep(0.1)
        self.fail(f"invite to {room} never reached b.test")


class FederationMixin(FederationPair):
    """The federation tests run on each engine."""

    @inlineCallbacks
    def test_both_directions_exactly_once_in_order(self):
        """Every message sent on either side is persisted on the other exactly once, in each origin's order.

        Every request was signed and verified: each master fetched the
        other's key and authenticated every inbound request, refusing none.
        """
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
        for side in (self.a, self.b):
            counts = {outcome: metric(side.cluster, "master", "synflow_federation_inbound_requests_total",
                                      outcome=outcome) for outcome in ("authenticated", "unauthorized", "forbidden")}
            self.assertGreater(counts["authenticated"], 0, side.name)
            self.assertEqual((counts["unauthorized"], counts["forbidden"]), (0, 0), side.name)
            self.assertEqual(metric(side.cluster, "master", "synflow_federation_key_fetches_total", outcome="ok"), 1,
                             f"{side.name} fetched its peer's key other than once")

    @inlineCallbacks
    def test_outage_past_catch_up_threshold(self):
        """b.test is down past the catch-up threshold while 5 messages go to each of 10 rooms; back, it gets every one once, in order.

        The owning sender's metrics show it dropped its queue for catch-up
        while b.test was down; after b.test returns every message sent during
        the outage reaches it exactly once, each room's in a.test's order;
        bob's sync chain on b.test sees every message exactly once, each
        room's in that order, and alice's on a.test every message she sent;
        both deployments' audit logs validate clean.
        """
        services.require_java()
        yield self.pair()
        alice, bob, rooms = yield ensureDeferred(self.shared_rooms(10))
        chain = SyncChain(bob)
        yield ensureDeferred(chain.round(0))
        # alice follows her own messages on a.test throughout, so a.test's audit log has tokens too.
        own = SyncChain(alice)
        following = ensureDeferred(own.follow())
        before = []
        for i, room in enumerate(rooms):
            sent = yield ensureDeferred(alice.send(room, {"body": f"before {i}"}, f"b{i}"))
            before.append(sent["event_id"])
        yield wait_until(lambda: len(messages(self.b.cluster)) == len(rooms), 60, "the first messages to arrive")
        yield ensureDeferred(chain.until_seen(set(before)))

        owner = shard_for("b.test", list(SENDERS))
        a = self.a.cluster
        entered_before = metric(a, owner, "synflow_federation_catch_up_entered_total")
        yield self.b.stop()
        during = yield ensureDeferred(send_per_room(alice, rooms, 5, "during"))
        yield wait_until(lambda: metric(a, owner, "synflow_federation_catch_up_entered_total") > entered_before,
                         60, "the owning sender to drop its queue for catch-up (b.test down past the threshold)")
        yield self.b.start()

        yield wait_until(lambda: {e for _, e, _ in messages(self.b.cluster)} >= set(during), 120,
                         "every message sent during the outage to reach b.test")
        assert_same_rooms_in_order(self, messages(a), messages(self.b.cluster), "a.test")
        yield wait_until(lambda: metric(a, owner, "synflow_federation_catching_up", destination="b.test") == 0,
                         30, "the owning sender to leave catch-up mode")

        # bob, on b.test, sees every message exactly once, each room's in order, through the restart.
        on_b = [e for _, e, o in messages(self.b.cluster) if o == "a.test"]
        yield ensureDeferred(chain.until_seen(set(on_b), tolerate_errors=5))
        self.assertEqual(sorted(chain.events), sorted(before + during), "bob's sync chain missed or repeated a message")
        room_of = {e: r for r, e, _ in messages(a)}
        for room in rooms:
            self.assertEqual([e for e in chain.events if room_of[e] == room],
                             [e for r, e, _ in messages(a) if r == room], f"{room}: bob saw it out of order")
        own.stop()
        yield following
        yield ensureDeferred(own.until_seen(set(before + during)))
        self.assertEqual(sorted(own.events), sorted(before + during), "alice's sync chain missed or repeated one")

        yield self.a.stop()
        yield self.b.stop()
        for side in (self.a, self.b):
            out = os.path.abspath(self.mktemp())
            code = validate(side.cluster.shared["audit"]["dir"], out)
            self.assertEqual((side.name, code, violations(out)), (side.name, 0, []))

    test_outage_past_catch_up_threshold.timeout = 600

    @inlineCallbacks
    def test_inbound_refusals_then_edus_delivered(self):
        """One pair of deployments: forged and malformed inbound /send requests are refused, then typing EDUs are delivered.

        The three checks share the pair, in this order (each leaves what the
        next asserts on untouched): :meth:`check_forged_send_refused` on a
        pair nothing was sent on yet, :meth:`check_inbound_garbage_rejected`,
        then :meth:`check_edus_delivered_and_acknowledged`, the only one that
        makes the servers federate.
        """
        yield self.pair()
        yield self.check_forged_send_refused()
        yield self.check_inbound_garbage_rejected()
        yield self.check_edus_delivered_and_acknowledged()

    @inlineCallbacks
    def check_edus_delivered_and_acknowledged(self):
        """Typing EDUs reach the remote server; every sender acknowledges and the master trims its outbox."""
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

    def put_send(self, txn_id: str, body: bytes, sign_with=None, *, origin: str = "b.test",
                 destination: str = "a.test") -> tuple[int, dict]:
        """PUT a.test's /send/{txn_id} with ``body``, signed as ``origin`` for ``destination`` if a key is given."""
        path = f"/_matrix/federation/v1/send/{txn_id}"
        headers = {"Content-Type": "application/json"}
        if sign_with is not None:
            headers["Authorization"] = auth_header(origin, destination, sign_with, "PUT", path,
                                                   json.loads(body)).decode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.a.fed_port}{path}", data=body, method="PUT",
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def signing_key(self, side: Side):
        """The signing key a deployment generated on its first start."""
        return load_or_create_signing_key(os.path.join(side.cluster.shared["data_dir"], "signing.key"))

    def check_forged_send_refused(self):
        """Forged /send requests claiming to be b.test get 401, persist nothing and poison no dedupe entry.

        Run on a pair that has not federated yet: a.test has received no
        transaction and refused no request before.
        """
        b_key = self.signing_key(self.b)
        intruder = generate_signing_key(b_key.version)
        pdu = {"event_id": "$forged:b.test", "room_id": "!r:a.test", "type": "m.room.message",
               "sender": "@bob:b.test", "content": {"body": "forged"}, "origin_server_ts": 1}
        body = json.dumps({"origin": "b.test", "origin_server_ts": 1, "pdus": [pdu]}).encode()
        other_origin = json.dumps({"origin": "c.test", "origin_server_ts": 1, "pdus": []}).encode()
        cases = [
            ("right body, no signature", body, None, {}),
            ("wrong signature", body, None,
             {"Authorization": auth_header("b.test", "a.test", b_key, "PUT", "/_matrix/federation/v1/send/other",
                                           json.loads(body)).decode()}),
            ("wrong key", body, intruder, {}),
            ("replayed to another destination", body, b_key, {"destination": "c.test"}),
            ("body origin differs from the signed origin", other_origin, b_key, {}),
        ]
        for name, raw, key, extra in cases:
            if "Authorization" in extra:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{self.a.fed_port}/_matrix/federation/v1/send/t1", data=raw, method="PUT",
                    headers={"Content-Type": "application/json", **extra})
                with self.assertRaises(urllib.error.HTTPError, msg=name) as cm:
                    urllib.request.urlopen(request, timeout=30)
                code, reply = cm.exception.code, json.loads(cm.exception.read())
            else:
                code, reply = self.put_send("t1", raw, key, **extra)
            self.assertEqual((code, reply.get("errcode")), (401, "M_UNAUTHORIZED"), name)
        self.assertEqual(messages(self.a.cluster), [])
        self.assertEqual(self.a.cluster.query("SELECT count(*) FROM received_transactions")[0][0], 0)
        # b.test's own transaction under the ID the forger used is still processed.
        self.assertEqual(self.put_send("t1", json.dumps({"origin": "b.test", "origin_server_ts": 1,
                                                         "pdus": []}).encode(), b_key), (200, {"pdus": {}}))
        # The gate refused four; the fifth really was signed by b.test and /send refused its body's origin.
        self.assertEqual(metric(self.a.cluster, "master", "synflow_federation_inbound_requests_total",
                                outcome="unauthorized"), len(cases) - 1)

    @inlineCallbacks
    def check_inbound_garbage_rejected(self):
        """Unsigned requests get 401; malformed signed ones exactly 400 with an error body; nothing is persisted; the master serves on."""
        b_key = self.signing_key(self.b)
        pdu = {"event_id": "$x:b.test", "room_id": "!r:a.test", "type": "m.room.message", "sender": "@bob:b.test",
               "content": {}, "origin_server_ts": 1}
        cases = [
            ("bad JSON", b"{not json", "M_NOT_JSON"),
            ("51 PDUs", json.dumps({"origin": "b.test", "origin_server_ts": 1, "pdus": [pdu] * 51}).encode(),
             "M_TOO_LARGE"),
            ("101 EDUs", json.dumps({"origin": "b.test", "origin_server_ts": 1, "pdus": [],
                                     "edus": [{"edu_type": "x", "content": {}}] * 101}).encode(), "M_TOO_LARGE"),
            ("malformed PDU", json.dumps({"origin": "b.test", "origin_server_ts": 1,
                                          "pdus": [{"event_id": 5}]}).encode(), "M_BAD_JSON"),
            # Over federation.max_body_bytes (2 MiB), and over the listener's 1 MiB as well.
            ("oversized body", b'{"origin": "b.test", "pdus": []' + b" " * 3_000_000 + b"}", "M_TOO_LARGE"),
        ]
        unsigned = json.dumps({"origin": "b.test", "origin_server_ts": 1, "pdus": [pdu]}).encode()
        self.assertEqual(self.put_send("unsigned", unsigned)[0], 401)
        for i, (name, body, errcode) in enumerate(cases):
            try:
                json.loads(body)
            except ValueError:
                key = None  # not JSON: nothing to sign, refused before the signature check
            else:
                key = b_key
            code, error = self.put_send(f"bad{i}", body, key)
            self.assertEqual(code, 400, name)
            self.assertEqual(error["errcode"], errcode, name)
            self.assertIsInstance(error["error"], str, name)
        # evil.test is not an allowed origin: 403 before any key of it is fetched.
        evil = json.dumps({"origin": "evil.test", "origin_server_ts": 1, "pdus": [pdu]}).encode()
        self.assertEqual(self.put_send("evil", evil, generate_signing_key("x"), origin="evil.test")[0], 403)
        # Between the listener's general limit (1 MiB) and federation.max_body_bytes (2 MiB): accepted.
        padded = b'{"origin": "b.test", "origin_server_ts": 1, "pdus": []' + b" " * 1_500_000 + b"}"
        self.assertEqual(self.put_send("big-but-allowed", padded, b_key), (200, {"pdus": {}}))
        self.assertEqual(messages(self.a.cluster), [])
        carol = yield ensureDeferred(Client(self.a.url, self.pool).register("carol"))
        room = yield ensureDeferred(carol.create_room())
        yield ensureDeferred(carol.send(room, {"body": "still serving"}, "t1"))


class SqliteFederationTest(FederationMixin, TestCase):
    engine = "sqlite"

    @inlineCallbacks
    def test_flaky_slow_destination_and_sender_killed(self):
        """b.test answers 500s, slowly and past the timeout, and a's sender is SIGKILLed mid-load.

        Nothing reaches b.test twice, each room's messages arrive in a's order,
        every message sent before the kill arrives, and every one sent around
        the kill after the restart (catch-up sends every owed event), and a's
        audit logs validate clean.
        """
        services.require_java()
        self.federation = {**self.federation, "catch_up_after_s": 3600.0}
        pool = new_pool()
        self.addCleanup(pool.closeCachedConnections)
        flaky = FlakyDestination(pool)
        site = Site(flaky)
        site.noisy = False
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        fed_a, fed_b = free_port(), free_port()
        self.a = Side(self, "a.test", self.engine, "b.test", port.getHost().port, fed_a, self.federation)
        self.b = Side(self, "b.test", self.engine, "a.test", fed_a, fed_b, self.federation)
        flaky.target = f"http://127.0.0.1:{fed_b}"
        yield self.a.start()
        yield self.b.start()
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)
        alice, bob, rooms = yield ensureDeferred(self.shared_rooms(6))

        def from_a(cluster: Cluster) -> list[tuple[str, str, str]]:
            return [m for m in messages(cluster) if m[2] == "a.test"]

        # alice follows her own messages with a sync chain on a.test throughout (its tokens are audited).
        chain = SyncChain(alice)
        following = ensureDeferred(chain.follow())
        before = []
        for i in range(60):
            sent = yield ensureDeferred(alice.send(rooms[i % 6], {"body": f"before {i}"}, f"b{i}"))
            before.append(sent["event_id"])
        yield wait_until(lambda: {e for _, e, _ in from_a(self.b.cluster)} >= set(before), 120,
                         "every message sent before the kill to reach b.test through the failures")

        owner = shard_for("b.test", list(SENDERS))
        for i in range(60):
            if i == 20:
                self.a.cluster.kill(owner)
            if i == 30:
                self.a.cluster.start_twistd(owner, "federation_sender")
                yield self.a.cluster.wait_for_port(self.a.cluster.instance_ports[owner], owner)
            sent = yield ensureDeferred(alice.send(rooms[i % 6], {"body": f"around the kill {i}"}, f"k{i}"))
            before.append(sent["event_id"])
        chain.stop()
        yield following
        yield ensureDeferred(chain.until_seen(set(before), rounds=20))
        self.assertEqual(sorted(chain.events), sorted(before), "alice's sync chain missed or repeated a message")
        yield wait_until(lambda: {e for _, e, _ in from_a(self.b.cluster)} >= set(before), 120,
                         "every message, before and after the kill, to reach b.test after the sender restarted")

        on_a, on_b = from_a(self.a.cluster), from_a(self.b.cluster)
        ids_b = [e for _, e, _ in on_b]
        self.assertEqual(len(ids_b), len(set(ids_b)), "a message reached b.test twice")
        for room in rooms:
            order_a = [e for r, e, _ in on_a if r == room]
            got = [e for r, e, _ in on_b if r == room]
            self.assertEqual(got, order_a, f"{room}: b.test's order differs from a.test's")
        self.assertGreaterEqual(set(flaky.faults), {"500, not forwarded", "slow (1 s)", "forwarded, then 500",
                                                    "past the request timeout (6 s)"}, flaky.faults)
        yield self.a.stop()
        out = os.path.abspath(self.mktemp())
        code = validate(self.a.cluster.shared["audit"]["dir"], out)
        self.assertEqual((code, violations(out)), (0, []))


class PostgresFederationTest(FederationMixin, TestCase):
    engine = "postgres"

    @inlineCallbacks
    def test_persisters_complete_out_of_order(self):
        """One persister's event commits after the other's events with higher stream IDs; b.test still gets all.

        The test holds a row lock on a.test's ``rooms`` row of room X (owned
        by P1). A message sent into X gets its stream ID N from the sequence,
        inserts its event and then waits on that lock, in its persister's
        open transaction. Messages then sent into P2's rooms get IDs above N
        and commit, and reach b.test, while N is still pending. Only then is
        the lock released, so N completes last. The audit log of a.test's
        persisters shows it did, and b.test ends up with every message
        exactly once, each room's in a.test's order.
        """
        yield self.pair()
        alice = yield ensureDeferred(Client(self.a.url, self.pool).register("alice"))
        bob = yield ensureDeferred(Client(self.b.url, self.pool).register("bob"))
        # Room X, owned by P1, and three rooms owned by the other persister, P2.
        held_room = yield ensureDeferred(self.shared_room(alice, bob))
        p1 = shard_for(held_room, list(WRITERS))
        p2 = next(w for w in WRITERS if w != p1)
        p2_rooms: list[str] = []
        for _ in range(24):
            if len(p2_rooms) == 3:
                break
            room = yield ensureDeferred(self.shared_room(alice, bob))
            if shard_for(room, list(WRITERS)) == p2:
                p2_rooms.append(room)
        self.assertEqual(len(p2_rooms), 3, f"24 new rooms and fewer than 3 owned by {p2}")
        rooms = [held_room, *p2_rooms]
        a, b = self.a.cluster, self.b.cluster

        def from_a(cluster: Cluster) -> list[tuple[str, str, str]]:
            return [m for m in messages(cluster) if m[2] == "a.test"]

        sent: list[str] = []
        for i, room in enumerate(rooms):
            result = yield ensureDeferred(alice.send(room, {"body": f"before {i}"}, f"b{i}"))
            sent.append(result["event_id"])
        yield wait_until(lambda: {e for _, e, _ in from_a(b)} >= set(sent), 60, "the first messages to reach b.test")

        lock = services.pg_connect(a.dbname)
        self.addCleanup(lock.close)
        cur = lock.cursor()
        cur.execute("BEGIN")
        cur.execute("SELECT 1 FROM rooms WHERE room_id = %s FOR UPDATE", (held_room,))
        self.assertEqual(cur.fetchall(), [(1,)])
        held = ensureDeferred(alice.send(held_room, {"body": "held"}, "held"))

        def p1_waiting() -> list[tuple]:
            # P1's transaction, blocked by the test's lock: it has allocated its ID and inserted the event.
            # pg_stat_activity is a snapshot taken as the query starts, pg_blocking_pids is read row by row after
            # it: a backend may show the statement before the one it is now blocked in, so a poll that sees
            # another statement looks again rather than fails.
            blocked = a.query("SELECT query FROM pg_stat_activity WHERE datname = ? AND ? = ANY(pg_blocking_pids(pid))",
                              (a.dbname, lock.get_backend_pid()))
            return [row for row in blocked if "rooms" in row[0]]

        yield wait_until(p1_waiting, 30, f"{p1}'s transaction to wait on the lock of {held_room}'s row")
        later: list[str] = []
        for i in range(24):
            result = yield ensureDeferred(alice.send(p2_rooms[i % 3], {"body": f"during {i}"}, f"d{i}"))
            later.append(result["event_id"])
        self.assertFalse(held.called, f"the send into {held_room} finished while its row was locked")
        # The destination already has P2's later events while P1's earlier one is still uncommitted.
        yield wait_until(lambda: {e for _, e, _ in from_a(b)} >= set(later), 20,
                         f"{p2}'s messages to reach b.test while {p1}'s is pending")
        self.assertFalse(held.called)
        cur.execute("ROLLBACK")
        result = yield held
        held_id = result["event_id"]
        sent += [held_id, *later]

        # The held event's stream ID is below all of P2's, and it completed after all of them.
        orderings = dict(a.query("SELECT event_id, stream_ordering FROM events WHERE type = 'm.room.message'"))
        self.assertLess(orderings[held_id], min(orderings[e] for e in later))
        facts: dict[str, dict] = {}
        for path in glob.glob(os.path.join(a.shared["audit"]["dir"], "writer_logs", "*", "*.jsonl")):
            for record in read_jsonl(path):
                if record.get("stream") == "events" and record.get("event_id") and "kind" not in record:
                    facts[record["event_id"]] = record
        held_fact = facts[held_id]
        self.assertEqual((held_fact["writer"], held_fact["stream_id"], held_fact["outcome"]),
                         (p1, orderings[held_id], "ok"))
        for event_id in later:
            fact = facts[event_id]
            self.assertEqual((fact["writer"], fact["outcome"]), (p2, "ok"), fact)
            self.assertGreater(fact["stream_id"], held_fact["stream_id"], fact)
            self.assertLess(fact["completed_at"], held_fact["completed_at"],
                            f"{p2}'s {fact['stream_id']} did not complete before {p1}'s {held_fact['stream_id']}")

        for i, room in enumerate(rooms):
            result = yield ensureDeferred(alice.send(room, {"body": f"after {i}"}, f"a{i}"))
            sent.append(result["event_id"])
        yield wait_until(lambda: {e for _, e, _ in from_a(b)} >= set(sent), 60, "every message to reach b.test")
        on_a, on_b = from_a(a), from_a(b)
        self.assertEqual(sorted(e for _, e, _ in on_a), sorted(sent))
        ids_b = [e for _, e, _ in on_b]
        self.assertEqual(sorted(ids_b), sorted(sent), "b.test holds a message twice, or one a.test never sent")
        for room in rooms:
            self.assertEqual([e for r, e, _ in on_b if r == room], [e for r, e, _ in on_a if r == room],
                             f"{room}: b.test's order differs from a.test's")
