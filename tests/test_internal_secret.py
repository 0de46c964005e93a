"""The deployment's generated secret: created once, race-free and private; and no secret only on loopback."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import yaml
from twisted.trial.unittest import SynchronousTestCase

from synflow.config import load_config
from synflow.errors import ConfigError
from synflow.shared_secret import MAX_SECRET_CHARS, is_loopback, load_or_create_secret
from tests.cluster import ROOT, TWISTD

#: Processes racing to create one secret file.
RACERS = 8


def _write_config(testcase: SynchronousTestCase, replication: dict, **top: object) -> str:
    directory = os.path.abspath(testcase.mktemp())
    os.makedirs(directory)
    data = {"server_name": "secret.test", "app": "master", "instance_name": "master",
            "data_dir": os.path.join(directory, "var"), "replication": replication,
            "instance_map": {"master": {"host": "127.0.0.1", "port": 9093}}, **top}
    path = os.path.join(directory, "master.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f)
    return path


class SecretFileTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        self.path = os.path.join(self.dir, "var", "replication.secret")

    def test_created_private_once(self):
        """The first call creates a random 0600 secret (and its directory); later calls read the same one."""
        first = load_or_create_secret(self.path)
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o600)
        self.assertGreaterEqual(len(first), 40)
        self.assertEqual(load_or_create_secret(self.path), first)
        self.assertNotEqual(load_or_create_secret(os.path.join(self.dir, "other.secret")), first)
        self.assertEqual(sorted(os.listdir(os.path.dirname(self.path))), ["replication.secret"])

    def test_racing_processes_share_one_secret(self):
        """Processes creating the file at the same moment all end up with one secret, and leave no temporary file."""
        script = (
            "import sys, time\n"
            "from synflow.shared_secret import load_or_create_secret\n"
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"  # start together
            "print(load_or_create_secret(sys.argv[1]))\n"
        )
        start_at = str(time.time() + 1.5)
        racers = [subprocess.Popen([sys.executable, "-c", script, self.path, start_at], stdout=subprocess.PIPE,
                                   text=True, env=dict(os.environ, PYTHONPATH=ROOT)) for _ in range(RACERS)]
        secrets = {racer.communicate(timeout=60)[0].strip() for racer in racers}
        self.assertEqual([r.returncode for r in racers], [0] * RACERS)
        with open(self.path, encoding="utf-8") as f:
            self.assertEqual(secrets, {f.read().strip()})
        self.assertEqual(os.listdir(os.path.dirname(self.path)), ["replication.secret"])

    def test_file_others_can_read_refused(self):
        """A secret file with any group or other permission is refused, saying how to fix it."""
        load_or_create_secret(self.path)
        os.chmod(self.path, 0o644)
        with self.assertRaises(ConfigError) as cm:
            load_or_create_secret(self.path)
        self.assertEqual(cm.exception.key, "replication.secret_path")
        self.assertIn("mode 0644", str(cm.exception))
        self.assertIn("chmod 600", str(cm.exception))

    def test_unusable_contents_refused(self):
        """An empty file, or one holding more than one word or too long a word, is refused; the message shows no secret."""
        os.makedirs(os.path.dirname(self.path))
        for text, reason in (("\n", "is empty"), ("two words\n", "one word"),
                             ("x" * (MAX_SECRET_CHARS + 1), "one word")):
            with open(self.path, "w") as f:
                f.write(text)
            os.chmod(self.path, 0o600)
            with self.assertRaises(ConfigError) as cm:
                load_or_create_secret(self.path)
            self.assertIn(reason, str(cm.exception))
            self.assertNotIn("two words", str(cm.exception))

    def test_loopback_addresses(self):
        """localhost, 127.0.0.0/8 and ::1 are loopback; anything else (0.0.0.0, names, LAN) is not."""
        for host in ("localhost", "127.0.0.1", "127.3.2.1", "::1", "[::1]"):
            self.assertTrue(is_loopback(host), host)
        for host in ("0.0.0.0", "::", "10.0.0.5", "example.com", "localhost.example.com", ""):
            self.assertFalse(is_loopback(host), host)


class ConfigSecretTest(SynchronousTestCase):
    def test_default_is_generated_under_data_dir(self):
        """With no secret configured, the secret is ``<data_dir>/replication.secret``, created on first use."""
        config = load_config([_write_config(self, {})])
        path = os.path.join(config.data_dir, "replication.secret")
        self.assertEqual(config.replication_secret_path, path)
        self.assertFalse(os.path.exists(path))  # loading the config creates nothing
        secret = config.replication_secret()
        with open(path, encoding="utf-8") as f:
            self.assertEqual(f.read().strip(), secret)

    def test_secret_path_and_explicit_secrets(self):
        """``secret_path`` moves the generated file; ``secret`` and ``secret_file`` win over it and create nothing."""
        elsewhere = os.path.abspath(self.mktemp())
        config = load_config([_write_config(self, {"secret_path": elsewhere})])
        self.assertEqual(config.replication_secret_path, elsewhere)
        self.assertEqual(config.replication_secret(), load_or_create_secret(elsewhere))
        given = os.path.abspath(self.mktemp())
        with open(given, "w") as f:
            f.write("from-a-file\n")
        for replication, expected in (({"secret": "inline"}, "inline"), ({"secret_file": given}, "from-a-file")):
            config = load_config([_write_config(self, replication)])
            self.assertEqual(config.replication_secret(), expected)
            self.assertFalse(os.path.exists(config.replication_secret_path))

    def test_unauthenticated_only_on_loopback(self):
        """``allow_unauthenticated`` means no secret, and is a config error once the hub or the internal listener
        is on a non-loopback address (unless a secret is set after all)."""
        config = load_config([_write_config(self, {"allow_unauthenticated": True})])
        self.assertIsNone(config.replication_secret())
        self.assertFalse(os.path.exists(config.replication_secret_path))
        cases = (
            ({"allow_unauthenticated": True, "hub": {"host": "0.0.0.0", "port": 9092}}, {}, "replication.hub.host"),
            ({"allow_unauthenticated": True}, {"instance_map": {"master": {"host": "10.1.2.3", "port": 9093}}},
             "instance_map.master.host"),
        )
        cases += (
            ({"allow_unauthenticated": True},
             {"listeners": [{"endpoint": "tcp:9093", "resources": ["rpc", "health"]}]}, "listeners[0].endpoint"),
        )
        for replication, top, key in cases:
            path = _write_config(self, replication, **top)
            with self.assertRaises(ConfigError) as cm:
                load_config([path])
            self.assertEqual((cm.exception.key, cm.exception.path), (key, path))
            self.assertIn("is not a loopback address", str(cm.exception), key)
            load_config([_write_config(self, {**replication, "secret": "s"}, **top)])  # a secret makes it fine
            load_config([_write_config(self, {**replication, "allow_unauthenticated": False}, **top)])  # the generated one too

    def test_empty_inline_secret_refused(self):
        """An empty ``replication.secret`` is a config error rather than a secret anyone can guess."""
        with self.assertRaises(ConfigError) as cm:
            load_config([_write_config(self, {"secret": " "})])
        self.assertEqual(cm.exception.key, "replication.secret")

    def test_process_refuses_to_start_exposed_without_secret(self):
        """``twistd -n synflow`` with no secret and the hub on 0.0.0.0 exits 78 with one line naming the key."""
        path = _write_config(self, {"allow_unauthenticated": True, "hub": {"host": "0.0.0.0", "port": 9092}})
        result = subprocess.run([TWISTD, "-n", "--pidfile", "", "synflow", "--config", path], capture_output=True,
                                text=True, timeout=60, cwd=os.path.dirname(path), env=dict(os.environ, PYTHONPATH=ROOT))
        self.assertEqual(result.returncode, 78, result.stderr)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertTrue(lines[0].startswith("synflow: configuration error: "), lines[0])
        self.assertIn("replication.hub.host: '0.0.0.0' is not a loopback address", lines[0])

    def test_process_with_unreadable_secret_refuses_to_start(self):
        """A process whose generated secret file others can read exits 78 naming replication.secret_path."""
        path = _write_config(self, {})
        config = load_config([path])
        config.replication_secret()
        os.chmod(config.replication_secret_path, 0o640)
        result = subprocess.run([TWISTD, "-n", "--pidfile", "", "synflow", "--config", path], capture_output=True,
                                text=True, timeout=60, cwd=os.path.dirname(path), env=dict(os.environ, PYTHONPATH=ROOT))
        self.assertEqual(result.returncode, 78, result.stderr)
        self.assertIn("replication.secret_path", result.stderr)
        self.assertIn("chmod 600", result.stderr)
