"""Config loading: every invalid config stops start-up with one message naming file, key and problem."""

from __future__ import annotations

import importlib.util
import os
import subprocess

from twisted.trial.unittest import SynchronousTestCase

from synflow.config import Transport, listener_port, load_config
from synflow.errors import ConfigError
from synflow.streams import EVENTS
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


class _ConfigFiles(SynchronousTestCase):
    """Writes config files into the test's directory and loads them."""

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


class ConfigTest(_ConfigFiles):
    def test_valid(self):
        """A valid pair of files loads, the second overriding the first."""
        config = self.load(SHARED + "replication: {transport: tcp}\n", MASTER + "replication: {transport: redis}\n")
        self.assertEqual(config.server_name, "example.com")
        self.assertIs(config.replication.transport, Transport.REDIS)
        self.assertEqual(config.replication.hub.port, 9092)
        self.assertEqual(config.listener("federation").endpoint, "tcp:8008:interface=127.0.0.1")

    def test_default_deployment_loads(self):
        """Every process file in workers/ loads with shared.yaml, alone and with the production overlay."""
        run_from_operator_directory(self)
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
        """An unknown app lists the worker types installed."""
        self.assertConfigError("own.yaml", "app", "available: cache_invalidator, event_persister, federation_sender, master",
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
        """A persister missing from instance_map, or a misnamed master, is refused; an unlisted persister may
        run (``events`` reshards: it owns no rooms until ``synflowctl reshard --add`` moves some to it)."""
        persister = "app: event_persister\ninstance_name: p9\n"
        self.assertConfigError("shared.yaml", "instance_map", "missing from instance_map", own=persister)
        config = self.load(SHARED.replace("p1: {", "p9: {host: 127.0.0.1, port: 9099}\n  p1: {"), persister)
        self.assertEqual(config.instance_name, "p9")
        self.assertNotIn("p9", config.writers_of(EVENTS))
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

    def test_federation_ranges(self):
        """Each out-of-range federation timer or backoff value is refused, naming its file and key."""
        cases = [
            ("backoff: {multiplier: 0.5}", "federation.backoff.multiplier", "must be at least 1"),
            ("backoff: {initial_s: 0}", "federation.backoff.initial_s", "must be greater than 0"),
            ("backoff: {initial_s: -1}", "federation.backoff.initial_s", "must be greater than 0"),
            ("backoff: {max_s: 0}", "federation.backoff.max_s", "must be greater than 0"),
            ("backoff: {initial_s: 20, max_s: 10}", "federation.backoff.max_s", "must be at least federation.backoff.initial_s"),
            ("backoff: {jitter: 1.5}", "federation.backoff.jitter", "must be in [0, 1)"),
            ("catch_up_after_s: 0", "federation.catch_up_after_s", "must be greater than 0"),
            ("wakeup_interval_s: -5", "federation.wakeup_interval_s", "must be greater than 0"),
            ("request_timeout_s: 0", "federation.request_timeout_s", "must be greater than 0"),
            ("request_timeout_s: .nan", "federation.request_timeout_s", "must be greater than 0"),
            ("catch_up_max_events: -1", "federation.catch_up_max_events", "must be in [0, 1000000]"),
            ("catch_up_max_events: 1000001", "federation.catch_up_max_events", "must be in [0, 1000000]"),
        ]
        for federation, key, fragment in cases:
            self.assertConfigError("shared.yaml", key, fragment, shared=SHARED + f"federation: {{{federation}}}\n")
        # The same value in the process file is named there.
        self.assertConfigError("own.yaml", "federation.backoff.multiplier", "must be at least 1",
                               own=MASTER + "federation: {backoff: {multiplier: 0}}\n")
        # The edges are accepted: a fixed interval, initial == max, no jitter.
        config = self.load(SHARED + "federation: {backoff: {multiplier: 1, initial_s: 5, max_s: 5, jitter: 0}}\n")
        self.assertEqual((config.federation.backoff.multiplier, config.federation.backoff.max_s), (1.0, 5.0))

    def test_federation_trust_keys(self):
        """Bad trusted_keys and ip_range_blacklist entries are refused, naming the key; good ones load."""
        key = "l8Hft5qXKn1vfHrg3p4+W8gELQVo8N13JkluMfmn2sQ"
        cases = [
            ("trusted_keys: {b.test: {'ed25519:k': AAAA}}", "federation.trusted_keys.b.test.ed25519:k",
             "32-byte ed25519 public key"),
            (f"trusted_keys: {{b.test: {{'rsa:k': {key}}}}}", "federation.trusted_keys.b.test.rsa:k",
             "ed25519:<version>"),
            ("trusted_keys: {b.test: {}}", "federation.trusted_keys.b.test", "lists no key"),
            ("ip_range_blacklist: [10.0.0.0/8, nope]", "federation.ip_range_blacklist[1]", "'nope' is not an IP range"),
        ]
        for federation, key_path, fragment in cases:
            self.assertConfigError("shared.yaml", key_path, fragment, shared=SHARED + f"federation: {{{federation}}}\n")
        config = self.load(SHARED + f"federation: {{trusted_keys: {{b.test: {{'ed25519:k': {key}}}}}, "
                                    "ip_range_blacklist: ['10.0.0.0/8', 'fc00::/7']}\n")
        self.assertEqual(config.federation.trusted_keys, {"b.test": {"ed25519:k": key}})
        self.assertEqual(config.federation.ip_range_blacklist, ["10.0.0.0/8", "fc00::/7"])

    def test_signing_key_file(self):
        """The signing key lives at <data_dir>/signing.key unless signing_key_path says otherwise."""
        config = self.load()
        self.assertEqual(config.signing_key_file, os.path.join(config.data_dir, "signing.key"))
        self.assertEqual(self.load(SHARED + "signing_key_path: /k/my.key\n").signing_key_file, "/k/my.key")

    def test_audit_retention_and_rate_limit_ranges(self):
        """Retention sizes, rate limits and database.synchronous are checked, naming file and key."""
        cases = [
            ("audit: {retain_bytes: 0}", "audit.retain_bytes", "must be greater than 0"),
            ("audit: {retain_days: -1}", "audit.retain_days", "must be greater than 0"),
            ("limits: {sync_rate_limit_per_s: 0}", "limits.sync_rate_limit_per_s", "must be greater than 0"),
            ("limits: {rate_limit_burst: 0}", "limits.rate_limit_burst", "must be greater than 0"),
            ("database: {synchronous: 'off'}", "database.synchronous", "must be one of full, normal"),
        ]
        for yaml_text, key, fragment in cases:
            self.assertConfigError("shared.yaml", key, fragment, shared=SHARED + yaml_text + "\n")
        config = self.load(SHARED + "audit: {retain_bytes: null, retain_days: 7}\n"
                           "limits: {rate_limit_per_s: null, sync_rate_limit_per_s: null}\n")
        self.assertEqual((config.audit.retain_bytes, config.audit.retain_days), (None, 7.0))
        self.assertEqual((config.limits.rate_limit_per_s, config.limits.sync_rate_limit_per_s), (None, None))
        default = self.load(SHARED)
        self.assertEqual((default.database.synchronous, default.limits.sync_rate_limit_per_s), ("full", 50.0))

    def test_database_values_checked_at_load(self):
        """The storage layer's checks of database: run when the config loads, naming the file and database.<key>."""
        cases = [
            ("database: {cp_max: 0}", "database.cp_max", "must be at least cp_min (1), got 0"),
            ("database: {cp_min: 0}", "database.cp_min", "must be at least 1, got 0"),
            ("database: {engine: postgres, port: 70000}", "database.port", "must be a TCP port number"),
            ("database: {connect_timeout_s: 0}", "database.connect_timeout_s", "must be positive"),
            ("database: {path: ':memory:', cp_max: 2}", "database.path", "in-memory SQLite database"),
        ]
        for yaml_text, key, fragment in cases:
            self.assertConfigError("shared.yaml", key, fragment, shared=SHARED + yaml_text + "\n")
        message = self.assertConfigError("own.yaml", "database.cp_max", "got 0",
                                         own=MASTER + "database: {cp_max: 0}\n")
        self.assertIn("own.yaml: database.cp_max: ", message)
        self.assertEqual(self.load(SHARED + "database: {cp_max: 1}\n").database_config().cp_max, 1)

    def test_federation_defaults(self):
        """Without a federation section the documented defaults apply."""
        federation = self.load().federation
        self.assertEqual((federation.catch_up_after_s, federation.wakeup_interval_s, federation.request_timeout_s),
                         (3600.0, 60.0, 30.0))
        backoff = federation.backoff
        self.assertEqual((backoff.initial_s, backoff.multiplier, backoff.max_s, backoff.jitter), (10.0, 2.0, 86400.0, 0.2))
        self.assertEqual(federation.destinations, {})
        self.assertEqual(federation.catch_up_max_events, 10_000)
        self.assertEqual((federation.trusted_keys, federation.ip_range_blacklist), ({}, None))


def run_from_operator_directory(testcase: SynchronousTestCase) -> str:
    """Work in a fresh directory holding ``var/redis.password`` (0600), as an operator runs production.yaml from.

    The overlay's ``password_file`` is relative to the working directory, like
    ``data_dir``. Returns the directory; the old working directory comes back
    after the test.
    """
    directory = os.path.abspath(testcase.mktemp())
    os.makedirs(os.path.join(directory, "var"))
    fd = os.open(os.path.join(directory, "var", "redis.password"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("a-redis-password\n")
    testcase.addCleanup(os.chdir, os.getcwd())
    os.chdir(directory)
    return directory


def _workers_config(name: str, *extra: str, overrides: dict | None = None):
    files = [os.path.join(WORKERS, "shared.yaml"), os.path.join(WORKERS, f"{name}.yaml"), *extra]
    return load_config(files, overrides)


def _is_loopback(endpoint: str) -> bool:
    return endpoint.startswith("tcp:") and "interface=127.0.0.1" in endpoint.split(":")


class DefaultDeploymentTest(SynchronousTestCase):
    """The documented defaults of the deployment in workers/."""

    PROCESSES = ("master", "persister1", "persister2", "federation_sender1", "cache_invalidator1")

    def test_addresses(self):
        """Server localhost; the master serves the client API alone on 127.0.0.1:8008 and federation alone on 127.0.0.1:8448; the hub is 127.0.0.1:9092; everything else is on loopback."""
        for name in self.PROCESSES:
            config = _workers_config(name)
            self.assertEqual(config.server_name, "localhost")
            self.assertEqual((config.replication.hub.host, config.replication.hub.port), ("127.0.0.1", 9092))
            self.assertIs(config.replication.transport, Transport.TCP)
            self.assertEqual(config.database.engine, "sqlite")
            self.assertEqual(set(config.instance_map), set(self.PROCESSES))
            for address in config.instance_map.values():
                self.assertEqual(address.host, "127.0.0.1")
            metrics = config.listener("metrics")
            self.assertIsNotNone(metrics, name)
            self.assertTrue(_is_loopback(metrics.endpoint), metrics.endpoint)
            for listener in config.listeners:
                self.assertTrue(_is_loopback(listener.endpoint), listener.endpoint)
            if name != "master":
                self.assertIsNone(config.listener("client"), name)
        master = _workers_config("master")
        self.assertEqual(master.listener("client").endpoint, "tcp:8008:interface=127.0.0.1")
        self.assertEqual(master.listener("client").resources, ["client"])
        self.assertEqual(master.listener("federation").endpoint, "tcp:8448:interface=127.0.0.1")
        self.assertEqual(master.listener("federation").resources, ["federation"])
        self.assertEqual(master.writers_of(EVENTS), ["persister1", "persister2"])
        self.assertEqual(master.federation_sender_instances, ["federation_sender1"])
        self.assertEqual(master.caches.cache_invalidator_instances, ["cache_invalidator1"])

    def test_production_overlay(self):
        """workers/production.yaml switches every process to PostgreSQL, Redis replication and the Redis cache tier,
        both Redis connections with the password in var/redis.password."""
        overlay = os.path.join(WORKERS, "production.yaml")
        run_from_operator_directory(self)
        for name in self.PROCESSES:
            config = _workers_config(name, overlay)
            self.assertEqual(config.database.engine, "postgres")
            self.assertIs(config.replication.transport, Transport.REDIS)
            self.assertEqual((config.replication.redis.host, config.replication.redis.port), ("127.0.0.1", 6379))
            self.assertIsNotNone(config.caches.tier)
            self.assertEqual(config.files[-1], overlay)
            self.assertEqual(config.replication.redis.password_file, "var/redis.password")
            self.assertEqual(config.caches.tier.password_file, "var/redis.password")

    def test_production_overlay_needs_the_redis_password(self):
        """Without var/redis.password the production overlay is a config error naming the key and the file."""
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        self.addCleanup(os.chdir, os.getcwd())
        os.chdir(directory)
        with self.assertRaises(ConfigError) as cm:
            _workers_config("master", os.path.join(WORKERS, "production.yaml"))
        self.assertEqual(cm.exception.key, "replication.redis.password_file")
        self.assertIn("cannot read secret file 'var/redis.password'", str(cm.exception))

    def test_paths_under_data_dir(self):
        """Database, audit logs, log files and pidfiles all default to places under data_dir, wherever it is."""
        for data_dir in ("var", os.path.abspath(self.mktemp())):
            for name in self.PROCESSES:
                config = _workers_config(name, overrides={"data_dir": data_dir})
                self.assertEqual(config.data_dir, data_dir)
                paths = {
                    "database": config.database_config().path,
                    "audit": config.audit_dir,
                    "log": config.log_path,
                    "pid": config.pid_path,
                }
                self.assertEqual(paths, {
                    "database": os.path.join(data_dir, "synflow.db"),
                    "audit": os.path.join(data_dir, "audit"),
                    "log": os.path.join(data_dir, "log", f"{name}.log"),
                    "pid": os.path.join(data_dir, "run", f"{name}.pid"),
                })

    def test_explicit_paths_win(self):
        """A path set explicitly is used instead of its data_dir default."""
        config = _workers_config("persister1", overrides={
            "database": {"path": "/srv/db.sqlite"}, "audit": {"dir": "/srv/audit"},
            "log_file": "/srv/p1.log", "pid_file": "/srv/p1.pid"})
        self.assertEqual((config.database_path, config.audit_dir, config.log_path, config.pid_path),
                         ("/srv/db.sqlite", "/srv/audit", "/srv/p1.log", "/srv/p1.pid"))


class OptionalDriverTest(_ConfigFiles):
    def hide(self, module: str) -> None:
        real = importlib.util.find_spec
        self.patch(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))

    def test_postgres_without_psycopg2(self):
        """database.engine: postgres without psycopg2 installed names the key and the extra that installs it."""
        self.hide("psycopg2")
        self.assertConfigError("shared.yaml", "database.engine", "pip install 'synflow[postgres]'",
                               shared=SHARED + "database: {engine: postgres}\n")

    def test_redis_without_txredisapi(self):
        """The Redis transport and the Redis cache tier without txredisapi name the extra that installs it."""
        self.hide("txredisapi")
        self.assertConfigError("own.yaml", "replication.transport", "pip install 'synflow[redis]'",
                               own=MASTER + "replication: {transport: redis}\n")
        self.assertConfigError("own.yaml", "caches.tier", "pip install 'synflow[redis]'",
                               own=MASTER + "caches: {tier: {host: 127.0.0.1, port: 6379}}\n")

    def test_embedded_default_needs_no_driver(self):
        """SQLite and the TCP hub load with neither driver installed."""
        real = importlib.util.find_spec
        self.patch(importlib.util, "find_spec",
                   lambda name, *a: None if name in ("psycopg2", "txredisapi") else real(name, *a))
        self.assertIs(self.load().replication.transport, Transport.TCP)


class LoggingConfigTest(_ConfigFiles):
    def test_logging_section(self):
        """logging: format, rotation and levels load; bad values name their key."""
        config = self.load(own=MASTER + "logging: {format: json, max_bytes: 4096, backups: 3, levels: {synflow.access: WARNING}}\n")
        self.assertEqual(config.logging.format, "json")
        self.assertEqual((config.logging.max_bytes, config.logging.backups), (4096, 3))
        self.assertEqual(config.logging.levels, {"synflow.access": "WARNING"})
        self.assertConfigError("own.yaml", "logging.levels.synflow", "must be DEBUG, INFO, WARNING or ERROR",
                               own=MASTER + "logging: {levels: {synflow: LOUD}}\n")
        self.assertConfigError("own.yaml", "logging.backups", "at least 1", own=MASTER + "logging: {backups: 0}\n")
        self.assertConfigError("own.yaml", "logging.max_bytes", "at least 1024", own=MASTER + "logging: {max_bytes: 10}\n")
        self.assertConfigError("own.yaml", "logging.format", "", own=MASTER + "logging: {format: xml}\n")


class EndpointDescriptionTest(_ConfigFiles):
    def listener(self, endpoint: str) -> str:
        return MASTER + f"listeners: [{{endpoint: '{endpoint}', resources: [client]}}]\n"

    def test_every_server_endpoint_type_accepted(self):
        """tcp6, unix and systemd descriptions load; only the ones with a port take part in port checks."""
        for endpoint, port in (("tcp6:8443:interface=\\:\\:1", 8443), ("unix:/run/synflow/client.sock", None),
                               ("systemd:domain=INET:index=0", None), ("tcp:port=8009", 8009)):
            config = self.load(own=self.listener(endpoint))
            self.assertEqual(config.listener("client").endpoint, endpoint)
            self.assertEqual(listener_port(endpoint), port)

    def test_bad_descriptions_named(self):
        """An unknown type, a TCP type without a port, a bad systemd domain and an ssl key that is not there are refused."""
        for endpoint, fragment in (("foo:8008", "Unknown endpoint type"), ("tcp:interface=127.0.0.1", "no port number"),
                                   ("systemd:domain=IPX:index=0", "domain=INET, INET6 or UNIX"),
                                   ("systemd:domain=INET", "index=N or name=NAME"),
                                   ("ssl:8448:privateKey=/nonexistent/key.pem", "No such file")):
            self.assertConfigError("own.yaml", "listeners[0].endpoint", fragment, own=self.listener(endpoint))
