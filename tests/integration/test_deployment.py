"""The deployment as an operator runs it: a fresh install, synflowctl, /health, /metrics and a graceful stop."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request

import yaml
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import ensureDeferred, gatherResults, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.sharding import shard_for
from synflow.tools.client import Client, new_pool
from synflow.tools.deploy import DEFAULT_PORTS, free_port, make_deployment
from tests import services
from tests.cluster import Cluster, sleep, wait_until

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROCESSES = ("master", "persister1", "persister2", "federation_sender1", "cache_invalidator1")


def _without_pythonpath(testcase: TestCase) -> None:
    """Unset PYTHONPATH for the test (trial's workers set it), so a fresh virtualenv sees only what is installed in it."""
    saved = os.environ.pop("PYTHONPATH", None)
    if saved is not None:
        testcase.addCleanup(os.environ.__setitem__, "PYTHONPATH", saved)


class FreshInstallTest(TestCase):
    timeout = 600

    def setUp(self):
        _without_pythonpath(self)
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.venv = os.path.join(self.dir, "venv")
        subprocess.run([sys.executable, "-m", "venv", self.venv], check=True)
        # A regular (non-editable) install from a copy of the source tree.
        result = subprocess.run(
            [os.path.join(self.venv, "bin", "pip"), "install", "--quiet", ROOT],
            capture_output=True, text=True, timeout=500
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])

    def bin(self, name: str) -> str:
        return os.path.join(self.venv, "bin", name)

    def test_install_start_status_metrics_stop(self):
        """After pip install, twistd lists synflow; synflowctl starts all five processes healthy, reports them, serves metrics, and stops them all."""
        help_text = subprocess.run([self.bin("twistd"), "--help"], capture_output=True, text=True, cwd=self.dir).stdout
        self.assertIn("synflow", help_text)
        plugin_help = subprocess.run([self.bin("twistd"), "synflow", "--help"], capture_output=True, text=True,
                                     cwd=self.dir).stdout
        self.assertIn("--config", plugin_help)
        ctl_help = subprocess.run([self.bin("synflowctl"), "--help"], capture_output=True, text=True, cwd=self.dir)
        self.assertEqual(ctl_help.returncode, 0, ctl_help.stderr)
        self.assertIn("prometheus-config", ctl_help.stdout)
        # The validator ships in the distribution; --help needs no PySpark, running says how to get it.
        validate_help = subprocess.run([self.bin("synflow-validate"), "--help"], capture_output=True, text=True,
                                       cwd=self.dir)
        self.assertEqual(validate_help.returncode, 0, validate_help.stderr)
        self.assertIn("--fail-on", validate_help.stdout)
        no_spark = subprocess.run([self.bin("synflow-validate"), "--logs", self.dir, "--out", self.dir],
                                  capture_output=True, text=True, cwd=self.dir)
        self.assertEqual(no_spark.returncode, 3, no_spark.stderr)
        self.assertIn("pip install 'synflow[spark]'", no_spark.stderr)
        self.assertEqual(len(no_spark.stderr.strip().splitlines()), 1, no_spark.stderr)

        ports = {p: free_port() for p in DEFAULT_PORTS}
        deployment = os.path.join(self.dir, "workers")
        make_deployment(deployment, "localhost", ports)
        ctl = self.bin("synflowctl")
        self.addCleanup(subprocess.run, [ctl, "stop", "."], cwd=deployment, capture_output=True)
        started = subprocess.run([ctl, "start", "."], cwd=deployment, capture_output=True, text=True, timeout=300)
        self.assertEqual(started.returncode, 0, started.stdout + started.stderr)
        for name in PROCESSES:
            self.assertIn(name, started.stdout)

        pids = self.check_status(ctl, deployment, ports)

        restarted = subprocess.run([ctl, "restart", "."], cwd=deployment, capture_output=True, text=True, timeout=300)
        self.assertEqual(restarted.returncode, 0, restarted.stdout + restarted.stderr)
        order = [line.split()[0] for line in restarted.stdout.splitlines() if line.startswith("  ")]
        self.assertEqual(order[:5], ["persister2", "persister1", "federation_sender1", "cache_invalidator1", "master"])
        self.assertEqual(order[5:], order[:5][::-1])
        new_pids = self.check_status(ctl, deployment, ports)
        self.assertFalse(set(pids.values()) & set(new_pids.values()), "restart kept a process")

        with open(os.path.join(deployment, "shared.yaml")) as f:
            shared = yaml.safe_load(f)
        for name in PROCESSES:
            address = shared["instance_map"][name]
            text = urllib.request.urlopen(f"http://{address['host']}:{address['port']}/metrics", timeout=10).read()
            families = {f.name for f in text_string_to_metric_families(text.decode())}
            for expected in ("synflow_replication_stream_position", "synflow_replication_commands",
                             "synflow_cache_hits", "synflow_federation_pdus_sent", "synflow_http_request_seconds"):
                self.assertTrue(any(f.startswith(expected) for f in families), f"{name} /metrics lacks {expected}")

        self.assertEqual(len(services.processes_of(deployment)), len(PROCESSES))
        stopped = subprocess.run([ctl, "stop", "."], cwd=deployment, capture_output=True, text=True, timeout=120)
        self.assertEqual(stopped.returncode, 0, stopped.stdout)
        self.assertEqual(services.processes_of(deployment), [], "a process survived synflowctl stop")
        for name in PROCESSES:
            self.assertFalse(os.path.exists(os.path.join(deployment, "var", "run", f"{name}.pid")))


    def check_status(self, ctl: str, deployment: str, ports: dict[int, int]) -> dict[str, str]:
        """Run ``synflowctl status``; check every row is healthy with its /metrics URL and positions; return the pids."""
        status = subprocess.run([ctl, "status", "."], cwd=deployment, capture_output=True, text=True, timeout=60)
        self.assertEqual(status.returncode, 0, status.stdout)
        lines = status.stdout.strip().splitlines()
        self.assertEqual(lines[0].split(), ["instance", "app", "pid", "health", "metrics", "positions"])
        self.assertEqual(len(lines), 1 + len(PROCESSES))
        metrics_ports = dict(zip(PROCESSES, (9101, 9102, 9103, 9104, 9105), strict=True))
        pids = {}
        for name in PROCESSES:
            row = next(line for line in lines if line.startswith(name + " "))
            cells = row.split(None, 5)
            self.assertEqual(cells[3], "healthy", row)
            self.assertEqual(cells[4], f"http://127.0.0.1:{ports[metrics_ports[name]]}/metrics")
            positions = dict(part.split(": ", 1) for part in cells[5].split("; "))
            self.assertIn("events", positions, row)
            self.assertIn("persister1=", positions["events"])
            self.assertIn("persister2=", positions["events"])
            self.assertIn("caches", positions, row)
            pids[name] = cells[2]
        return pids


