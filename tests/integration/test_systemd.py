"""contrib/systemd: the unit's command line under a stand-in NOTIFY_SOCKET reports READY=1 once /health answers 200, and stops on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
import uuid

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow.app.systemd import POLL_INTERVAL_S, SystemdNotifier
from synflow.tools import ctl
from tests.cluster import free_port
from tests.test_ctl import small_deployment

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
UNIT = os.path.join(ROOT, "contrib", "systemd", "synflow@.service")


def unit_settings(path: str) -> dict[str, str]:
    """The ``Key=value`` lines of a unit file (later ones win), comments and sections skipped."""
    settings = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", ";", "[")):
                key, _, value = line.partition("=")
                settings[key] = value
    return settings


def notify_socket(testcase: SynchronousTestCase, abstract: bool = False) -> tuple[socket.socket, str]:
    """A bound datagram socket standing in for systemd's, and its NOTIFY_SOCKET value."""
    name = f"synflow-test-{uuid.uuid4().hex[:12]}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    testcase.addCleanup(sock.close)
    if abstract:
        sock.bind("\0" + name)
        return sock, "@" + name
    directory = tempfile.mkdtemp(prefix="sd-")
    testcase.addCleanup(shutil.rmtree, directory, True)
    path = os.path.join(directory, "notify")
    sock.bind(path)
    return sock, path


class NotifierTest(SynchronousTestCase):
    def test_ready_only_once_healthy(self):
        """READY=1 is sent at the first poll with no health problem, not before, and STOPPING=1 on stop."""
        sock, path = notify_socket(self)
        sock.settimeout(0)
        problems = ["starting"]
        clock = Clock()
        notifier = SystemdNotifier(lambda: list(problems), clock, path)
        notifier.startService()
        clock.advance(POLL_INTERVAL_S * 3)
        with self.assertRaises(BlockingIOError):
            sock.recv(1024)
        problems.clear()
        clock.advance(POLL_INTERVAL_S)
        message = sock.recv(1024).decode()
        self.assertIn("READY=1", message.splitlines())
        self.assertIn(f"MAINPID={os.getpid()}", message.splitlines())
        self.assertTrue(notifier.ready)
        clock.advance(POLL_INTERVAL_S * 5)
        with self.assertRaises(BlockingIOError):
            sock.recv(1024)  # ready is said once
        notifier.stopService()
        self.assertIn("STOPPING=1", sock.recv(1024).decode().splitlines())

    def test_without_notify_socket_does_nothing(self):
        """Without NOTIFY_SOCKET the notifier schedules nothing."""
        clock = Clock()
        notifier = SystemdNotifier(lambda: [], clock, None)
        notifier.startService()
        self.assertEqual(clock.getDelayedCalls(), [])
        notifier.stopService()
        self.assertFalse(notifier.ready)


class UnitCommandTest(SynchronousTestCase):
    def test_unit_command_line_notifies_and_stops(self):
        """synflow@.service's ExecStart, pointed at a test deployment, sends READY=1 when /health is 200 and stops cleanly on SIGTERM."""
        settings = unit_settings(UNIT)
        self.assertEqual(settings["Type"], "notify")
        self.assertEqual(settings["KillSignal"], "SIGTERM")
        ports = {"master": free_port(), "p1": free_port(), "p2": free_port()}
        directory = small_deployment(self, ports)
        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        command = (settings["ExecStart"].replace("/opt/synflow/bin/twistd", twistd)
                   .replace("/etc/synflow", directory).replace("%i", "master")).split()
        self.assertIn("--nodaemon", command)
        sock, path = notify_socket(self, abstract=True)
        sock.settimeout(90)
        workdir = os.path.join(directory, "work")
        os.makedirs(workdir)
        log = open(os.path.join(directory, "master.out"), "w")
        self.addCleanup(log.close)
        proc = subprocess.Popen(command, cwd=workdir, env=dict(os.environ, NOTIFY_SOCKET=path),
                                stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        message = sock.recv(1024).decode()
        self.assertIn("READY=1", message.splitlines())
        self.assertIn(f"MAINPID={proc.pid}", message.splitlines())
        procs = {p.name: p for p in ctl.discover(directory, [])}
        url = procs["master"].health_url
        assert url is not None
        with urllib.request.urlopen(url, timeout=10) as response:
            self.assertEqual(response.status, 200)
        proc.send_signal(signal.SIGTERM)
        self.assertIn("STOPPING=1", sock.recv(1024).decode().splitlines())
        # twistd stops the reactor gracefully, then re-raises SIGTERM so the exit status names it;
        # systemd counts death by SIGTERM as a clean stop (like exit 0).
        self.assertEqual(proc.wait(timeout=60), -signal.SIGTERM)
        self.assertFalse(os.path.exists(os.path.join(workdir, "twistd.pid")))
