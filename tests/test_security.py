"""Security: loopback by default, the shared secret enforced on internal RPC and the hub, no secret in any output.

The first tests read the config defaults and the shipped deployment. The
others run real deployments (twistd processes) with ``replication.secret``
set -- on the TCP hub, and on a password-protected Redis of the test's own --
send messages through processes that do not own the room (so every send is
an internal RPC carrying the secret), check that calls without the secret
are refused, and then search everything the processes wrote (logs, captured
stdout/stderr, audit logs) for the secret and the Redis password.

Access tokens stored as hashes are tested in
``tests/http/test_client_api.py`` (``test_access_tokens_stored_hashed``).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import yaml
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.config import HostPort, ReplicationConfig, load_config
from synflow.http.rpc import PREFIX as RPC_PREFIX
from synflow.sharding import shard_for
from synflow.tools.client import Client, new_pool
from tests import services
from tests.cluster import ROOT, TWISTD, Cluster, free_port, wait_until

WRITERS = ("persister1", "persister2")
LOOPBACK = "interface=127.0.0.1"


class LoopbackDefaultsTest(SynchronousTestCase):
    """Internal listeners bind to loopback unless an address is configured."""

    def test_hostport_default(self) -> None:
        """An internal address without a host listens on 127.0.0.1 only."""
        self.assertEqual(HostPort(port=9093).server_endpoint(), f"tcp:9093:{LOOPBACK}")
        self.assertIn(LOOPBACK, ReplicationConfig().hub.server_endpoint())
        self.assertEqual(ReplicationConfig().hub.host, "127.0.0.1")

    def test_config_without_hosts(self) -> None:
        """A config giving only ports puts the hub and every internal listener on loopback."""
        path = self.mktemp() + ".yaml"
        with open(path, "w") as f:
            yaml.safe_dump({"server_name": "sec.test", "app": "master", "instance_name": "master",
                            "replication": {"hub": {"port": 9092}},
                            "instance_map": {"master": {"port": 9093}, "persister1": {"port": 9094}},
                            "stream_writers": {"events": ["persister1"]}}, f)
        config = load_config([path])
        self.assertEqual(config.replication.hub.server_endpoint(), f"tcp:9092:{LOOPBACK}")
        for name, address in config.instance_map.items():
            self.assertEqual(address.server_endpoint(), f"tcp:{address.port}:{LOOPBACK}", name)
        self.assertFalse(config.replication.allow_unauthenticated)

    def test_shipped_deployment_is_loopback(self) -> None:
        """Every address and listener in the shipped ``workers/`` deployment is on loopback."""
        files = sorted(glob.glob(os.path.join(ROOT, "workers", "*.yaml")))
        self.assertTrue(files)
        checked = 0
        for path in files:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
            hub = (data.get("replication") or {}).get("hub")
            for name, address in [("hub", hub), *(data.get("instance_map") or {}).items()]:
                if address is not None:
                    self.assertEqual(address.get("host", "127.0.0.1"), "127.0.0.1", f"{path}: {name}")
                    checked += 1
            for listener in data.get("listeners") or []:
                self.assertIn(LOOPBACK, listener["endpoint"], path)
                checked += 1
        self.assertGreater(checked, 5)


def _listening_addresses(pid: int) -> set[str]:
    """The ``ip:port`` of every TCP socket process ``pid`` listens on (from ``/proc``)."""
    inodes = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table, encoding="ascii") as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                host_hex, port_hex = local.split(":")
                if width == 8:
                    host = socket.inet_ntoa(bytes.fromhex(host_hex)[::-1])
                else:
                    raw = bytes.fromhex(host_hex)
                    host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                found.add(f"{host}:{int(port_hex, 16)}")
    return found


def _post(url: str, body: dict, authorization: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _hub_reply(port: int, lines: list[bytes]) -> bytes:
    """Connect to the hub as a client, send ``lines``, and return everything it writes until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"".join(line + b"\n" for line in lines))
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk


