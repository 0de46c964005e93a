"""Listeners serve exactly the resources they name: config rules, the implied listeners, and a process's sites."""

from __future__ import annotations

import os

import treq
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.app.build import build_service
from synflow.config import RESOURCES, load_config
from synflow.errors import ConfigError
from synflow.listeners import INTERNAL_RESOURCES, effective_listeners, hub_endpoint, serving
from synflow.tools import ctl
from tests.cluster import free_port
from tests.test_config import SHARED, WORKERS

MASTER = "app: master\ninstance_name: master\n"
PERSISTER = "app: event_persister\ninstance_name: p1\n"


def _listeners(*entries: tuple[str, str]) -> str:
    """A ``listeners:`` YAML list of ``(endpoint, resources)`` pairs."""
    items = ", ".join(f"{{endpoint: '{endpoint}', resources: [{resources}]}}" for endpoint, resources in entries)
    return f"listeners: [{items}]\n"


def write_files(testcase: SynchronousTestCase, files: dict[str, str]) -> list[str]:
    """Write ``files`` (name -> text) into a new directory; return their paths in order."""
    directory = os.path.abspath(testcase.mktemp())
    os.makedirs(directory)
    paths = []
    for name, text in files.items():
        paths.append(os.path.join(directory, name))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.write(text)
    return paths


class ResourceRulesTest(SynchronousTestCase):
    """The config rules of ``listeners``: every mistake is one line naming the file, the key and the problem."""

    def load(self, own: str, shared: str = SHARED):
        paths = write_files(self, {"shared.yaml": shared, "own.yaml": own})
        self.own_path = paths[1]
        return load_config(paths)

    def assertRefused(self, own: str, key: str, fragment: str, shared: str = SHARED) -> str:
        with self.assertRaises(ConfigError) as cm:
            self.load(own, shared)
        message = str(cm.exception)
        self.assertTrue(message.startswith(f"{self.own_path}: {key}: "), message)
        self.assertEqual(cm.exception.key, key)
        self.assertIn(fragment, message)
        self.assertNotIn("\n", message)
        return message

    def test_unknown_resource_lists_valid_ones(self):
        """An unknown resource name is refused, naming its position in the list and every valid name."""
        message = self.assertRefused(MASTER + _listeners(("tcp:8008:interface=127.0.0.1", "client, admin")),
                                     "listeners[0].resources[1]", "got 'admin'")
        for name in RESOURCES:
            self.assertIn(name, message)
        self.assertEqual(set(RESOURCES), {"client", "federation", "metrics", "health", "replication", "rpc"})

    def test_every_http_resource_accepted(self):
        """Every resource but replication can share one listener; the configured listener is what serves them."""
        config = self.load(MASTER + _listeners(("tcp:8008:interface=127.0.0.1", "client, federation, metrics, health")))
        for resource in ("client", "federation", "metrics", "health"):
            self.assertEqual(serving(config, resource).endpoint, "tcp:8008:interface=127.0.0.1")

    def test_empty_and_repeated(self):
        """A listener naming nothing, or a resource twice, is refused."""
        self.assertRefused(MASTER + _listeners(("tcp:8008", "")), "listeners[0].resources", "lists nothing to serve")
        self.assertRefused(MASTER + _listeners(("tcp:8008", "client, client")), "listeners[0].resources",
                           "names a resource twice")

    def test_one_listener_per_resource(self):
        """Two configured listeners serving one resource are refused."""
        self.assertRefused(MASTER + _listeners(("tcp:8008", "client"), ("tcp:8009", "client, metrics")),
                           "listeners", "more than one listener serves 'client'")

    def test_replication_rules(self):
        """replication is the master's TCP hub: alone on its listener, on replication.hub.port, never on a worker or with Redis."""
        self.assertRefused(MASTER + _listeners(("tcp:9092", "replication, metrics")), "listeners[0].resources",
                           "needs a listener of its own")
        self.assertRefused(MASTER + _listeners(("tcp:9099", "replication")), "listeners[0].endpoint",
                           "must listen on replication.hub.port (9092)")
        self.assertRefused(PERSISTER + _listeners(("tcp:9092", "replication")), "listeners[0].resources",
                           "only the master serves 'replication'")
        self.assertRefused(MASTER + "replication: {transport: redis}\n" + _listeners(("tcp:9092", "replication")),
                           "listeners[0].resources", "only with replication.transport: tcp")

    def test_rpc_rules(self):
        """rpc is served where the other processes call it: the process's instance_map port."""
        self.assertRefused(PERSISTER + _listeners(("tcp:9999:interface=127.0.0.1", "rpc")), "listeners[0].endpoint",
                           "must listen on instance_map.p1.port (9094)")
        shared = SHARED.replace("  master: {host: 127.0.0.1, port: 9093}\n", "")
        self.assertRefused(MASTER + _listeners(("tcp:9093", "rpc")), "listeners[0].resources",
                           "add 'master' to instance_map", shared=shared)

    def test_existing_configs_stay_valid(self):
        """Configs written for the old three resources (client, federation, metrics) still load, and every file in workers/ does."""
        config = self.load(MASTER + _listeners(("tcp:8008:interface=127.0.0.1", "client, federation"),
                                               ("tcp:9101:interface=127.0.0.1", "metrics")))
        self.assertEqual(serving(config, "federation").endpoint, "tcp:8008:interface=127.0.0.1")
        for name in os.listdir(WORKERS):
            if name not in ("shared.yaml", "production.yaml"):
                load_config([os.path.join(WORKERS, "shared.yaml"), os.path.join(WORKERS, name)])


