"""Fault scenarios: client traffic while something breaks, then nothing lost, repeated or skipped.

Each scenario runs a deployment (real processes), drives sends and every
user's sync chain through the fault, checks the chains from the responses
(0 lost / 0 duplicated / 0 out of order), and validates the audit logs with
the Spark token validator (0 anomalies).
"""

from __future__ import annotations

import os
import signal
import socket

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase

from synflow.tools.workload import Workload
from tests import services
from tests.cluster import Cluster, deep_update, free_port, sleep, wait_until
from tests.spark._session import validate, violations

WRITERS = ("persister1", "persister2")


class _Blackhole(Protocol):
    """Forwards bytes both ways until the test cuts the link without closing it."""

    def __init__(self, target: tuple[str, int], proxy: PartitionProxy) -> None:
        self.target = target
        self.proxy = proxy
        self.peer: socket.socket | None = None

    def connectionMade(self) -> None:
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        self.proxy.live.add(self)
        self.buffer: list[bytes] = []
        self.outbound = _Outbound(self)
        connectProtocol(TCP4ClientEndpoint(reactor, *self.target), self.outbound)

    def dataReceived(self, data: bytes) -> None:
        if self.proxy.partitioned:
            return  # dropped on the floor: the peer sees silence, not a close
        if self.outbound.transport is None:
            self.buffer.append(data)
        else:
            self.outbound.transport.write(data)

    def connectionLost(self, reason) -> None:
        self.proxy.live.discard(self)
        if self.outbound.transport is not None:
            self.outbound.transport.loseConnection()


class _Outbound(Protocol):
    def __init__(self, inbound: _Blackhole) -> None:
        self.inbound = inbound

    def connectionMade(self) -> None:
        for chunk in self.inbound.buffer:
            self.transport.write(chunk)
        self.inbound.buffer = []

    def dataReceived(self, data: bytes) -> None:
        if not self.inbound.proxy.partitioned:
            self.inbound.transport.write(data)

    def connectionLost(self, reason) -> None:
        self.inbound.transport.loseConnection()


