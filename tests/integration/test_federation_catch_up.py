"""No event lost after a federation outage: real processes, a synflow peer and a plain recording receiver.

* A plain receiver that never pulls (``tests/procs/recording_receiver.py``,
  its own process) is stopped past ``catch_up_after_s`` while 5 messages go
  to each of 10 rooms: back, it is sent every one, once, in room order.
* A new destination answers 500 to its first two transactions (backoff
  1-4 s, far below the threshold) while 120 messages are sent: all arrive.
* Past ``federation.catch_up_max_events`` (a small configured cap) the
  sender sends each room's latest event only; the synflow receiver pulls
  the rest with ``get_missing_events`` and ends with every event, once, in
  order, and its users' sync sees them that way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.sharding import shard_for
from synflow.tools.client import Client, new_pool
from tests.cluster import PYTHON, ROOT, free_port, sleep, wait_until
from tests.integration.test_federation import (
    SENDERS,
    FederationPair,
    Side,
    SyncChain,
    assert_same_rooms_in_order,
    messages,
    metric,
    send_per_room,
)

BOB = "@bob:b.test"


class RecordingReceiver:
    """The recording receiver process for ``b.test``: start, stop, and what it recorded."""

    def __init__(self, testcase: TestCase, fail_first: int = 0) -> None:
        self.port = free_port()
        self.dir = os.path.abspath(testcase.mktemp())
        os.makedirs(self.dir)
        self.out = os.path.join(self.dir, "received.jsonl")
        self.fail_first = fail_first
        self.proc: subprocess.Popen | None = None
        testcase.addCleanup(self.kill)

    @inlineCallbacks
    def start(self):
        """Start the process and wait until it listens."""
        import socket

        log = open(os.path.join(self.dir, "receiver.log"), "ab")
        self.proc = subprocess.Popen(
            [PYTHON, os.path.join(ROOT, "tests", "procs", "recording_receiver.py"), "--port", str(self.port),
             "--out", self.out, "--fail-first", str(self.fail_first)],
            stdout=log, stderr=log, env=dict(os.environ, PYTHONPATH=ROOT))
        log.close()

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the recording receiver exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                return False

        yield wait_until(up, 30, "the recording receiver to listen")

    @inlineCallbacks
    def stop(self):
        """SIGTERM the process and wait until it is gone."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            yield wait_until(lambda: proc.poll() is not None, 20, "the recording receiver to stop")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pdus(self) -> list[dict]:
        """Every PDU recorded, in arrival order."""
        if not os.path.exists(self.out):
            return []
        with open(self.out, encoding="utf-8") as f:
            return [p for line in f if line.strip() for p in json.loads(line)["pdus"]]

    def messages(self) -> list[tuple[str, str, str]]:
        """(room_id, event_id, origin) of every message recorded, in arrival order."""
        return [(p["room_id"], p["event_id"], p["origin"]) for p in self.pdus() if p["type"] == "m.room.message"]