class EditableInstallTest(TestCase):
    timeout = 600

    def test_editable_install_lists_plugin(self):
        """With ``pip install -e .``, twistd (run outside the source tree) lists the synflow plugin."""
        import json

        _without_pythonpath(self)
        from importlib.metadata import distribution

        direct_url = distribution("synflow").read_text("direct_url.json")
        editable = bool(direct_url) and json.loads(direct_url).get("dir_info", {}).get("editable", False)
        bindir = os.path.dirname(sys.executable)
        if not editable:
            # This suite runs from a regular install: make an editable one to check.
            venv = os.path.abspath(self.mktemp())
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
            bindir = os.path.join(venv, "bin")
            result = subprocess.run([os.path.join(bindir, "pip"), "install", "--quiet", "-e", ROOT],
                                    capture_output=True, text=True, timeout=500)
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        elsewhere = os.path.abspath(self.mktemp())
        os.makedirs(elsewhere)
        help_text = subprocess.run([os.path.join(bindir, "twistd"), "--help"], capture_output=True, text=True,
                                   cwd=elsewhere, timeout=120).stdout
        self.assertIn("synflow", help_text)


class GracefulStopTest(TestCase):
    timeout = 300

    @inlineCallbacks
    def test_sigterm_persister_under_load(self):
        """SIGTERM to a persister under load lets its in-flight persists finish, acknowledges nothing unpersisted, and tells the hub why it leaves."""
        writers = ("persister1", "persister2")
        cluster = Cluster(self, writers=writers)
        client_port = free_port()
        yield cluster.start_master(listeners=[{"resources": ["client"],
                                               "endpoint": f"tcp:{client_port}:interface=127.0.0.1"}])
        for name in writers:
            cluster.start_twistd(name, "event_persister")
        for name in writers:
            yield cluster.wait_for_port(cluster.instance_ports[name], name)
        pool = new_pool()
        self.addCleanup(pool.closeCachedConnections)
        # Separate users for each persister's rooms, each sending to its own room.
        senders_of: list[tuple[Client, str, str]] = []  # (user, room, writer)
        for writer in writers:
            for i in range(6):
                user = yield ensureDeferred(Client(f"http://127.0.0.1:{client_port}", pool).register(f"{writer}-{i}"))
                while True:
                    room = yield ensureDeferred(user.create_room())
                    if shard_for(room, list(writers)) == writer:
                        break
                senders_of.append((user, room, writer))

        acked: list[tuple[str, str, float, float]] = []  # (writer, event_id, sent, acknowledged)
        failed: list[tuple[str, float]] = []
        counter = itertools.count()
        state = {"running": True}

        async def sender(user: Client, room: str, writer: str) -> None:
            while state["running"]:
                n = next(counter)
                sent = time.monotonic()
                try:
                    result = await user.send(room, {"body": f"load {n}", "n": n}, f"t{n}")
                except Exception:
                    failed.append((writer, time.monotonic()))
                    await sleep(0.05)
                else:
                    acked.append((writer, result["event_id"], sent, time.monotonic()))

        senders = gatherResults([ensureDeferred(sender(user, room, writer)) for user, room, writer in senders_of])
        yield wait_until(lambda: sum(1 for a in acked if a[0] == "persister1") >= 200, 60, "load on persister1")
        # Hold the database's write lock so that persister1 has persists in
        # flight (begun, not committed) when the SIGTERM arrives: they must
        # still commit and be acknowledged once the lock goes.
        lock = sqlite3.connect(cluster.shared["database"]["path"], timeout=30, isolation_level=None)
        self.addCleanup(lock.close)
        lock.execute("BEGIN IMMEDIATE")
        yield sleep(0.5)
        terminated_at = time.monotonic()
        cluster.signal("persister1", signal.SIGTERM)
        yield sleep(0.5)
        lock.execute("COMMIT")
        proc = cluster.procs["persister1"]
        yield wait_until(lambda: proc.poll() is not None, 60, "persister1 to exit")
        exited_at = time.monotonic()
        yield sleep(1.0)  # persister2 keeps serving while persister1 is gone
        state["running"] = False
        yield senders

        # twistd re-raises the signal that stopped it once the shutdown is done.
        self.assertEqual(proc.returncode, -signal.SIGTERM, cluster.log_tail("persister1"))
        with open(cluster.log_path("persister1"), encoding="utf-8", errors="replace") as f:
            log = f.read()
        self.assertIn("Server Shut Down.", log)
        self.assertNotIn("Traceback", log)
        # Sends in flight at the SIGTERM were persisted and acknowledged; later ones were refused.
        in_flight = [a for a in acked if a[0] == "persister1" and a[2] < terminated_at < a[3]]
        self.assertTrue(in_flight, "no send to persister1 in flight at the SIGTERM was acknowledged")
        self.assertFalse([a for a in acked if a[0] == "persister1" and a[2] > exited_at])
        self.assertTrue(any(w == "persister1" for w, _ in failed), "no send to persister1 failed")
        self.assertTrue(any(a[0] == "persister2" and a[3] > exited_at for a in acked), "persister2 stopped serving")
        # No client was told "sent" for an event that was not persisted.
        stored = {row[0] for row in cluster.query("SELECT event_id FROM events WHERE type = 'm.room.message'")}
        missing = [a[1] for a in acked if a[1] not in stored]
        self.assertEqual(missing, [], f"{len(missing)} of {len(acked)} acknowledged events are not in the database")
        # The worker closed its replication connection with a reason, and the hub logged it.
        with open(cluster.log_path("master"), encoding="utf-8", errors="replace") as f:
            reasons = [line for line in f if "sent ERROR: worker shutting down" in line]
        self.assertTrue(any("replication connection to persister1" in line for line in reasons), reasons)
