"""The federation sender: sharding, start-up, periodic wake-up, REMOTE_SERVER_UP, metrics."""

from __future__ import annotations

from prometheus_client import REGISTRY
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import ShardingError
from synflow.federation.interfaces import DestinationRecord
from synflow.federation.policy import RetryState
from synflow.tokens import StreamToken
from tests.federation.fakes import (
    LOCAL,
    EitherTransport,
    Events,
    FakeDestinationStore,
    FakeTransport,
    Harness,
    fast_config,
    unreachable,
)

REMOTE = "remote.test"


class ShardingTest(SynchronousTestCase):
    def test_each_of_20_destinations_is_owned_by_exactly_one_of_two_senders(self):
        """With two sender instances, every one of 20 destinations gets its PDU from exactly one."""
        clock, store, events = Clock(), FakeDestinationStore(), Events()
        transport = FakeTransport(clock)
        senders = [
            Harness(instances=["fs1", "fs2"], instance_name=name, clock=clock, store=store,
                    transport=transport, events=events)
            for name in ("fs1", "fs2")
        ]
        destinations = [f"server{i}.test" for i in range(20)]
        pdu = events.persist("!room")
        store.record_pdu(pdu, destinations)
        for h in senders:
            h.position = events.position()
            h.sender.notify_new_pdu(pdu, destinations)
        sent_to = sorted(s.destination for s in transport.sent)
        self.assertEqual(sent_to, sorted(destinations))
        owned = [set(h.sender.queues) for h in senders]
        self.assertEqual(owned[0] & owned[1], set())
        self.assertEqual(owned[0] | owned[1], set(destinations))
        self.assertTrue(owned[0] and owned[1], "both senders own some destinations")

    def test_own_server_and_foreign_destinations_are_skipped(self):
        """notify_new_pdu never queues for our own server or a destination another sender owns."""
        h = Harness(instances=["fs1", "fs2"], instance_name="fs1")
        dests = [f"server{i}.test" for i in range(10)]
        h.send("!r", [LOCAL, *dests])
        self.assertNotIn(LOCAL, h.sender.queues)
        self.assertEqual(set(h.sender.queues), {d for d in dests if h.sender.owns(d)})
        foreign = next(d for d in dests if not h.sender.owns(d))
        self.assertRaises(ShardingError, h.sender.queue, foreign)

    def test_instance_must_be_listed(self):
        """A sender whose instance is not in federation_sender_instances refuses to start."""
        self.assertRaises(ShardingError, Harness, instances=["fs1"], instance_name="fs9")


class StartUpTest(SynchronousTestCase):
    def test_start_catches_up_owned_outstanding_destinations(self):
        """start() sends what owned destinations missed before the restart, without new traffic."""
        store, events = FakeDestinationStore(), Events()
        dests = [f"server{i}.test" for i in range(6)]
        pdu = events.persist("!r")
        store.record_pdu(pdu, dests)
        h = Harness(instances=["fs1", "fs2"], instance_name="fs1", store=store, events=events)
        h.position = events.position()
        self.successResultOf(h.sender.start())
        mine = sorted(d for d in dests if h.sender.owns(d))
        self.assertEqual(sorted(s.destination for s in h.transport.sent), mine)
        for d in mine:
            self.assertEqual(h.store.records[d].last_successful, h.position)

    def test_periodic_wake_up_finds_outstanding_destinations(self):
        """Every wakeup_interval_s the sender wakes destinations the store says are behind."""
        h = Harness(config=fast_config(wakeup_interval_s=60))
        self.successResultOf(h.sender.start())
        pdu = h.events.persist("!r")
        h.store.record_pdu(pdu, [REMOTE])  # written by another process: no notification here
        h.position = h.events.position()
        h.clock.advance(59)
        self.assertEqual(h.transport.sent, [])
        h.clock.advance(1)
        self.assertEqual(h.transport.events_to(REMOTE), [pdu.event_id])
        self.successResultOf(h.sender.stop())

    def test_periodic_wake_up_catches_up_an_idle_queue(self):
        """An idle queue whose destination the store reports as behind catches up at the next wake-up."""
        h = Harness(config=fast_config(wakeup_interval_s=60))
        self.successResultOf(h.sender.start())
        h.settle(REMOTE)
        pdu = h.events.persist("!r")
        h.store.record_pdu(pdu, [REMOTE])  # not notified to this sender
        h.position = h.events.position()
        h.clock.advance(60)
        self.assertEqual(h.transport.events_to(REMOTE), [pdu.event_id])
        self.assertFalse(h.sender.queue(REMOTE).catching_up)
        h.clock.advance(60)
        self.assertEqual(len(h.transport.sent), 1)
        self.successResultOf(h.sender.stop())

    def test_stop_stops_the_periodic_wake_up(self):
        """After stop() nothing more is sent, even when the wake-up interval passes."""
        h = Harness()
        self.successResultOf(h.sender.start())
        self.successResultOf(h.sender.stop())
        pdu = h.events.persist("!r")
        h.store.record_pdu(pdu, [REMOTE])
        h.position = h.events.position()
        h.sender.notify_new_pdu(pdu, [REMOTE])
        h.clock.advance(600)
        self.assertEqual(h.transport.sent, [])
        self.assertEqual(h.clock.getDelayedCalls(), [])


    def test_restart_after_stop(self):
        """A sender started again after stop() sends again, catching up first."""
        h = Harness()
        self.successResultOf(h.sender.start())
        self.successResultOf(h.sender.stop())
        self.successResultOf(h.sender.start())
        pdu = h.send("!r", [REMOTE])
        self.assertEqual(h.transport.events_to(REMOTE), [pdu.event_id])
        self.successResultOf(h.sender.stop())


