"""A process's /health (start-up, replication, database) and its graceful stop, in one reactor."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.test.requesthelper import DummyRequest

from synflow.app.build import build_service
from synflow.app.services import DatabaseProbe
from synflow.config import load_config
from synflow.events.persist import EventSpec
from synflow.http.site import HealthResource
from synflow.storage.engines import Database, DatabaseConfig
from tests import services
from tests.cluster import free_port, single_master, sleep, wait_until
from tests.replication.test_tcp import LineCollector


class FakeDatabase:
    """Answers each ``run_interaction`` with the Deferred the test hands it."""

    def __init__(self) -> None:
        self.calls: list[Deferred[Any]] = []

    def run_interaction(self, desc: str, func: Any, *args: Any, **kwargs: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.calls.append(d)
        return d


class DatabaseProbeTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.db = FakeDatabase()
        self.probe = DatabaseProbe(self.db, self.clock, interval_s=5, timeout_s=2)
        self.probe.startService()

    def test_answer_is_healthy(self) -> None:
        """A probe that answers leaves no problem; the next one runs an interval later."""
        self.assertEqual(len(self.db.calls), 1)
        self.db.calls[0].callback([(1,)])
        self.assertIsNone(self.probe.problem)
        self.clock.advance(5)
        self.assertEqual(len(self.db.calls), 2)

    def test_error_is_reported_until_an_answer(self) -> None:
        """A failed SELECT 1 is reported in one line with its error; the next answer clears it."""
        self.db.calls[0].errback(RuntimeError("could not connect to server:\n  Connection refused"))
        self.assertEqual(self.probe.problem,
                         "database unreachable: RuntimeError: could not connect to server: Connection refused")
        self.clock.advance(5)
        self.db.calls[1].callback([(1,)])
        self.assertIsNone(self.probe.problem)

    def test_no_answer_within_timeout(self) -> None:
        """A SELECT 1 unanswered after the timeout is reported, is not stacked up, and a late answer clears it."""
        self.clock.advance(1.9)
        self.assertIsNone(self.probe.problem)
        self.clock.advance(0.2)
        self.assertEqual(self.probe.problem, "database unreachable: no answer to SELECT 1 within 2s")
        self.clock.advance(20)
        self.assertEqual(len(self.db.calls), 1)
        self.db.calls[0].callback([(1,)])
        self.assertIsNone(self.probe.problem)
        self.clock.advance(5)
        self.assertEqual(len(self.db.calls), 2)

    def test_stop_waits_for_probe_in_flight(self) -> None:
        """stopService fires only once the probe in flight has answered, and no probe runs after it."""
        stopped = self.probe.stopService()
        self.assertNoResult(stopped)
        self.db.calls[0].callback([(1,)])
        self.successResultOf(stopped)
        self.clock.advance(60)
        self.assertEqual(len(self.db.calls), 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])


class DatabaseProbeRealTest(TestCase):
    timeout = 30

    @inlineCallbacks
    def test_unreachable_postgres(self) -> None:
        """Against a PostgreSQL port where nothing listens, the probe reports the driver's error."""
        db = Database(reactor, DatabaseConfig(engine="postgres", host="127.0.0.1", port=free_port(),
                                              dbname="synflow", connect_timeout_s=2))
        self.addCleanup(db.close)
        probe = DatabaseProbe(db, reactor, interval_s=60, timeout_s=10)
        probe.startService()
        self.addCleanup(probe.stopService)
        yield wait_until(lambda: probe.problem, 20, "the probe to fail")
        self.assertTrue(probe.problem.startswith("database unreachable: OperationalError: "), probe.problem)
        self.assertIn("refused", probe.problem)
        self.assertNotIn("\n", probe.problem)
        self.flushLoggedErrors()

    @inlineCallbacks
    def test_sqlite_answers(self) -> None:
        """Against a working SQLite database the probe reports nothing."""
        db = Database(reactor, DatabaseConfig(engine="sqlite", path=os.path.abspath(self.mktemp())))
        self.addCleanup(db.close)
        probe = DatabaseProbe(db, reactor, interval_s=60, timeout_s=10)
        probe.startService()
        yield probe.stopService()  # waits for the first probe
        self.assertIsNone(probe.problem)


