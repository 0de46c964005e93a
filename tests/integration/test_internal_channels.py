"""The default deployment's internal channels, attacked from a local process: the secret and the position check hold.

The five processes of ``workers/`` (on free ports) are started by
``synflowctl start`` with nothing about secrets in their config: the
deployment's secret is created under ``data_dir`` and every process reads
it. Then a local attacker tries the three attacks of the review: a raw line
on the hub without the secret, a forged ``POSITION`` from a connection that
has the secret, and ``persist_events`` over internal RPC without the bearer
token.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import yaml
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.http.rpc import PREFIX as RPC_PREFIX
from synflow.sharding import shard_for
from synflow.tools.client import Client, new_pool
from synflow.tools.deploy import DEFAULT_PORTS, free_port, make_deployment
from tests.cluster import ROOT, scrape_metrics, wait_until

PROCESSES = ("master", "cache_invalidator1", "federation_sender1", "persister1", "persister2")
WRITERS = ("persister1", "persister2")
FORGED = b"POSITION events persister1 100 999999999"
REFUSED = "synflow_replication_positions_refused_total"


def _view(port: int, writer: str) -> float:
    """One process's view of ``writer``'s events position, from its /metrics."""
    return scrape_metrics(port)[f'synflow_replication_stream_position{{instance="{writer}",stream="events"}}']


class DefaultDeploymentChannelsTest(TestCase):
    timeout = 400

    @inlineCallbacks
    def setUp(self):
        self.dir = os.path.abspath(self.mktemp())
        ports = {p: free_port() for p in DEFAULT_PORTS}
        make_deployment(self.dir, "localhost", ports)
        self.addCleanup(self.ctl, "stop")
        started = yield self.deferred_ctl("start")
        self.assertEqual(started.returncode, 0, started.stdout + started.stderr + self.logs())
        with open(os.path.join(self.dir, "shared.yaml"), encoding="utf-8") as f:
            shared = yaml.safe_load(f)
        self.assertNotIn("secret", json.dumps(shared.get("replication", {})))  # nothing configured by hand
        self.hub_port = shared["replication"]["hub"]["port"]
        self.internal = {name: shared["instance_map"][name]["port"] for name in PROCESSES}
        self.client_url = f"http://127.0.0.1:{ports[8008]}"
        self.secret_path = os.path.join(self.dir, "var", "replication.secret")
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "synflow.tools.ctl", *args, "."], cwd=self.dir,
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))

    def deferred_ctl(self, *args: str):
        from twisted.internet import reactor
        from twisted.internet.threads import deferToThreadPool

        return deferToThreadPool(reactor, reactor.getThreadPool(), self.ctl, *args)

    def logs(self) -> str:
        out = []
        for name in PROCESSES:
            path = os.path.join(self.dir, "var", "log", f"{name}.log")
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(out)

    def secret(self) -> str:
        with open(self.secret_path, encoding="utf-8") as f:
            return f.read().strip()

    def refused(self, name: str) -> float:
        return scrape_metrics(self.internal[name]).get(REFUSED, 0.0)

    @inlineCallbacks
    def test_secret_shared_and_forgeries_refused(self):
        """One default deployment: its secret is private and shared, and raw, forged and unauthenticated messages are refused.

        The four checks share the deployment, in an order where each leaves what
        the next asserts on untouched: :meth:`check_secret_created_private_and_shared`,
        :meth:`check_raw_hub_connection_without_secret_refused` (no reader has
        refused anything yet), :meth:`check_forged_position_with_secret_refused`
        (the writers' positions are still), then
        :meth:`check_rpc_without_bearer_token_is_401_and_persists_nothing`.
        """
        self.check_secret_created_private_and_shared()
        self.check_raw_hub_connection_without_secret_refused()
        yield self.check_forged_position_with_secret_refused()
        self.check_rpc_without_bearer_token_is_401_and_persists_nothing()

    def check_secret_created_private_and_shared(self):
        """synflowctl start created one 0600 secret under data_dir, and every process authenticated with it."""
        mode = stat.S_IMODE(os.stat(self.secret_path).st_mode)
        self.assertEqual(mode, 0o600)
        self.assertGreaterEqual(len(self.secret()), 40)
        for name in PROCESSES:  # healthy means connected to the hub, which needs the secret
            with urllib.request.urlopen(f"http://127.0.0.1:{self.internal[name]}/health", timeout=10) as r:
                self.assertEqual(r.status, 200, name)

    def check_raw_hub_connection_without_secret_refused(self):
        """A raw TCP line on the hub without AUTH gets an error and a close; the forged POSITION it carried moves nothing."""
        with socket.create_connection(("127.0.0.1", self.hub_port), timeout=10) as s:
            s.sendall(b"NAME intruder\n" + FORGED + b"\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        self.assertIn(b"ERROR authentication required: send AUTH <secret> first", data)
        self.assertNotIn(b"RDATA", data)
        for name in PROCESSES:
            for writer in WRITERS:
                self.assertLess(_view(self.internal[name], writer), 999_999_999, f"{name}'s view of {writer}")
            self.assertEqual(self.refused(name), 0.0, name)  # never got as far as the position check

    @inlineCallbacks
    def check_forged_position_with_secret_refused(self):
        """A forged POSITION from a connection holding the secret is refused by every reader, whose views stay put;
        sends afterwards are all seen in sync (no reader takes the real persister's rows for stale ones)."""
        before = {name: {w: _view(self.internal[name], w) for w in WRITERS} for name in PROCESSES}
        with socket.create_connection(("127.0.0.1", self.hub_port), timeout=10) as s:
            s.sendall(b"AUTH " + self.secret().encode() + b"\nNAME intruder\n" + FORGED + b"\n")
            readers = [n for n in PROCESSES if n != "persister1"]  # persister1 drops news about itself
            yield wait_until(lambda: all(self.refused(n) >= 1 for n in readers), 60, "every reader to refuse it")
            now = {name: {w: _view(self.internal[name], w) for w in WRITERS} for name in PROCESSES}
            self.assertEqual(now, before)
            s.settimeout(0.5)
            try:
                data = s.recv(65536)
            except TimeoutError:
                data = b"(open)"
            self.assertNotEqual(data, b"", "the hub closed an authenticated connection")

        alice = yield ensureDeferred(Client(self.client_url, self.pool).register(f"alice{uuid.uuid4().hex[:8]}"))
        rooms: dict[str, str] = {}
        while len(rooms) < len(WRITERS):
            room = yield ensureDeferred(alice.create_room())
            rooms.setdefault(shard_for(room, WRITERS), room)
        sent = set()
        for n in range(3):
            for room in rooms.values():
                result = yield ensureDeferred(alice.send(room, {"body": f"after the forgery {n}"}, f"t{n}{room}"))
                sent.add(result["event_id"])
        got: set[str] = set()
        since = None
        deadline = time.monotonic() + 60
        while not sent <= got and time.monotonic() < deadline:
            result = yield ensureDeferred(alice.sync(since=since, timeout_ms=1000))
            since = result["next_batch"]
            got |= {e["event_id"] for e in result["events"]}
        self.assertEqual(sent - got, set(), "messages sent after the forgery never reached a sync")
        for name in PROCESSES:
            for writer in WRITERS:
                self.assertLess(_view(self.internal[name], writer), 999_999_999, f"{name}'s view of {writer}")
        log = self.logs()
        self.assertIn("refused POSITION events persister1 100 999999999", log)

    def check_rpc_without_bearer_token_is_401_and_persists_nothing(self):
        """persist_events without the bearer token (or with a wrong one) is 401, closes the connection and persists
        nothing; the same request with the token persists its event."""
        room = next(r for r in (f"!r{n}:localhost" for n in range(1000)) if shard_for(r, WRITERS) == "persister1")
        event = {"room_id": room, "type": "m.room.create", "sender": "@mallory:localhost",
                 "content": {"creator": "@mallory:localhost"}, "state_key": "", "origin": "localhost"}
        url = f"http://127.0.0.1:{self.internal['persister1']}{RPC_PREFIX}/persist_events/"
        for n, authorization in enumerate((None, "Bearer wrong", "Bearer " + self.secret()[:-1])):
            code, headers, body = _post(url + f"nosecret{n}", {"args": {"events": [event]}}, authorization)
            self.assertEqual((code, body["errcode"]), (401, "M_UNAUTHORIZED"), authorization)
            self.assertEqual(headers.get("Connection"), "close")
        self.assertEqual(self.events_in(room), 0)
        code, _, body = _post(url + "withsecret", {"args": {"events": [event]}}, "Bearer " + self.secret())
        self.assertEqual(code, 200, body)
        self.assertEqual(self.events_in(room), 1)

    def events_in(self, room: str) -> int:
        import sqlite3

        conn = sqlite3.connect(os.path.join(self.dir, "var", "synflow.db"))
        try:
            return conn.execute("SELECT count(*) FROM events WHERE room_id = ?", (room,)).fetchone()[0]
        finally:
            conn.close()


def _post(url: str, body: dict, authorization: str | None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())