class ImpliedListenersTest(SynchronousTestCase):
    """The internal listener and the hub, and the configured listeners that replace them."""

    def load(self, own: str):
        return load_config(write_files(self, {"shared.yaml": SHARED, "own.yaml": own}))

    def test_default_master(self):
        """workers/master.yaml opens client, federation, metrics+health, the internal listener and the hub, each on its own port."""
        config = load_config([os.path.join(WORKERS, "shared.yaml"), os.path.join(WORKERS, "master.yaml")])
        served = [(listener.name, listener.endpoint, listener.resources) for listener in effective_listeners(config)]
        self.assertEqual(served, [
            ("client", "tcp:8008:interface=127.0.0.1", ("client",)),
            ("federation", "tcp:8448:interface=127.0.0.1", ("federation",)),
            ("metrics+health", "tcp:9101:interface=127.0.0.1", ("metrics", "health")),
            ("internal", "tcp:9093:interface=127.0.0.1", INTERNAL_RESOURCES),
            ("hub", "tcp:9092:interface=127.0.0.1", ("replication",)),
        ])
        self.assertEqual(set(INTERNAL_RESOURCES), {"rpc", "health", "metrics"})

    def test_worker_has_no_hub(self):
        """A worker has its configured listeners and its internal listener, no hub."""
        config = load_config([os.path.join(WORKERS, "shared.yaml"), os.path.join(WORKERS, "persister1.yaml")])
        self.assertEqual([listener.name for listener in effective_listeners(config)], ["metrics+health", "internal"])
        self.assertIsNone(serving(config, "replication"))
        self.assertIsNone(serving(config, "client"))

    def test_configured_rpc_replaces_internal(self):
        """A configured rpc listener on the instance_map port is the internal listener and serves only what it lists."""
        config = self.load(PERSISTER + _listeners(("tcp:9094:interface=0.0.0.0", "rpc"),
                                                  ("tcp:9102:interface=127.0.0.1", "health")))
        served = effective_listeners(config)
        self.assertEqual([(listener.name, listener.resources) for listener in served],
                         [("rpc", ("rpc",)), ("health", ("health",))])
        self.assertIsNone(serving(config, "metrics"))

    def test_configured_replication_replaces_hub(self):
        """A configured replication listener is where the hub listens (another interface, the same port)."""
        config = self.load(MASTER + _listeners(("tcp:9092:interface=0.0.0.0", "replication")))
        self.assertEqual([listener.name for listener in effective_listeners(config)], ["replication", "internal"])
        self.assertEqual(hub_endpoint(config), "tcp:9092:interface=0.0.0.0")

    def test_ctl_urls_follow_the_listeners(self):
        """synflowctl reads /health and /metrics where the process serves them."""
        paths = write_files(self, {
            "shared.yaml": SHARED + "replication: {hub: {port: 9092}}\n",
            "master.yaml": MASTER,
            "p1.yaml": PERSISTER + _listeners(("tcp:9094:interface=127.0.0.1", "rpc"),
                                              ("tcp:9102:interface=127.0.0.1", "health, metrics")),
        })
        directory = os.path.dirname(paths[0])
        procs = {proc.name: proc for proc in ctl.discover(directory, [])}
        self.assertEqual(procs["master"].health_url, "http://127.0.0.1:9093/health")
        self.assertEqual(procs["master"].metrics_url, "http://127.0.0.1:9093/metrics")
        self.assertEqual(procs["p1"].health_url, "http://127.0.0.1:9102/health")
        self.assertEqual(procs["p1"].metrics_url, "http://127.0.0.1:9102/metrics")