class RemoteServerUpTests(EitherTransport):
    """REMOTE_SERVER_UP resets the backoff and sends at once.

    Run twice: over FakeTransport, and over the real treq transport on StubTreq.
    """

    def test_remote_server_up_resets_backoff_and_sends_at_once(self):
        """notify_remote_server_up clears the stored backoff and sends the queue without waiting."""
        h = self.harness()
        h.settle(REMOTE)
        h.transport.script[REMOTE] = [unreachable(), unreachable()]
        h.send("!a", [REMOTE])
        h.clock.advance(10)
        q = h.sender.queue(REMOTE)
        self.assertTrue(q.backing_off)
        h.send("!b", [REMOTE])
        self.assertEqual(len(h.transport.sent), 2)
        self.successResultOf(h.sender.notify_remote_server_up(REMOTE))
        # The failed transaction goes again (same ID), then the PDU queued behind it.
        self.assertEqual([s.event_ids for s in h.transport.sent[2:]], [["$e1"], ["$e2"]])
        self.assertEqual(h.transport.sent[2].txn_id, h.transport.sent[0].txn_id)
        self.assertEqual(h.store.records[REMOTE].retry, RetryState())
        self.assertFalse(q.backing_off)
        self.assertEqual(q.pending_pdus, 0)

    def test_remote_server_up_starts_catch_up_for_an_idle_destination(self):
        """REMOTE_SERVER_UP for a backed-off destination with no queue yet catches it up at once."""
        h = self.harness()
        now = int(h.clock.seconds() * 1000)
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(now, 7_200_000, now), StreamToken.at(0))
        pdu = h.events.persist("!r")
        h.store.record_pdu(pdu, [REMOTE])
        h.position = h.events.position()
        self.successResultOf(h.sender.start())
        self.assertEqual(h.transport.sent, [])
        self.successResultOf(h.sender.notify_remote_server_up(REMOTE))
        self.assertEqual(h.transport.events_to(REMOTE), [pdu.event_id])
        self.successResultOf(h.sender.stop())

    def test_remote_server_up_ignores_foreign_destinations(self):
        """A sender does nothing for REMOTE_SERVER_UP of a destination it does not own."""
        h = self.harness(instances=["fs1", "fs2"], instance_name="fs1")
        foreign = next(f"s{i}.test" for i in range(50) if not h.sender.owns(f"s{i}.test"))
        self.successResultOf(h.sender.notify_remote_server_up(foreign))
        self.assertEqual(h.sender.queues, {})


class RemoteServerUpTest(RemoteServerUpTests, SynchronousTestCase):
    """REMOTE_SERVER_UP resets the backoff and sends at once (FakeTransport)."""


class RemoteServerUpTreqTest(RemoteServerUpTests, SynchronousTestCase):
    """REMOTE_SERVER_UP resets the backoff and sends at once (treq on StubTreq)."""

    treq = True