def _render_health(process: Any) -> tuple[int, dict[str, Any]]:
    request = DummyRequest([b""])
    body = HealthResource(process.health_problems, process.health_details).render_GET(request)
    return request.responseCode, json.loads(body)


@inlineCallbacks
def _get_health(port: int):
    response = yield treq.get(f"http://127.0.0.1:{port}/health", persistent=False)
    body = yield response.json()
    return response.code, body


def _write(base: str, name: str, text: str) -> str:
    path = os.path.join(base, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


class Deployment:
    """Config files for a master and a cache-invalidator worker sharing one SQLite database."""

    def __init__(self, testcase: TestCase, extra_shared: str = "") -> None:
        self.base = os.path.abspath(testcase.mktemp())
        os.makedirs(self.base)
        self.hub_port = free_port()
        self.ports = {"master": free_port(), "c1": free_port()}
        self.shared = _write(self.base, "shared.yaml", (
            f"server_name: health.test\ndata_dir: {self.base}/var\n"
            f"replication: {{hub: {{host: 127.0.0.1, port: {self.hub_port}}}, ping_interval_s: 1, ping_timeout_s: 3}}\n"
            "instance_map:\n" + "".join(f"  {n}: {{host: 127.0.0.1, port: {p}}}\n" for n, p in self.ports.items())
            + "stream_writers: {events: [master]}\n" + extra_shared))

    def config(self, name: str, app: str, extra: str = "") -> Any:
        own = _write(self.base, f"{name}.yaml", f"app: {app}\ninstance_name: {name}\n{extra}")
        return load_config([self.shared, own])


class HealthTest(TestCase):
    timeout = 60

    def test_not_started(self) -> None:
        """Before start-up has finished, /health is 503 with the problem ``starting``."""
        deployment = Deployment(self)
        process = build_service(deployment.config("master", "master"), reactor, exit_on_failure=False)
        code, body = _render_health(process)
        self.assertEqual(code, 503)
        self.assertEqual((body["status"], body["problems"]), ("unhealthy", ["starting"]))
        self.assertEqual((body["instance"], body["app"]), ("master", "master"))

    @inlineCallbacks
    def _master_with_port_taken(self, deployment: Deployment, port: int):
        """Start ``deployment``'s master while another socket listens on ``port``; return it once start-up failed."""
        taken = socket.socket()
        self.addCleanup(taken.close)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        master = build_service(deployment.config("master", "master"), reactor, exit_on_failure=False)
        master.startService()
        self.addCleanup(master.stopService)
        yield wait_until(lambda: master.failure is not None, 20, "start-up to fail")
        self.assertFalse(master.started)
        return master

    @inlineCallbacks
    def test_listener_port_taken_fails_start_up(self) -> None:
        """A listener whose port is taken fails start-up naming it: the process never reports itself started."""
        deployment = Deployment(self)
        port = deployment.ports["master"]
        master = yield self._master_with_port_taken(deployment, port)
        self.assertIn("cannot listen on", master.failure)
        self.assertIn(str(port), master.failure)
        self.assertIn("Address already in use", master.failure)
        code, body = _render_health(master)
        self.assertEqual((code, body["problems"]), (503, [master.failure]))

    @inlineCallbacks
    def test_hub_port_taken_fails_start_up(self) -> None:
        """The master's replication hub listener is checked too: a taken hub port fails start-up naming it."""
        deployment = Deployment(self)
        master = yield self._master_with_port_taken(deployment, deployment.hub_port)
        self.assertIn("replication-hub: cannot listen on", master.failure)
        self.assertIn(str(deployment.hub_port), master.failure)

    @inlineCallbacks
    def test_replication_disconnected(self) -> None:
        """A worker whose hub goes away answers 503 naming the replication hub; while connected it answers 200."""
        deployment = Deployment(self)
        master = build_service(deployment.config("master", "master"), reactor, exit_on_failure=False)
        master.startService()
        self.addCleanup(master.stopService)
        yield master.ready
        worker = build_service(deployment.config("c1", "cache_invalidator"), reactor, exit_on_failure=False)
        worker.startService()
        self.addCleanup(worker.stopService)
        yield worker.ready
        port = deployment.ports["c1"]
        yield wait_until(lambda: worker.replication.transport.connected, 20, "the worker to connect")
        code, body = yield _get_health(port)
        self.assertEqual((code, body["status"], body["problems"]), (200, "ok", []))
        self.assertIn("events", body["positions"])
        yield master.stopService()
        yield wait_until(lambda: not worker.replication.transport.connected, 20, "the worker to notice")
        code, body = yield _get_health(port)
        self.assertEqual(code, 503)
        self.assertEqual(body["problems"], [f"not connected to replication (hub 127.0.0.1:{deployment.hub_port})"])

    @inlineCallbacks
    def test_database_unreachable(self) -> None:
        """A process whose PostgreSQL database disappears answers 503 ``database unreachable: ...``."""
        services.require_postgres()
        dbname = services.create_pg_database()
        self.addCleanup(services.drop_pg_database, dbname)
        deployment = Deployment(self, extra_shared=(
            f"database: {{engine: postgres, host: {services.PG_HOST}, port: {services.PG_PORT}, "
            f"user: {services.PG_USER}, dbname: {dbname}, connect_timeout_s: 2}}\n"))
        master = build_service(deployment.config("master", "master"), reactor, exit_on_failure=False)
        master.startService()
        self.addCleanup(master.stopService)
        yield master.ready
        port = deployment.ports["master"]
        code, body = yield _get_health(port)
        self.assertEqual((code, body["problems"]), (200, []))
        services.drop_pg_database(dbname)
        yield wait_until(lambda: master.db_probe.problem, 20, "the database probe to fail")
        code, body = yield _get_health(port)
        self.assertEqual(code, 503)
        self.assertEqual(len(body["problems"]), 1, body)
        self.assertTrue(body["problems"][0].startswith("database unreachable: OperationalError: "), body)
        self.assertIn(dbname, body["problems"][0])
        self.flushLoggedErrors()


#: A dozen persist batches: more than could finish while the rest of the process stops.
DRAIN_EVENTS = 3000


def _message(room: str, n: int) -> EventSpec:
    return EventSpec(room, "m.room.message", "@a:api.test", {"body": f"m{n}"}, origin="api.test", origin_server_ts=n)


class GracefulStopTest(TestCase):
    timeout = 60

    @inlineCallbacks
    def test_stop_waits_for_persists(self) -> None:
        """stopService waits for drain(): every event queued before the stop is persisted and acknowledged."""
        master, _ = yield single_master(self)
        room = "!drain:api.test"
        yield master.worker.persister.persist([
            EventSpec(room, "m.room.create", "@a:api.test", {"creator": "@a:api.test"}, state_key="", origin="api.test"),
            EventSpec(room, "m.room.member", "@a:api.test", {"membership": "join"}, state_key="@a:api.test",
                      origin="api.test"),
        ])
        # Another connection holds SQLite's write lock, so the first batch waits in the database while the
        # stop begins; the room's later events are queued behind it (a room's batches run one at a time).
        path = master.config.database_path
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        persists = [master.worker.persister.persist([_message(room, n)]) for n in range(DRAIN_EVENTS)]
        results: list[Any] = []
        for d in persists:
            d.addBoth(results.append)
        stopping = master.stopService()
        yield sleep(1.0)
        self.assertEqual(results, [])
        self.assertNoResult(stopping)
        blocker.execute("ROLLBACK")
        blocker.close()
        yield stopping
        self.assertEqual(len(results), DRAIN_EVENTS)
        failures = [r for r in results if not isinstance(r, list) or r[0].error is not None]
        self.assertEqual(failures, [])
        self.assertEqual(len({r[0].event_id for r in results}), DRAIN_EVENTS)
        conn = sqlite3.connect(path)
        try:
            count = conn.execute("SELECT count(*) FROM events WHERE room_id = ? AND type = 'm.room.message'",
                                 (room,)).fetchone()[0]
        finally:
            conn.close()
        self.assertEqual(count, DRAIN_EVENTS)

    @inlineCallbacks
    def test_master_closes_worker_connections_with_reason(self) -> None:
        """On stop the master's hub tells each connected worker why: ``ERROR server stopping``."""
        master, _ = yield single_master(self)
        hub = master.replication.service.getServiceNamed("replication-hub")
        collector = LineCollector()
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", hub.bound_port)
        from twisted.internet.endpoints import connectProtocol

        yield connectProtocol(endpoint, collector)
        secret = master.config.replication_secret()
        collector.transport.write(b"AUTH " + secret.encode() + b"\nNAME fake_worker\n")
        first = yield collector.wait_lines(1)
        self.assertTrue(first[0].startswith("SERVER "), first)
        yield wait_until(lambda: master.replication.hub.connections, 10, "the hub to register the connection")
        yield master.stopService()
        yield collector.closed
        self.assertIn("ERROR server stopping", collector.lines)

    @inlineCallbacks
    def test_worker_closes_its_connection_with_reason(self) -> None:
        """On stop a worker tells the hub why before closing: ``ERROR worker shutting down``."""
        deployment = Deployment(self)
        # The master prepares the database, then a stand-in hub takes the hub's port.
        master = build_service(deployment.config("master", "master", f"replication: {{hub: {{port: {free_port()}}}}}\n"),
                               reactor, exit_on_failure=False)
        master.startService()
        self.addCleanup(master.stopService)
        yield master.ready
        hub_side: list[LineCollector] = []

        def build() -> LineCollector:
            proto = LineCollector()
            hub_side.append(proto)
            return proto

        port = yield TCP4ServerEndpoint(reactor, deployment.hub_port, interface="127.0.0.1").listen(
            Factory.forProtocol(build))
        self.addCleanup(port.stopListening)
        worker = build_service(deployment.config("c1", "cache_invalidator"), reactor, exit_on_failure=False)
        worker.startService()
        self.addCleanup(worker.stopService)
        yield worker.ready
        yield wait_until(lambda: hub_side, 10, "the worker to connect")
        hub_side[0].transport.write(b"SERVER health.test\n")
        yield wait_until(lambda: worker.replication.transport.connected, 10, "the worker's connection")
        yield worker.stopService()
        yield hub_side[0].closed
        self.assertIn("ERROR worker shutting down", hub_side[0].lines)
        self.assertTrue(any(line.startswith("NAME c1") for line in hub_side[0].lines), hub_side[0].lines)




class SyncFollowsRowsOnlyWithClientApiTest(TestCase):
    """Sync is the client API's: only a process serving it keeps a sync handler following the events stream."""

    @inlineCallbacks
    def test_without_the_client_api_no_sync_handler(self) -> None:
        from synflow.events.sync import SyncHandler

        def sync_listeners(service: Any) -> list[Any]:
            view = service.replication.handler.views["events"]
            return [fn for fn in view.row_handlers + view.position_listeners
                    if isinstance(getattr(fn, "__self__", None), SyncHandler)]

        federation_only, _ = yield single_master(self, resources=("federation",))
        self.assertIsNone(federation_only.worker.sync)
        self.assertEqual(sync_listeners(federation_only), [])
        with_client, _ = yield single_master(self)
        self.assertIsInstance(with_client.worker.sync, SyncHandler)
        self.assertEqual(len(sync_listeners(with_client)), 2)  # its rows and its positions
