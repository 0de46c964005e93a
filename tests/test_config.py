"""Config loading: every invalid config stops start-up with one message naming file, key and problem."""

from __future__ import annotations

import os
import subprocess

from twisted.trial.unittest import SynchronousTestCase

from synflow.config import Transport, load_config
from synflow.errors import ConfigError
from tests.cluster import TWISTD

WORKERS = os.path.join(os.path.dirname(__file__), "..", "workers")

SHARED = """
server_name: example.com
instance_map:
  master: {host: 127.0.0.1, port: 9093}
  p1: {host: 127.0.0.1, port: 9094}
stream_writers: {events: [p1]}
"""
MASTER = """
app: master
instance_name: master
listeners: [{endpoint: "tcp:8008:interface=127.0.0.1", resources: [client, federation]}]
"""


class ConfigTest(SynchronousTestCase):
    def write(self, name: str, text: str) -> str:
        d = getattr(self, "_dir", None) or os.path.abspath(self.mktemp())
        self._dir = d
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def load(self, shared: str = SHARED, own: str = MASTER):
        return load_config([self.write("shared.yaml", shared), self.write("own.yaml", own)])

    def assertConfigError(self, file: str, key: str, fragment: str, shared: str = SHARED, own: str = MASTER):
        with self.assertRaises(ConfigError) as cm:
            self.load(shared, own)
        message = str(cm.exception)
        self.assertTrue(message.startswith(os.path.join(self._dir, file)), message)
        self.assertEqual(cm.exception.key, key, message)
        self.assertIn(fragment, message)
        return message

    def test_valid(self):
        """A valid pair of files loads, the second overriding the first."""
        config = self.load(SHARED + "replication: {transport: tcp}\n", MASTER + "replication: {transport: redis}\n")
        self.assertEqual(config.server_name, "example.com")
        self.assertIs(config.replication.transport, Transport.REDIS)
        self.assertEqual(config.replication.hub.port, 9092)
        self.assertEqual(config.listener("federation").endpoint, "tcp:8008:interface=127.0.0.1")

    def test_default_deployment_loads(self):
        """Every process file in workers/ loads with shared.yaml, alone and with the production overlay."""
        names = [n for n in os.listdir(WORKERS) if n not in ("shared.yaml", "production.yaml")]
        self.assertEqual(len(names), 5)
        for name in names:
            files = [os.path.join(WORKERS, "shared.yaml"), os.path.join(WORKERS, name)]
            self.assertEqual(load_config(files).server_name, "localhost")
            prod = load_config(files + [os.path.join(WORKERS, "production.yaml")])
            self.assertEqual(prod.database.engine, "postgres")

    def test_unknown_key(self):
        """An unknown key is named with the keys allowed there."""
        self.assertConfigError("own.yaml", "listners", "unknown key", own=MASTER + "listners: []\n")
        self.assertConfigError("shared.yaml", "replication.hubb", "unknown key", shared=SHARED + "replication: {hubb: 1}\n")

    def test_wrong_type(self):
        """A value of the wrong type is named with what was expected."""
        self.assertConfigError("shared.yaml", "replication.hub.port", "must be an integer",
                               shared=SHARED + "replication: {hub: {port: '9092'}}\n")
        self.assertConfigError("shared.yaml", "audit.enabled", "must be true or false", shared=SHARED + "audit: {enabled: yes please}\n")
        self.assertConfigError("shared.yaml", "stream_writers.events", "must be a list",
                               shared=SHARED.replace("[p1]", "p1"))

    def test_bad_enum(self):
        """An unknown transport or engine value lists the choices."""
        self.assertConfigError("shared.yaml", "replication.transport", "must be one of tcp, redis",
                               shared=SHARED + "replication: {transport: udp}\n")
        self.assertConfigError("shared.yaml", "database.engine", "must be one of sqlite, postgres",
                               shared=SHARED + "database: {engine: mysql}\n")

    def test_writer_missing_from_instance_map(self):
        """A stream writer without an instance_map entry is refused."""
        self.assertConfigError("shared.yaml", "stream_writers.events", "missing from instance_map",
                               shared=SHARED.replace("[p1]", "[p1, p2]"))

    def test_duplicate_port(self):
        """Two listeners of one process on the same port are refused."""
        own = MASTER.replace("resources: [client, federation]}]", "resources: [client, federation]},\n"
                             "            {endpoint: 'tcp:8008:interface=127.0.0.1', resources: [metrics]}]")
        self.assertConfigError("own.yaml", "listeners[1].endpoint", "port 8008 is already used", own=own)
        self.assertConfigError("shared.yaml", "replication.hub.port", "port 9093 is already used",
                               shared=SHARED + "replication: {hub: {port: 9093}}\n")

    def test_unknown_app(self):
        """An unknown app names the app types."""
        self.assertConfigError("own.yaml", "app", "expected one of master, event_persister",
                               own=MASTER.replace("app: master", "app: synchrotron"))

    def test_unreadable_secret_file(self):
        """A secret file that cannot be read is named."""
        self.assertConfigError("shared.yaml", "replication.secret_file", "cannot read secret file",
                               shared=SHARED + "replication: {secret_file: /nonexistent/secret}\n")

    def test_bad_yaml_and_missing_file(self):
        """Broken YAML names the line; a missing file is named."""
        with self.assertRaises(ConfigError) as cm:
            self.load(SHARED, "app: [master\n")
        self.assertIn("invalid YAML at line", str(cm.exception))
        with self.assertRaises(ConfigError) as cm:
            load_config(["/nonexistent/synflow.yaml"])
        self.assertIn("config file not found", str(cm.exception))

    def test_cross_field_rules(self):
        """A persister not listed as an events writer, or a misnamed master, is refused."""
        persister = "app: event_persister\ninstance_name: p9\n"
        self.assertConfigError("own.yaml", "instance_name", "not listed in stream_writers.events",
                               shared=SHARED.replace("p1: {", "p9: {host: 127.0.0.1, port: 9099}\n  p1: {"), own=persister)
        self.assertConfigError("own.yaml", "instance_name", "must be 'master'", own=MASTER.replace("instance_name: master", "instance_name: boss"))
        self.assertConfigError("shared.yaml", "federation.destinations.other.org", "http:// or https://",
                               shared=SHARED + "federation: {destinations: {other.org: 'ftp://x'}}\n")

    def test_twistd_prints_one_line(self):
        """twistd with a bad config exits non-zero with one clear line and no traceback."""
        shared = self.write("shared.yaml", SHARED + "replication: {transport: udp}\n")
        own = self.write("own.yaml", MASTER)
        result = subprocess.run([TWISTD, "-n", "--pidfile", "", "synflow", "--config", shared, "--config", own],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 78)
        self.assertIn("configuration error", result.stderr)
        self.assertIn("replication.transport", result.stderr)
        self.assertNotIn("Traceback", result.stderr + result.stdout)


class DocsTest(SynchronousTestCase):
    def test_every_key_documented(self):
        """Every config key appears in docs/configuration.md."""
        import typing

        import attrs

        from synflow.config import SynflowConfig

        with open(os.path.join(os.path.dirname(__file__), "..", "docs", "configuration.md")) as f:
            doc = f.read()
        missing = []

        def walk(cls, prefix=""):
            hints = typing.get_type_hints(cls)
            for field in attrs.fields(cls):
                if field.name == "files":
                    continue
                path = prefix + field.name
                tp = hints[field.name]
                inner = [a for a in typing.get_args(tp) if attrs.has(a)]
                if attrs.has(tp) or inner:
                    walk(tp if attrs.has(tp) else inner[0], path + ".")
                    if not (f"`{path}`" in doc or f"`{path}." in doc):
                        missing.append(path)
                    continue
                parent, _, leaf = path.rpartition(".")
                if f"`{path}`" not in doc and not (f"`{parent}" in doc and f".{leaf}`" in doc):
                    missing.append(path)

        walk(SynflowConfig)
        self.assertEqual(missing, [], missing)
