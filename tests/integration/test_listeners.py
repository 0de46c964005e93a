"""The default deployment, started as an operator starts it: each listener answers only for what it names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from synflow.tools.deploy import (
    CLIENT_PORT,
    DEFAULT_PORTS,
    FEDERATION_PORT,
    free_port,
    make_deployment,
)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
#: Every process's metrics and health listener in workers/.
METRICS_PORTS = {"master": 9101, "persister1": 9102, "persister2": 9103, "federation_sender1": 9104,
                 "cache_invalidator1": 9105}
#: Every process's internal listener (instance_map) in workers/.
INTERNAL_PORTS = {"master": 9093, "persister1": 9094, "persister2": 9095, "federation_sender1": 9096,
                  "cache_invalidator1": 9097}
PEER = "peer.test"
NOT_FOUND = {"errcode": "M_UNRECOGNIZED", "error": "unrecognized request"}


def request(port: int, method: str, path: str, body: dict | None = None,
            secret: str | None = None) -> tuple[int, bytes]:
    """One HTTP request to a loopback port: ``(status, body)``, error statuses included.

    With ``secret``, it carries the deployment's bearer token (internal RPC needs it).
    """
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class DefaultListenersTest(SynchronousTestCase):
    """workers/ copied onto free ports (federating with one peer), started with synflowctl."""

    def setUp(self) -> None:
        self.ports = {p: free_port() for p in DEFAULT_PORTS}
        self.dir = os.path.abspath(self.mktemp())
        make_deployment(self.dir, "localhost", self.ports, peer=PEER, peer_url=f"http://127.0.0.1:{free_port()}")
        self.addCleanup(self.ctl, "stop")
        started = self.ctl("start")
        self.assertEqual(started.returncode, 0, started.stdout + started.stderr + self.logs())

    def ctl(self, command: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=ROOT)
        return subprocess.run([sys.executable, "-m", "synflow.tools.ctl", command, "."], cwd=self.dir, env=env,
                              capture_output=True, text=True, timeout=300)

    def logs(self) -> str:
        directory = os.path.join(self.dir, "var", "log")
        tails = []
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                tails.append(f"== {name}\n{f.read()[-2000:]}")
        return "\n".join(tails)

    def assertNotServed(self, port: int, method: str, path: str, body: dict | None = None) -> None:
        code, content = request(port, method, path, body)
        self.assertEqual((code, json.loads(content)), (404, NOT_FOUND), f"{method} {path} on port {port}")

    def test_each_listener_serves_what_it_lists(self):
        """The client listener answers 404 for /metrics, /health, /send and the key; the federation listener serves /send and the key and not the client API; metrics, health and RPC stay on their listeners."""
        client, federation = self.ports[CLIENT_PORT], self.ports[FEDERATION_PORT]
        transaction = {"origin": PEER, "origin_server_ts": 1, "pdus": [], "edus": []}
        send = "/_matrix/federation/v1/send/t1"

        # The public client listener: the client API and nothing else.
        code, content = request(client, "POST", "/_synflow/client/v1/register", {"username": "alice"})
        self.assertEqual(code, 200, content)
        token = json.loads(content)["access_token"]
        self.assertNotServed(client, "GET", "/metrics")
        self.assertNotServed(client, "GET", "/health")
        self.assertNotServed(client, "PUT", send, transaction)
        self.assertNotServed(client, "POST", "/_synflow/internal/queue_edus/t1", {"args": {"edus": []}})

        self.assertNotServed(client, "GET", "/_matrix/key/v2/server")

        # The federation listener: /send (behind the signature check: unsigned is 401) and the server's key,
        # and not the client API, metrics or health.
        code, content = request(federation, "PUT", send, transaction)
        self.assertEqual((code, json.loads(content)["errcode"]), (401, "M_UNAUTHORIZED"))
        code, content = request(federation, "GET", "/_matrix/key/v2/server")
        self.assertEqual((code, json.loads(content)["server_name"]), (200, "localhost"))
        self.assertNotServed(federation, "GET", f"/_synflow/client/v1/sync?access_token={token}")
        self.assertNotServed(federation, "POST", "/_synflow/client/v1/register", {"username": "bob"})
        self.assertNotServed(federation, "GET", "/metrics")
        self.assertNotServed(federation, "GET", "/health")

        # Every process's metrics listener serves /metrics and /health, and neither API.
        for name, port in METRICS_PORTS.items():
            code, content = request(self.ports[port], "GET", "/metrics")
            self.assertEqual(code, 200, name)
            self.assertIn(b"synflow_replication_stream_position", content)
            code, content = request(self.ports[port], "GET", "/health")
            self.assertEqual((code, json.loads(content)["status"]), (200, "ok"), name)
            self.assertNotServed(self.ports[port], "PUT", send, transaction)
            self.assertNotServed(self.ports[port], "POST", "/_synflow/client/v1/register", {"username": "carol"})
        # The internal listener keeps RPC, /health and /metrics (synflowctl and the other processes use it).
        for name, port in INTERNAL_PORTS.items():
            self.assertEqual(request(self.ports[port], "GET", "/health")[0], 200, name)
            self.assertEqual(request(self.ports[port], "GET", "/metrics")[0], 200, name)
            self.assertNotServed(self.ports[port], "POST", "/_synflow/client/v1/register", {"username": "dave"})
        # (Only internal RPC answers carry the positions the caller must wait for.)
        with open(os.path.join(self.dir, "var", "replication.secret"), encoding="utf-8") as f:
            secret = f.read().strip()  # the deployment's secret, created by synflowctl start
        code, content = request(self.ports[INTERNAL_PORTS["master"]], "POST", "/_synflow/internal/queue_edus/t1",
                                {"args": {"edus": "not a list"}}, secret)
        self.assertEqual(code, 400, content)
        self.assertIn("positions", json.loads(content))
