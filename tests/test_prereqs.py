"""The main job's prerequisite checks: Java and free ports, each missing thing named in one line before any traffic."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from scripts.prereqs import check_java, check_ports, java_major

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


class JavaTest(SynchronousTestCase):
    def test_java_major(self):
        """Both of Java's version spellings are read: 17.0.9 is 17, 1.8.0_392 is 8."""
        self.assertEqual(java_major('openjdk version "17.0.9" 2023-10-17'), 17)
        self.assertEqual(java_major('java version "1.8.0_392"'), 8)
        self.assertEqual(java_major('openjdk version "21" 2023-09-19'), 21)
        self.assertIsNone(java_major("no version here"))

    def test_java_home_pointing_nowhere(self):
        """JAVA_HOME without bin/java gives one line naming Java and the package that brings it."""
        self.patch(os, "environ", dict(os.environ, JAVA_HOME="/nonexistent/java"))
        problems = check_java()
        self.assertEqual(len(problems), 1)
        self.assertIn("Java 17+", problems[0])
        self.assertIn("apt-get install openjdk-17-jre-headless", problems[0])

    def test_demo_stops_before_traffic_without_java(self):
        """scripts/demo.py with no Java stops at once with one line naming Java and starts no process."""
        out = os.path.abspath(self.mktemp())
        empty_path = os.path.abspath(self.mktemp())
        os.makedirs(empty_path)
        env = dict(os.environ, JAVA_HOME="/nonexistent/java", PATH=empty_path)
        result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--free-ports", "--out", out],
                                env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertIn("Java 17+", lines[0])
        self.assertNotIn("starting", result.stdout)
        self.assertFalse(os.path.exists(out))


class PortTest(SynchronousTestCase):
    def test_busy_port_names_its_holder(self):
        """A port some process listens on is reported with that process's pid; a free one is not."""
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen(1)
            port = held.getsockname()[1]
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                free = probe.getsockname()[1]
            problems = check_ports([port, free])
        self.assertEqual(len(problems), 1, problems)
        self.assertIn(f"port {port} on 127.0.0.1 is in use", problems[0])
        self.assertIn(f"pid {os.getpid()}", problems[0])
