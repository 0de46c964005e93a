"""The deployment as an operator runs it: a fresh install, synflowctl, /health and /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import yaml
from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import TestCase

from synflow.tools.deploy import DEFAULT_PORTS, free_port, make_deployment

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROCESSES = ("master", "persister1", "persister2", "federation_sender1", "cache_invalidator1")


class FreshInstallTest(TestCase):
    timeout = 600

    def setUp(self):
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        self.venv = os.path.join(self.dir, "venv")
        subprocess.run([sys.executable, "-m", "venv", self.venv], check=True)
        # A regular (non-editable) install from a copy of the source tree.
        result = subprocess.run(
            [os.path.join(self.venv, "bin", "pip"), "install", "--quiet", ROOT],
            capture_output=True, text=True, timeout=500,
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

        ports = {p: free_port() for p in DEFAULT_PORTS}
        deployment = os.path.join(self.dir, "workers")
        make_deployment(deployment, "localhost", ports)
        ctl = self.bin("synflowctl")
        self.addCleanup(subprocess.run, [ctl, "stop", "."], cwd=deployment, capture_output=True)
        started = subprocess.run([ctl, "start", "."], cwd=deployment, capture_output=True, text=True, timeout=300)
        self.assertEqual(started.returncode, 0, started.stdout + started.stderr)
        for name in PROCESSES:
            self.assertIn(name, started.stdout)

        status = subprocess.run([ctl, "status", "."], cwd=deployment, capture_output=True, text=True, timeout=60)
        self.assertEqual(status.returncode, 0, status.stdout)
        lines = status.stdout.strip().splitlines()
        self.assertEqual(len(lines), 1 + len(PROCESSES))
        for name in PROCESSES:
            row = next(line for line in lines if line.startswith(name))
            self.assertIn("healthy", row)
            self.assertIn("http://127.0.0.1:", row)

        with open(os.path.join(deployment, "shared.yaml")) as f:
            shared = yaml.safe_load(f)
        for name in PROCESSES:
            address = shared["instance_map"][name]
            text = urllib.request.urlopen(f"http://{address['host']}:{address['port']}/metrics", timeout=10).read()
            families = {f.name for f in text_string_to_metric_families(text.decode())}
            for expected in ("synflow_replication_stream_position", "synflow_replication_commands",
                             "synflow_cache_hits", "synflow_federation_pdus_sent", "synflow_http_request_seconds"):
                self.assertTrue(any(f.startswith(expected) for f in families), f"{name} /metrics lacks {expected}")

        stopped = subprocess.run([ctl, "stop", "."], cwd=deployment, capture_output=True, text=True, timeout=120)
        self.assertEqual(stopped.returncode, 0, stopped.stdout)
        leftovers = subprocess.run(["pgrep", "-f", f"--config {deployment}"], capture_output=True, text=True).stdout
        self.assertEqual(leftovers.strip(), "", "a process survived synflowctl stop")
        for name in PROCESSES:
            self.assertFalse(os.path.exists(os.path.join(deployment, "var", "run", f"{name}.pid")))


class EditableInstallTest(TestCase):
    timeout = 600

    def test_editable_install_lists_plugin(self):
        """With ``pip install -e .``, twistd (run outside the source tree) lists the synflow plugin."""
        import json
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