class PartitionProxy(Factory):
    """A TCP forwarder that can silently drop all traffic (a network partition)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.partitioned = False
        self.live: set[_Blackhole] = set()

    def buildProtocol(self, addr):
        return _Blackhole(self.target, self)

    def listen(self) -> int:
        self.port = reactor.listenTCP(0, self, interface="127.0.0.1")
        return self.port.getHost().port


class FaultMixin:
    engine = "sqlite"
    transport = "tcp"
    timeout = 900

    @inlineCallbacks
    def deployment(self, *, proxy=None, extra_shared=None, invalidator=False):
        services.require_java()
        shared = {"replication": {"ping_timeout_s": 3.0, "ping_interval_s": 1.0}}
        if extra_shared:
            deep_update(shared, extra_shared)
        extra = ()
        if invalidator:
            # The shared Redis cache tier, owned by one cache invalidator.
            services.require_redis()
            extra = ("cache_invalidator1",)
            shared["caches"] = {"tier": {"host": services.REDIS_HOST, "port": services.REDIS_PORT,
                                         "channel_prefix": services.redis_prefix()},
                                "cache_invalidator_instances": list(extra)}
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS, shared=shared,
                          extra_instances=extra)
        self.client_ports = {"master": free_port(), "persister2": free_port()}
        yield cluster.start_master(listeners=[
            {"resources": ["client"], "endpoint": f"tcp:{self.client_ports['master']}:interface=127.0.0.1"}])
        p1 = {}
        if proxy is not None:
            # persister1 reaches the hub only through the proxy.
            proxy.target = ("127.0.0.1", cluster.hub_port)
            p1 = {"replication": {"hub": {"host": "127.0.0.1", "port": proxy.listen()}}}
            self.addCleanup(proxy.port.stopListening)
        cluster.start_twistd("persister1", "event_persister", **p1)
        cluster.start_twistd("persister2", "event_persister", listeners=[
            {"resources": ["client"], "endpoint": f"tcp:{self.client_ports['persister2']}:interface=127.0.0.1"}])
        for name in extra:
            cluster.start_twistd(name, "cache_invalidator")
        for name in (*WRITERS, *extra):
            yield cluster.wait_for_port(cluster.instance_ports[name], name)
        self.urls = [f"http://127.0.0.1:{p}" for p in self.client_ports.values()]
        return cluster

    async def traffic(self, fault, messages: int = 500):
        workload = Workload(self.urls, users=12, rooms=30, members_per_room=3, messages=messages,
                            concurrency=8, seed=9, sync_timeout_ms=1000)
        await workload.setup()
        chains = ensureDeferred(workload.sync_chains())
        sending = ensureDeferred(workload.send_messages())
        while sum(len(v) for v in workload.sent.values()) < messages // 3:
            await sleep(0.1)
        await fault()
        await sending
        workload.stop_syncing()
        await chains
        await workload.drain(timeout_s=120)
        await workload.close()
        return workload.verify()

    @inlineCallbacks
    def finish(self, cluster: Cluster, report):
        self.assertEqual((report.lost, report.duplicated, report.order_mismatches, report.foreign), (0, 0, 0, 0),
                         report.as_dict())
        self.assertGreater(report.sent, 0)
        for name in ("persister1", "persister2", "master"):
            yield cluster.stop(name)
        out = os.path.abspath(self.mktemp())
        code = validate(cluster.shared["audit"]["dir"], out)
        self.assertEqual((code, violations(out)), (0, []))

    @inlineCallbacks
    def kill_and_restart_under_load(self, cluster: Cluster, name: str, app: str):
        """SIGKILL ``name`` once a third of the traffic is sent, restart it a second later, and check the run."""

        async def fault():
            cluster.kill(name)
            await sleep(1.0)
            cluster.start_twistd(name, app)
            await cluster.wait_for_port(cluster.instance_ports[name], name)

        report = yield ensureDeferred(self.traffic(fault))
        yield self.finish(cluster, report)

    @inlineCallbacks
    def test_sigkill_persister(self):
        """SIGKILL of an event persister mid-load, then restart."""
        cluster = yield self.deployment()
        yield self.kill_and_restart_under_load(cluster, "persister1", "event_persister")

    @inlineCallbacks
    def test_sigkill_master(self):
        """SIGKILL of the master mid-load (clients keep using persister2's API), then restart."""
        cluster = yield self.deployment()

        async def fault():
            cluster.kill("master")
            await sleep(2.0)
            yield_ = cluster.start_master(listeners=[
                {"resources": ["client"], "endpoint": f"tcp:{self.client_ports['master']}:interface=127.0.0.1"}])
            await yield_

        report = yield ensureDeferred(self.traffic(fault))
        yield self.finish(cluster, report)

    @inlineCallbacks
    def test_reader_stops_reading(self):
        """A persister SIGSTOPped (it stops reading) is moved to catch-up, writers stay bounded, it resumes whole."""
        cluster = yield self.deployment(extra_shared={"replication": {"ping_timeout_s": 30.0, "high_water": 200,
                                                                     "hard_limit": 400}})
        master_pid = cluster.procs["master"].pid

        def rss(pid: int) -> int:
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

        samples = []

        async def fault():
            cluster.signal("persister1", signal.SIGSTOP)
            for _ in range(8):
                samples.append(rss(master_pid))
                await sleep(0.5)
            cluster.signal("persister1", signal.SIGCONT)

        report = yield ensureDeferred(self.traffic(fault, messages=600))
        self.assertLess(max(samples) - min(samples), 64 * 1024, f"master RSS grew while a reader was stopped: {samples}")
        yield self.finish(cluster, report)

class SqliteTcpFaultTest(FaultMixin, TestCase):
    @inlineCallbacks
    def test_partition_longer_than_keepalive(self):
        """A persister cut off from the hub (traffic silently dropped) past the keep-alive timeout recovers."""
        proxy = PartitionProxy("127.0.0.1", 0)

        async def fault():
            proxy.partitioned = True
            await sleep(5.0)  # ping timeout is 3 s
            proxy.partitioned = False

        cluster = yield self.deployment(proxy=proxy)
        report = yield ensureDeferred(self.traffic(fault))
        log = cluster.log_tail("persister1", 200_000)
        self.assertIn("nothing received for", log)  # the keep-alive timeout closed the link
        yield self.finish(cluster, report)




class PostgresRedisFaultTest(FaultMixin, TestCase):
    engine = "postgres"
    transport = "redis"

    @inlineCallbacks
    def test_redis_stopped_and_restarted(self):
        """The deployment's own redis-server is stopped mid-load for 10 s, then started again on its port."""
        redis = services.PrivateRedis(self, free_port())
        redis.start()
        yield wait_until(redis.up, 20, "the deployment's redis-server")
        cluster = yield self.deployment(extra_shared={"replication": {"redis": {"port": redis.port}}})

        async def fault():
            redis.stop()  # every connection drops; reconnects are refused until it is back
            await sleep(10.0)
            redis.start()
            await wait_until(redis.up, 20, "the restarted redis-server")

        report = yield ensureDeferred(self.traffic(fault))
        for name in ("master", *WRITERS):
            # Each process saw the outage and subscribed again afterwards.
            log = cluster.log_tail(name, 500_000)
            self.assertIn("Redis connection (channel", log, name)
            self.assertGreaterEqual(log.count("subscribed to Redis channel"), 2, name)
        yield self.finish(cluster, report)

    @inlineCallbacks
    def test_redis_clients_killed_and_paused(self):
        """Every Redis connection is killed and every command held for 10 s (an unresponsive Redis)."""
        from tests.integration.test_multiwriter import redis_command

        cluster = yield self.deployment()

        async def fault():
            # One connection: drop every client, then hold every command for 10 s.
            redis_command(b"CLIENT KILL TYPE normal SKIPME yes", b"CLIENT KILL TYPE pubsub SKIPME yes",
                          b"CLIENT PAUSE 10000 ALL")
            await sleep(10.5)

        report = yield ensureDeferred(self.traffic(fault))
        yield self.finish(cluster, report)

    @inlineCallbacks
    def test_sigkill_cache_invalidator(self):
        """SIGKILL of the cache invalidator mid-load (PostgreSQL, Redis transport and cache tier), then restart."""
        cluster = yield self.deployment(invalidator=True)
        yield self.kill_and_restart_under_load(cluster, "cache_invalidator1", "cache_invalidator")

    @inlineCallbacks
    def test_postgres_connections_killed(self):
        """Every PostgreSQL backend of the deployment is terminated mid-load."""
        cluster = yield self.deployment()

        async def fault():
            for _ in range(2):
                conn = services.pg_connect()
                cur = conn.cursor()
                cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                            "AND pid <> pg_backend_pid()", (cluster.dbname,))
                conn.close()
                await sleep(1.0)

        report = yield ensureDeferred(self.traffic(fault))
        yield self.finish(cluster, report)