def _redis(port: int, *commands: bytes) -> bytes:
    """Send inline commands to the Redis on ``port`` and return the raw replies."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"".join(c + b"\r\n" for c in commands))
        s.settimeout(0.5)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except TimeoutError:
            pass
    return data


class SecretDeploymentMixin:
    """A master and two persisters with ``replication.secret`` set, and messages sent through non-owners."""

    transport = "tcp"
    timeout = 300

    @inlineCallbacks
    def start(self, shared: dict | None = None):
        self.secret = "repl-secret-" + uuid.uuid4().hex
        self.cluster = c = Cluster(self, transport=self.transport, writers=WRITERS, secret=self.secret,
                                   shared=shared or {})
        self.client_ports = {"master": free_port(), "persister2": free_port()}
        yield c.start_master(listeners=[
            {"resources": ["client"], "endpoint": f"tcp:{self.client_ports['master']}:interface=127.0.0.1"}])
        c.start_twistd("persister1", "event_persister")
        c.start_twistd("persister2", "event_persister", listeners=[
            {"resources": ["client"], "endpoint": f"tcp:{self.client_ports['persister2']}:interface=127.0.0.1"}])
        for name in WRITERS:
            yield c.wait_for_port(c.instance_ports[name], name)
        yield wait_until(lambda: all(c.healthy(n) for n in c.procs), 60, "every process to be healthy")
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.client_ports[name]}"

    async def send_through_non_owners(self, rounds: int) -> int:
        """Create a room per persister and send into each through every process that does not own it.

        Every send is an internal RPC to the room's persister; the members'
        syncs must return every message. Returns how many were sent.
        """
        alice = await Client(self.url("master"), self.pool).register(f"alice{uuid.uuid4().hex[:8]}")
        rooms: dict[str, str] = {}
        while len(rooms) < len(WRITERS):
            room = await alice.create_room()
            rooms.setdefault(shard_for(room, WRITERS), room)
        sent = []
        for n in range(rounds):
            for owner, room in rooms.items():
                # The master owns no room; persister2 does not own persister1's.
                via = ["master"] + (["persister2"] if owner != "persister2" else [])
                for name in via:
                    result = await alice.at(self.url(name)).send(room, {"body": f"{n} via {name}"}, f"t{n}{name}{owner}")
                    sent.append(result["event_id"])
        got = set()
        since = None
        deadline = time.monotonic() + 30
        while not set(sent) <= got and time.monotonic() < deadline:
            result = await alice.at(self.url("persister2")).sync(since=since, timeout_ms=1000)
            since = result["next_batch"]
            got |= {e["event_id"] for e in result["events"]}
        self.assertEqual(set(sent) - got, set(), "messages sent through non-owners never reached a sync")
        return len(sent)

    def rpc_served(self) -> float:
        """``persist_events`` / ``send_event`` calls the persisters served successfully."""
        total = 0.0
        for name in WRITERS:
            for key, value in self.cluster.metrics(name).items():
                if key.startswith("synflow_rpc_served_total{") and 'outcome="unauthorized"' not in key:
                    total += value
        return total

    def assert_no_secret_written(self, *secrets: str) -> None:
        """No file the deployment's processes wrote (logs, stdout/stderr, audit) contains any of ``secrets``."""
        searched = 0
        for path in glob.glob(os.path.join(self.cluster.dir, "**", "*"), recursive=True):
            if not os.path.isfile(path) or path.endswith(".yaml") or os.path.basename(path).startswith("synflow.db"):
                continue  # the config files carry the secrets on purpose; the database holds no text logs
            with open(path, "rb") as f:
                data = f.read()
            searched += len(data)
            for secret in secrets:
                self.assertNotIn(secret.encode(), data, f"{os.path.relpath(path, self.cluster.dir)} contains a secret")
        self.assertGreater(searched, 10_000)
        # The search would find them: the config written for the processes holds each one.
        with open(self.cluster.shared_path, encoding="utf-8") as f:
            shared = f.read()
        for secret in secrets:
            self.assertIn(secret, shared)