class ProcessSitesTest(TestCase):
    """An in-process master with one listener per resource: each answers only for what it names."""

    timeout = 60

    @inlineCallbacks
    def setUp(self):
        base = os.path.abspath(self.mktemp())
        os.makedirs(base)
        self.ports = {name: free_port() for name in ("client", "federation", "metrics", "health", "internal")}
        path = os.path.join(base, "master.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                f"server_name: sites.test\napp: master\ninstance_name: master\ndata_dir: {base}/var\n"
                f"instance_map: {{master: {{host: 127.0.0.1, port: {self.ports['internal']}}}}}\n"
                "stream_writers: {events: [master]}\nreplication: {hub: {host: 127.0.0.1, port: 0}}\n"
                "federation: {destinations: {peer.test: 'http://127.0.0.1:1'}}\n"
                + _listeners(*((f"tcp:{self.ports[r]}:interface=127.0.0.1", r)
                               for r in ("client", "federation", "metrics", "health")))
            )
        self.master = build_service(load_config([path]), reactor, exit_on_failure=False)
        self.master.startService()
        self.addCleanup(self.master.stopService)
        yield self.master.ready
        for service in self.master.listeners.values():
            yield service.when_listening()

    @inlineCallbacks
    def code(self, listener: str, method: str, path: str, body: bytes = b""):
        response = yield treq.request(method, f"http://127.0.0.1:{self.ports[listener]}{path}", data=body or None,
                                      persistent=False)
        yield response.content()
        return response.code

    @inlineCallbacks
    def test_each_listener_serves_only_its_resource(self):
        """/metrics, /health, the client API, /send and RPC each answer on their own listener and 404 everywhere else."""
        send = ("PUT", "/_matrix/federation/v1/send/t1",
                b'{"origin": "peer.test", "origin_server_ts": 1, "pdus": [], "edus": []}')
        requests = {
            "metrics": ("GET", "/metrics", b""),
            "health": ("GET", "/health", b""),
            "client": ("POST", "/_synflow/client/v1/register", b'{"username": "alice"}'),
            "federation": send,
            "rpc": ("POST", "/_synflow/internal/queue_edus/t1", b'{"args": {"edus": []}}'),
        }
        home = {"metrics": {"metrics", "internal"}, "health": {"health", "internal"}, "client": {"client"},
                "federation": {"federation"}, "rpc": {"internal"}}
        for resource, (method, path, body) in requests.items():
            for listener in self.ports:
                code = yield self.code(listener, method, path, body)
                if listener in home[resource]:
                    self.assertNotEqual(code, 404, f"{resource} on the {listener} listener")
                else:
                    self.assertEqual(code, 404, f"{resource} on the {listener} listener")
