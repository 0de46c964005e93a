"""Replication over Redis with TLS, against a real redis-server that speaks nothing but TLS.

Each test makes a throwaway CA, a server certificate for 127.0.0.1/localhost and a
client certificate in its temp dir, starts a redis-server of its own with ``--port 0
--tls-port <free port>`` (no plaintext listener at all), and runs synflow's Redis
transports against it with ``replication.redis.tls`` configured -- so every byte the
transports exchange goes through synflow's own TLS endpoint. The failure cases check
that a certificate problem is logged as one, retried with a growing backoff, and never
mistaken for a refused password.
"""

from __future__ import annotations

import os
import socket

from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow import registry
from synflow.config import load_config
from synflow.replication.handler import ReplicationHandler
from synflow.replication.redis import RedisTransportService
from synflow.storage.id_generators import FactPayload, MultiWriterIdGenerator
from synflow.streams import EVENTS
from synflow.testing import RecordingReceiver
from tests import services
from tests.certs import make_tls_files
from tests.cluster import free_port, wait_until
from tests.replication.test_handler import ListSource
from tests.replication.test_redis import LogCapture, ev

PASSWORD = "tls-s3cret"


def plaintext_ping(port):
    """What a plaintext PING to ``port`` gets back (a TLS-only server never says +PONG)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"PING\r\n")
        try:
            return s.recv(64)
        except OSError:
            return b""


class RedisTlsTest(TestCase):
    timeout = 120

    def setUp(self):
        self.tls = make_tls_files(os.path.abspath(self.mktemp()))
        self.prefix = services.redis_prefix()

    @inlineCallbacks
    def _redis(self, client_certs=False, password=None):
        """Start a TLS-only redis-server; ``client_certs`` makes it require client certificates."""
        log = os.path.join(os.path.dirname(self.tls["ca"]), "redis.log")
        redis = services.PrivateRedis(self, free_port(), (
            "--tls-cert-file", self.tls["server_cert"], "--tls-key-file", self.tls["server_key"],
            "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "yes" if client_certs else "no",
            "--logfile", log, *(("--requirepass", password) if password else ()),
        ), tls=True)
        redis.start()
        yield wait_until(lambda: redis.up() or redis.proc.poll() is not None, 20, "the TLS redis-server")
        if not redis.up():
            with open(log) if os.path.exists(log) else open(os.devnull) as f:
                tail = f.read()[-500:]
            services.unavailable(f"redis-server exited at start-up with TLS options (built without TLS?): {tail}")
        return redis

    def _config(self, redis, name, *, host="127.0.0.1", ca="ca", client_cert=False, password=None):
        tmp = os.path.abspath(self.mktemp())
        os.makedirs(tmp)
        path = os.path.join(tmp, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(
                f"server_name: tls.test\napp: {'event_persister' if name == 'w1' else 'cache_invalidator'}\n"
                f"instance_name: {name}\ninstance_map: {{w1: {{port: 1}}, reader: {{port: 2}}}}\n"
                f"stream_writers: {{events: [w1]}}\n"
            )
        tls = {"ca_file": self.tls[ca]}
        if client_cert:
            tls.update(cert_file=self.tls["client_cert"], key_file=self.tls["client_key"])
        redis_cfg = {"host": host, "port": redis.port, "tls": tls, "channel_prefix": self.prefix,
                     "connect_timeout_s": 5}
        if password:
            redis_cfg["password"] = password
        return load_config([path], {"data_dir": tmp, "replication": {"transport": "redis", "redis": redis_cfg}})

    def _transport(self, config, handler):
        t = RedisTransportService(config, handler, reactor)
        if isinstance(handler, ReplicationHandler):
            handler.set_transport(t)
        t.startService()
        self.addCleanup(t.stopService)
        return t

    @inlineCallbacks
    def _rows_flow(self, redis, **tls):
        """A writer and a reader over TLS: the writer's rows reach the reader through Redis."""
        gen = MultiWriterIdGenerator(EVENTS, "w1", 1, reactor)
        writer = ReplicationHandler("w1", reactor, streams=registry.streams(), sources={}, generators={"events": gen})
        reader = ReplicationHandler("reader", reactor, streams=registry.streams(), sources={"events": ListSource([])},
                                    initial_positions={"events": {"w1": 1}})
        applied = []
        reader.add_row_handler("events", lambda i, t, rows: applied.extend((t, r.event_id) for r in rows))
        wt = self._transport(self._config(redis, "w1", **tls), writer)
        rt = self._transport(self._config(redis, "reader", **tls), reader)
        yield wt.when_ready()
        yield rt.when_ready()
        self.assertIsNone(wt.endpoint, "the transport must build its own (TLS) endpoint")
        yield wait_until(lambda: ("events", "w1") in next(iter(reader._connected.values()), set()), 10,
                         "the writer's POSITION, over TLS")
        for i in range(2, 12):
            handle = gen.tracker.begin_fetch()
            gen.finish(handle, [i], {i: FactPayload((ev(i),), 0)}, True)
        yield wait_until(lambda: reader.position("events", "w1") == 11, 10, "the rows, over TLS")
        self.assertEqual(applied, [(i, f"$e{i}:hs") for i in range(2, 12)])
        self.assertGreater(wt.messages_published, 0)
        self.assertGreater(rt.messages_received, 0)
        self.assertTrue(wt.connected and rt.connected)
        self.assertNotIn(b"+PONG", plaintext_ping(redis.port), "the server answered plaintext")

    @inlineCallbacks
    def test_rows_over_tls(self):
        """With only the CA configured, two transports subscribe over TLS and a writer's RDATA/POSITION reach a reader."""
        redis = yield self._redis()
        yield self._rows_flow(redis)

    @inlineCallbacks
    def test_rows_over_mutual_tls_with_password(self):
        """With a client certificate and key (and a password), against a server requiring both, rows flow; the host name is checked too."""
        redis = yield self._redis(client_certs=True, password=PASSWORD)
        yield self._rows_flow(redis, host="localhost", client_cert=True, password=PASSWORD)

    @inlineCallbacks
    def _fails_with_retries(self, redis, config, expected):
        """A transport that cannot complete TLS logs ``expected``, keeps retrying with a growing delay, and stays up."""
        log = LogCapture(self, "synflow.replication.redis")
        t = self._transport(config, RecordingReceiver())
        ready = []
        t.when_ready().addBoth(ready.append)

        def failures():
            return [r for r in log.records if "TLS with Redis" in r.getMessage() and "subscribing" in r.getMessage()]

        yield wait_until(lambda: len(failures()) >= 3, 30, "three failed TLS attempts")
        first = failures()[0].getMessage()
        self.assertIn(f"TLS with Redis at 127.0.0.1:{redis.port} failed on the subscribing connection", first)
        self.assertIn(expected, first)
        self.assertIn("replication.redis.tls", first)
        self.assertIn("retrying", first)
        times = [r.created for r in failures()[:3]]
        gaps = [b - a for a, b in zip(times, times[1:])]
        self.assertGreater(gaps[0], 0.5, f"retried in a tight loop: {gaps}")
        self.assertGreater(gaps[1], gaps[0], f"the retry delay did not grow: {gaps}")
        self.assertFalse(t.connected)
        self.assertTrue(t.running)
        self.assertEqual(ready, [], "start-up was decided although Redis never answered")
        self.assertEqual([r.getMessage() for r in log.records if "refused" in r.getMessage()
                          or "password" in r.getMessage()], [], "a TLS failure was reported as a refused password")
        self.assertEqual(t.subscriptions, 0)

    @inlineCallbacks
    def test_untrusted_server_certificate(self):
        """A CA that did not sign the server's certificate: 'certificate verify failed' is logged, retried with backoff, not taken for a wrong password."""
        redis = yield self._redis(password=PASSWORD)
        yield self._fails_with_retries(redis, self._config(redis, "w1", ca="other_ca", password=PASSWORD),
                                       "certificate verify failed")

    @inlineCallbacks
    def test_missing_client_certificate(self):
        """A server requiring client certificates rejects a client without one (after the TLS 1.3 handshake): logged and retried."""
        redis = yield self._redis(client_certs=True, password=PASSWORD)
        yield self._fails_with_retries(redis, self._config(redis, "w1", password=PASSWORD), "certificate required")
