"""The rule for tests that need a service: skip with a reason, but never under CI.

``tests/services.py`` is what every PostgreSQL, Redis and Spark test calls
first; these tests point it at a port nobody listens on (and stop it from
starting anything) and check both outcomes.
"""

from __future__ import annotations

import os
import socket

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests import services


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class UnavailableServiceTest(SynchronousTestCase):
    def setUp(self) -> None:
        port = _closed_port()
        self.patch(services, "PG_PORT", port)
        self.patch(services, "REDIS_PORT", port)
        self.patch(services, "start_postgres", lambda: None)
        self.patch(services, "start_redis", lambda: None)
        self.patch(services, "_wait_port", lambda host, port, seconds: False)
        self.patch(services.shutil, "which", lambda name: None)
        self.ci = os.environ.get("CI")
        self.addCleanup(self._restore_ci)

    def _restore_ci(self) -> None:
        if self.ci is None:
            os.environ.pop("CI", None)
        else:
            os.environ["CI"] = self.ci

    def test_skips_with_the_reason_outside_ci(self) -> None:
        os.environ["CI"] = "false"
        for require, what in ((services.require_postgres, "PostgreSQL"), (services.require_redis, "Redis"),
                              (services.require_java, "Java")):
            with self.assertRaises(SkipTest) as cm:
                require()
            self.assertIn(what, str(cm.exception))

    def test_fails_under_ci(self) -> None:
        for value in ("true", "1", "TRUE"):
            os.environ["CI"] = value
            for require in (services.require_postgres, services.require_redis, services.require_java):
                with self.assertRaises(AssertionError) as cm:
                    require()
                self.assertIn("CI=true and a required service is unavailable", str(cm.exception))
