"""The README's first command -- the main job, ``scripts/demo`` -- runs to completion and finds nothing lost."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from twisted.trial.unittest import TestCase

from tests import services

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class MainJobTest(TestCase):
    timeout = 1200

    def test_main_job_small(self):
        """scripts/demo (smaller traffic, free ports, this virtualenv) reports 0 lost, full federation, cache hits and a clean validator."""
        services.require_java()
        if not os.path.exists(os.path.join(sys.prefix, ".synflow-install-stamp")):
            services.unavailable(
                f"the virtualenv {sys.prefix} was not made by scripts/_venv.sh (scripts/demo would reinstall into it)"
            )
        out = os.path.abspath(self.mktemp())
        # scripts/demo sets up (here: reuses) the virtualenv and runs scripts/demo.py in it.
        result = subprocess.run(
            [os.path.join(ROOT, "scripts", "demo"), "--messages", "300", "--users", "10", "--rooms", "12",
             "--free-ports", "--out", out],
            capture_output=True, text=True, timeout=1100, env=dict(os.environ, SYNFLOW_VENV=sys.prefix),
            cwd=os.path.dirname(out),
        )
        output = result.stdout[-4000:] + result.stderr[-4000:]
        self.assertEqual(result.returncode, 0, output)
        self.assertNotIn("installing synflow", result.stdout)
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
        self.assertTrue(report["ok"])
        self.assertEqual((report["lost"], report["duplicated"], report["order_mismatches"]), (0, 0, 0))
        self.assertEqual(report["sent"], 300)
        self.assertEqual(report["federated_delivered"], report["federated_expected"])
        self.assertGreater(report["federated_expected"], 0)
        self.assertGreater(report["cache_hit_rate"], 0)
        self.assertEqual(report["validator"], {"localhost": 0, "peer.localhost": 0})
        self.assertTrue(os.path.getsize(os.path.join(out, "latency.png")) > 1000)
        with open(os.path.join(out, "report.md")) as f:
            text = f.read()
        self.assertRegex(text, r"\| [\d,]+ events/s \|")
        self.assertRegex(text, r"send -> visible in sync p50 / p95 / p99 \| [\d.]+ / [\d.]+ / [\d.]+ ms \|")
        delivered = re.search(r"\| federation delivered / expected \| (\d+) / (\d+) \|", text)
        self.assertIsNotNone(delivered, text)
        self.assertEqual(delivered.group(1), delivered.group(2))
        hit_rate = re.search(r"\| cache hit rate \(localhost\) \| ([\d.]+)% \((\d+) hits", text)
        self.assertIsNotNone(hit_rate, text)
        self.assertGreater(float(hit_rate.group(1)), 0)
        for server in ("localhost", "peer.localhost"):
            self.assertIn(f"| token validator ({server}) | clean; violations: 0 |", text)
        self.assertIn("**Verdict: OK - nothing lost, no anomalies**", text)
        # Everything was stopped: no process of either deployment is left.
        self.assertEqual(services.processes_of(out), [])

    def test_keep_running_leaves_both_deployments_running(self):
        """--keep-running: both deployments still serve after the report (validators skipped, said so); ctl stops them."""
        out = os.path.abspath(self.mktemp())
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--messages", "40", "--users", "4",
             "--rooms", "4", "--free-ports", "--keep-running", "--out", out],
            capture_output=True, text=True, timeout=600, cwd=os.path.dirname(out),
        )

        def stop() -> None:
            for server in ("localhost", "peer.localhost"):
                subprocess.run([sys.executable, "-m", "synflow.tools.ctl", "stop", "."], cwd=os.path.join(out, server),
                               capture_output=True, timeout=120)

        self.addCleanup(stop)
        self.assertEqual(result.returncode, 0, result.stdout[-4000:] + result.stderr[-4000:])
        self.assertIn("both deployments left running", result.stdout)
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
        self.assertTrue(report["ok"])
        self.assertEqual(report["validator"], {})
        with open(os.path.join(out, "report.md")) as f:
            self.assertIn("| token validators | not run: the deployments were left running", f.read())
        self.assertEqual(len(services.processes_of(out)), 8)  # 5 processes of localhost, 3 of the peer
        stop()
        self.assertEqual(services.processes_of(out), [])