class SecretOnTcpHubTest(SecretDeploymentMixin, TestCase):
    @inlineCallbacks
    def test_rpc_and_hub_require_the_secret(self):
        """With a secret, sends through non-owning processes work (RPC with the secret), RPC without it is 401,
        the hub closes a client that does not AUTH first or gives a wrong secret, and no output holds the secret."""
        yield self.start()
        before = self.rpc_served()
        sent = yield ensureDeferred(self.send_through_non_owners(rounds=3))
        self.assertGreaterEqual(self.rpc_served() - before, sent)

        url = f"http://127.0.0.1:{self.cluster.instance_ports['persister1']}{RPC_PREFIX}/persist_events/sec1"
        for authorization in (None, "Bearer wrong", "Bearer " + self.secret[:-1], "Basic " + self.secret):
            code, body = _post(url, {"args": {"events": []}}, authorization)
            self.assertEqual((code, body["errcode"]), (401, "M_UNAUTHORIZED"), authorization)
        unauthorized = self.cluster.metrics("persister1")[
            'synflow_rpc_served_total{name="persist_events",outcome="unauthorized"}']
        self.assertEqual(unauthorized, 4)

        hub = self.cluster.hub_port
        self.assertIn(b"ERROR authentication required", _hub_reply(hub, [b"NAME intruder", b"REPLICATE"]))
        self.assertIn(b"ERROR authentication failed", _hub_reply(hub, [b"AUTH wrong", b"NAME intruder"]))
        self.cluster.check_alive()

        listening = {n: _listening_addresses(p.pid) for n, p in self.cluster.procs.items()}
        for name, addresses in listening.items():
            self.assertTrue(addresses, name)
            for address in addresses:
                self.assertTrue(address.startswith("127.0.0.1:"), f"{name} listens on {address}")
        for name in ("persister1", "persister2", "master"):
            yield self.cluster.stop(name)
        self.assert_no_secret_written(self.secret)


class SecretOnRedisTest(SecretDeploymentMixin, TestCase):
    transport = "redis"

    @inlineCallbacks
    def test_no_secret_or_redis_password_in_output(self):
        """On a password-protected Redis, through a reconnect and a refused start-up with a wrong password,
        neither the replication secret nor the Redis password appears in anything the processes wrote."""
        password = "redis-pw-" + uuid.uuid4().hex
        redis = services.PrivateRedis(self, free_port(), ("--requirepass", password))
        redis.start()
        yield wait_until(redis.up, 20, "the password-protected redis-server")
        yield self.start({"replication": {"redis": {"port": redis.port, "password": password}}})
        before = self.rpc_served()
        sent = yield ensureDeferred(self.send_through_non_owners(rounds=2))
        self.assertGreaterEqual(self.rpc_served() - before, sent)

        # Drop every connection: each process reconnects (and authenticates) again.
        replies = _redis(redis.port, b"AUTH " + password.encode(), b"CLIENT KILL TYPE pubsub",
                         b"CLIENT KILL TYPE normal SKIPME yes")
        self.assertTrue(replies.startswith(b"+OK"), replies)
        for name in ("master", *WRITERS):
            yield wait_until(lambda n=name: self.cluster.log_tail(n, 500_000).count("subscribed to Redis channel") >= 2,
                             60, f"{name} to subscribe again")
        yield ensureDeferred(self.send_through_non_owners(rounds=1))

        for name in ("persister1", "persister2", "master"):
            yield self.cluster.stop(name)

        # A process given a wrong password refuses to start, naming the setting, not the value.
        wrong = "wrong-pw-" + uuid.uuid4().hex
        own = self.cluster.process_config("intruder", "master", instance_name="master",
                                          replication={"redis": {"password": wrong}})
        result = subprocess.run(
            [TWISTD, "-n", "--pidfile", "", "--logfile", self.cluster.log_path("intruder"), "synflow",
             "--config", self.cluster.shared_path, "--config", own],
            capture_output=True, text=True, timeout=60, cwd=self.cluster.dir,
        )
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("replication.redis.password", result.stderr)
        for text in (result.stdout, result.stderr):
            self.assertNotIn(wrong, text)
            self.assertNotIn(password, text)
        self.assert_no_secret_written(self.secret, password)
        self.assert_no_secret_written_by("intruder", wrong)

    def assert_no_secret_written_by(self, name: str, secret: str) -> None:
        """``name``'s log does not contain ``secret`` (its config file does)."""
        self.assertNotIn(secret, self.cluster.log_tail(name, 10_000_000))
        with open(os.path.join(self.cluster.dir, f"{name}.yaml"), encoding="utf-8") as f:
            self.assertIn(secret, f.read())
