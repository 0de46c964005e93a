"""Redis with a password: the right one works, a wrong one stops start-up clearly."""

from __future__ import annotations

import os
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
        self.redis = services.PrivateRedis(self, free_port(), ("--requirepass", "s3cret"))
        self.port = self.redis.port
        self.dir = self.redis.dir
        self.redis.start()
        return wait_until(self.redis.up, 20, "the password-protected redis-server")

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
