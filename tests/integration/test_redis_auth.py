"""Redis with a password: the right one works, a wrong one stops start-up clearly."""

from __future__ import annotations

import os
import shutil
import subprocess

from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.app.base import ProcessService
from synflow.config import load_config
from synflow.replication.redis import RedisStartupError
from tests import services
from tests.cluster import TWISTD, free_port, wait_until


class RedisPasswordTest(TestCase):
    timeout = 120

    def setUp(self):
        services.require_redis()
        if not shutil.which("redis-server"):
            services.unavailable("redis-server is not installed, so no password-protected Redis can be started")
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.port = free_port()
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", "s3cret",
             "--save", "", "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.addCleanup(self._stop_redis)
        return wait_until(self._redis_up, 20, "the password-protected redis-server")

    def _stop_redis(self):
        self.redis.terminate()
        self.redis.wait(10)

    def _redis_up(self):
        import socket

        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def _config(self, password):
        path = os.path.join(self.dir, f"master-{password}.yaml")
        with open(path, "w") as f:
            f.write(
                f"server_name: auth.test\napp: master\ninstance_name: master\ndata_dir: {self.dir}/var-{password}\n"
                f"audit: {{enabled: false}}\n"
                f"replication: {{transport: redis, redis: {{host: 127.0.0.1, port: {self.port}, "
                f"password: {password}, channel_prefix: {services.redis_prefix()}}}}}\n"
            )
        return path

    @inlineCallbacks
    def test_right_password(self):
        """With the right password the process subscribes and starts."""
        proc = ProcessService(load_config([self._config("s3cret")]), reactor, exit_on_failure=False)
        proc.startService()
        self.addCleanup(proc.stopService)
        yield proc.ready
        self.assertTrue(proc.replication.transport.connected)

    @inlineCallbacks
    def test_wrong_password(self):
        """With a wrong password start-up fails with a message naming the password setting."""
        proc = ProcessService(load_config([self._config("wrong")]), reactor, exit_on_failure=False)
        proc.startService()
        self.addCleanup(proc.stopService)
        failure = yield self.assertFailure(proc.ready, RedisStartupError)
        self.assertIn("replication.redis.password", str(failure))
        self.assertIn(f"127.0.0.1:{self.port}", str(failure))

    def test_wrong_password_stops_twistd(self):
        """A twistd process given a wrong Redis password exits non-zero with one clear line."""
        result = subprocess.run(
            [TWISTD, "-n", "--pidfile", "", "--logfile", os.path.join(self.dir, "twistd.log"),
             "synflow", "--config", self._config("wrong")],
            capture_output=True, text=True, timeout=60, cwd=self.dir,
        )
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("refused the connection", result.stderr)
        self.assertNotIn("Traceback", result.stderr)