class MetricsTest(SynchronousTestCase):
    def test_queue_gauges_and_counters(self):
        """Pending PDUs, in-flight, backoff and sent/failed counts are exported to Prometheus."""
        def value(name, labels=None):
            return REGISTRY.get_sample_value(name, labels or {}) or 0.0

        h = Harness()
        h.settle(REMOTE)
        labels = {"destination": REMOTE}
        sent_before = value("synflow_federation_transactions_sent_total")
        failed_before = value("synflow_federation_transactions_failed_total", {"retriable": "true"})
        h.transport.script[REMOTE] = ["hold"]
        for i in range(3):
            h.send(f"!r{i}", [REMOTE])
        self.assertEqual(value("synflow_federation_pending_pdus", labels), 3)
        self.assertEqual(value("synflow_federation_in_flight", labels), 1)
        h.transport.release(unreachable())
        self.assertEqual(value("synflow_federation_backing_off", labels), 1)
        self.assertEqual(value("synflow_federation_backoff_interval_seconds", labels), 10)
        self.assertEqual(value("synflow_federation_transactions_failed_total", {"retriable": "true"}),
                         failed_before + 1)
        h.clock.advance(10)
        self.assertEqual(value("synflow_federation_pending_pdus", labels), 0)
        self.assertEqual(value("synflow_federation_backing_off", labels), 0)
        self.assertEqual(value("synflow_federation_transactions_sent_total"), sent_before + 2)
        self.successResultOf(h.sender.stop())
        self.assertIsNone(REGISTRY.get_sample_value("synflow_federation_pending_pdus", labels))

    def test_pdu_and_edu_counters_and_catch_up_gauge(self):
        """Pending EDUs, PDUs/EDUs sent and failed, catch-up entries and the catching-up gauge follow the queue."""
        def value(name, labels=None):
            return REGISTRY.get_sample_value(name, labels or {}) or 0.0

        counters = {
            "pdus_queue": ("synflow_federation_pdus_sent_total", {"mode": "queue"}),
            "pdus_catch_up": ("synflow_federation_pdus_sent_total", {"mode": "catch_up"}),
            "edus": ("synflow_federation_edus_sent_total", None),
            "pdus_failed": ("synflow_federation_pdus_failed_total", None),
            "edus_failed": ("synflow_federation_edus_failed_total", None),
            "entered": ("synflow_federation_catch_up_entered_total", None),
        }
        base = {k: value(n, lb) for k, (n, lb) in counters.items()}

        def delta():
            return {k: value(n, lb) - base[k] for k, (n, lb) in counters.items()}

        h = Harness(config=fast_config(catch_up_after_s=15))
        labels = {"destination": REMOTE}
        h.sender.queue(REMOTE)
        self.assertEqual(value("synflow_federation_catching_up", labels), 1)  # every queue starts catching up
        h.settle(REMOTE)
        self.assertEqual(value("synflow_federation_catching_up", labels), 0)
        h.transport.script[REMOTE] = ["hold"]
        for i in range(3):
            h.send(f"!r{i}", [REMOTE])
        for i in range(4):
            h.edu(REMOTE, i)
        self.assertEqual(value("synflow_federation_pending_pdus", labels), 3)
        self.assertEqual(value("synflow_federation_pending_edus", labels), 4)
        h.transport.release(unreachable())  # the first transaction (one PDU) fails
        self.assertEqual(delta(), {**dict.fromkeys(base, 0.0), "pdus_failed": 1})
        h.clock.advance(10)  # its retry, then two PDUs and four EDUs, succeed
        self.assertEqual(value("synflow_federation_pending_pdus", labels), 0)
        self.assertEqual(value("synflow_federation_pending_edus", labels), 0)
        self.assertEqual(delta(), {**dict.fromkeys(base, 0.0), "pdus_failed": 1, "pdus_queue": 3, "edus": 4})
        h.transport.default = unreachable()
        h.edu(REMOTE, 10)  # goes at once, alone, and fails
        h.edu(REMOTE, 11)  # waits behind it
        self.assertEqual(delta()["edus_failed"], 1)
        self.assertEqual(value("synflow_federation_pending_edus", labels), 2)
        q = h.sender.queue(REMOTE)
        h.send("!late", [REMOTE])
        h.clock.advance(q.backoff_interval_s)  # the retry fails: 20 s > 15 s, the queue is dropped
        self.assertEqual(value("synflow_federation_catching_up", labels), 1)
        self.assertEqual(value("synflow_federation_pending_edus", labels), 0)
        self.assertEqual(delta()["entered"], 1)
        self.assertEqual(delta()["edus_failed"], 2)
        h.transport.default = "ok"
        h.clock.advance(q.backoff_interval_s)
        self.assertEqual(value("synflow_federation_catching_up", labels), 0)
        self.assertEqual(delta()["pdus_catch_up"], 1)  # !late: the others were sent before
        self.assertEqual(delta()["edus"], 4)  # the dropped EDUs were never sent