class RecordingReceiverTest(TestCase):
    """a.test (a real deployment) sends to a plain recording receiver that never pulls."""

    timeout = 600
    federation: dict = FederationPair.federation

    @inlineCallbacks
    def deployment(self, receiver: RecordingReceiver, federation: dict):
        self.a = Side(self, "a.test", "sqlite", "b.test", receiver.port, free_port(), federation)
        yield self.a.start()
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)
        alice = yield ensureDeferred(Client(self.a.url, self.pool).register("alice"))
        return alice

    async def rooms_with_bob_invited(self, alice: Client, n: int) -> list[str]:
        rooms = []
        for _ in range(n):
            room = await alice.create_room()
            await alice.invite(room, BOB)
            rooms.append(room)
        return rooms

    @inlineCallbacks
    def test_receiver_down_past_the_threshold_gets_every_message_once_in_order(self):
        """The receiver is stopped past catch_up_after_s while 5 messages go to each of 10 rooms; back, it is sent them all, once, in order."""
        receiver = RecordingReceiver(self)
        yield receiver.start()
        alice = yield self.deployment(receiver, self.federation)
        rooms = yield ensureDeferred(self.rooms_with_bob_invited(alice, 10))
        invites = lambda: [p for p in receiver.pdus() if p["type"] == "m.room.member"]  # noqa: E731
        yield wait_until(lambda: len(invites()) == 10, 60, "the 10 invites to reach the receiver")

        owner = shard_for("b.test", list(SENDERS))
        a = self.a.cluster
        entered_before = metric(a, owner, "synflow_federation_catch_up_entered_total")
        yield receiver.stop()
        during = yield ensureDeferred(send_per_room(alice, rooms, 5, "during"))
        yield wait_until(lambda: metric(a, owner, "synflow_federation_catch_up_entered_total") > entered_before,
                         60, "the owning sender to drop its queue for catch-up")
        yield receiver.start()
        yield wait_until(lambda: {e for _, e, _ in receiver.messages()} >= set(during), 120,
                         "every message sent during the outage to reach the receiver")
        yield wait_until(lambda: metric(a, owner, "synflow_federation_catching_up", destination="b.test") == 0,
                         30, "the owning sender to leave catch-up mode")
        assert_same_rooms_in_order(self, messages(a), receiver.messages(), "a.test")
        self.assertEqual(len(invites()), 10, "an invite was sent twice")

    @inlineCallbacks
    def test_new_destination_failing_its_first_two_transactions_gets_all_120_messages(self):
        """A new destination answers 500 twice (backoff 1-4 s, far below the threshold) while 120 messages are sent: all arrive, once, in order."""
        receiver = RecordingReceiver(self, fail_first=2)
        yield receiver.start()
        federation = {**self.federation, "catch_up_after_s": 3600.0,
                      "backoff": {"initial_s": 1.0, "multiplier": 2.0, "max_s": 4.0, "jitter": 0.1}}
        alice = yield self.deployment(receiver, federation)
        (room,) = yield ensureDeferred(self.rooms_with_bob_invited(alice, 1))
        sent = []
        for i in range(120):
            result = yield ensureDeferred(alice.send(room, {"body": f"m{i}"}, f"t{i}"))
            sent.append(result["event_id"])
        yield wait_until(lambda: len(receiver.messages()) >= 120, 120, "all 120 messages to reach the receiver")
        yield sleep(1.0)  # anything sent twice would arrive by now
        self.assertEqual([e for _, e, _ in receiver.messages()], sent)
        self.assertEqual(len([p for p in receiver.pdus() if p["type"] == "m.room.member"]), 1)


class SynflowPeerPastTheCapTest(FederationPair, TestCase):
    """Past catch_up_max_events the sender sends the latest per room; the synflow receiver pulls the rest."""

    engine = "sqlite"
    federation: dict = {**FederationPair.federation, "catch_up_max_events": 2}

    @inlineCallbacks
    def test_receiver_pulls_the_rest_with_get_missing_events(self):
        """With a cap of 2 and 50 owed messages, b.test gets each room's latest, pulls the others, and ends with all, once, in order."""
        yield self.pair()
        alice, bob, rooms = yield ensureDeferred(self.shared_rooms(10))
        chain = SyncChain(bob)
        yield ensureDeferred(chain.round(0))
        owner = shard_for("b.test", list(SENDERS))
        a, b = self.a.cluster, self.b.cluster
        entered_before = metric(a, owner, "synflow_federation_catch_up_entered_total")
        latest_mode_before = metric(a, owner, "synflow_federation_catch_ups_total", mode="latest_per_room")
        yield self.b.stop()
        # More than the cap is owed before the catch-up's first read, so it sends the latest per room.
        first = yield ensureDeferred(send_per_room(alice, rooms[:1], 5, "first"))
        yield wait_until(lambda: metric(a, owner, "synflow_federation_catch_up_entered_total") > entered_before,
                         60, "the owning sender to drop its queue for catch-up")
        rest = yield ensureDeferred(send_per_room(alice, rooms[1:], 5, "rest"))
        during = first + rest
        yield wait_until(
            lambda: metric(a, owner, "synflow_federation_catch_ups_total", mode="latest_per_room") > latest_mode_before,
            60, "the catch-up to send the latest event per room (past catch_up_max_events)")
        yield self.b.start()
        yield wait_until(lambda: {e for _, e, _ in messages(b)} >= set(during), 120,
                         "every message to reach b.test, most of them pulled")
        assert_same_rooms_in_order(self, messages(a), messages(b), "a.test")
        pulled = metric(b, "master", "synflow_federation_missing_events_pulled_total", outcome="persisted")
        self.assertGreaterEqual(pulled, len(during) - 2 * len(rooms), "b.test did not pull the gaps")
        yield ensureDeferred(chain.until_seen(set(during), tolerate_errors=5))
        self.assertEqual(sorted(chain.events), sorted(during), "bob's sync chain missed or repeated a message")
        room_of = {e: r for r, e, _ in messages(a)}
        for room in rooms:
            self.assertEqual([e for e in chain.events if room_of[e] == room],
                             [e for r, e, _ in messages(a) if r == room and e in set(during)],
                             f"{room}: bob saw it out of order")
