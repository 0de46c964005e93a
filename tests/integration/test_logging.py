"""The process log under twistd: JSON lines with the promised fields, size rotation with a bounded number of files, levels per logger."""

from __future__ import annotations

import io
import json
import os
import urllib.request

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.http.server import SECRET_QUERY_PARAMS, loggable_uri
from synflow.tools import ctl
from tests.cluster import free_port
from tests.test_ctl import small_deployment


class ProcessLogTest(SynchronousTestCase):
    def start(self, logging_section: str, log_level: str = "INFO") -> ctl.Proc:
        directory = small_deployment(self, {"master": free_port(), "p1": free_port(), "p2": free_port()})
        with open(os.path.join(directory, "master.yaml"), "a") as f:
            f.write(f"log_level: {log_level}\nlogging: {logging_section}\n")
        master = next(p for p in ctl.discover(directory, []) if p.name == "master")
        out = io.StringIO()
        self.addCleanup(ctl.stop, [master], io.StringIO())
        self.assertEqual(ctl.start([master], out), 0, out.getvalue())
        return master

    def hit_health(self, master: ctl.Proc, times: int) -> None:
        assert master.health_url is not None
        for _ in range(times):
            with urllib.request.urlopen(master.health_url + "?access_token=s3cret&x=1", timeout=10) as response:
                self.assertEqual(response.status, 200)

    def test_json_lines(self):
        """With format: json every line of the log is a JSON object with time, level, logger, instance and message."""
        master = self.start("{format: json}")
        self.hit_health(master, 3)
        ctl.stop([master], io.StringIO())
        with open(master.log_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
        self.assertGreater(len(lines), 3)
        records = [json.loads(line) for line in lines]
        for record in records:
            self.assertLessEqual({"time", "level", "logger", "instance", "message"}, set(record), record)
            self.assertEqual(record["instance"], "master")
            self.assertRegex(record["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
            self.assertIn(record["level"], ("debug", "info", "warning", "error", "critical"))
        self.assertTrue(any(r["logger"].startswith("synflow.") and "started" in r["message"] for r in records), records)
        access = [r for r in records if r["logger"] == "synflow.access" and "access_token" in r["message"]]
        self.assertEqual(len(access), 3, records)
        for record in access:
            self.assertEqual(record["level"], "info")
            self.assertRegex(record["message"], r"^GET /health\?access_token=<redacted>&x=1 200 \d+\.\dms -$")
        self.assertNotIn("s3cret", "\n".join(lines))

    def test_rotation_is_bounded(self):
        """A small max_bytes rotates the file and keeps at most `backups` rotated files."""
        master = self.start("{max_bytes: 1024, backups: 2}")
        self.hit_health(master, 100)  # about 8 KB of access log lines
        ctl.stop([master], io.StringIO())
        directory, name = os.path.split(master.log_file)
        rotated = sorted(f for f in os.listdir(directory) if f.startswith(name + "."))
        self.assertEqual(rotated, [name + ".1", name + ".2"])
        for f in rotated:
            self.assertLessEqual(os.path.getsize(os.path.join(directory, f)), 1024 + 4096)  # rotation happens after a write

    def test_levels_per_logger(self):
        """log_level WARNING hides INFO lines except from a logger raised to INFO by logging.levels."""
        master = self.start("{format: json, levels: {synflow.app: INFO}}", "WARNING")
        ctl.stop([master], io.StringIO())
        with open(master.log_file, encoding="utf-8") as f:
            records = [json.loads(line) for line in f.read().splitlines()]
        infos = [r for r in records if r["level"] in ("info", "debug")]
        self.assertTrue(infos, records)
        for r in infos:
            self.assertTrue(r["logger"].startswith("synflow.app"), r)


class LoggableUriTest(SynchronousTestCase):
    def test_secret_query_values_redacted(self):
        """Secret query parameter values are replaced; other parameters and the path stay."""
        self.assertEqual(loggable_uri(b"/sync?since=s1&access_token=abc&TOKEN=x"),
                         "/sync?since=s1&access_token=<redacted>&TOKEN=<redacted>")
        self.assertEqual(loggable_uri(b"/rooms/!a:b/send"), "/rooms/!a:b/send")
        self.assertEqual(loggable_uri(b"/x?password"), "/x?password")

    @given(st.lists(st.tuples(st.sampled_from([b"since", b"access_token", b"Token", b"sig", b"signature", b"x",
                                               b"PASSWORD", b"secretive", b""]),
                              st.sampled_from([b"", b"="]), st.binary(max_size=6).map(lambda v: v.replace(b"&", b""))),
                    max_size=5))
    def test_redaction_as_the_full_scan(self, params):
        """Any query: the result is that of checking every parameter's name (the scan the quick check may skip)."""
        query = b"&".join(name + eq + value for name, eq, value in params)
        uri = b"/sync?" + query
        parts = []
        for part in query.split(b"&"):
            name, eq, _ = part.partition(b"=")
            parts.append(name + b"=<redacted>" if eq and name.lower() in SECRET_QUERY_PARAMS else part)
        self.assertEqual(loggable_uri(uri), (b"/sync?" + b"&".join(parts)).decode("ascii", "backslashreplace"))
