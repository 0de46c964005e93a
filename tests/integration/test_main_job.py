"""The README's first command -- the main job -- runs to completion and finds nothing lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from twisted.trial.unittest import TestCase

from tests import services

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class MainJobTest(TestCase):
    timeout = 1200

    def test_main_job_small(self):
        """scripts/demo.py (smaller traffic, free ports) reports 0 lost, full federation and a clean validator."""
        services.require_java()
        out = os.path.abspath(self.mktemp())
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
        result = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--messages", "300", "--users", "10",
             "--rooms", "12", "--free-ports", "--out", out],
            capture_output=True, text=True, timeout=1100, env=env, cwd=ROOT,
        )
        self.assertEqual(result.returncode, 0, result.stdout[-4000:] + result.stderr[-4000:])
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
        self.assertTrue(report["ok"])
        self.assertEqual((report["lost"], report["duplicated"], report["order_mismatches"]), (0, 0, 0))
        self.assertEqual(report["sent"], 300)
        self.assertEqual(report["federated_delivered"], report["federated_expected"])
        self.assertGreater(report["federated_expected"], 0)
        self.assertEqual(report["validator"], {"localhost": 0, "peer.localhost": 0})
        self.assertTrue(os.path.getsize(os.path.join(out, "latency.png")) > 1000)
        with open(os.path.join(out, "report.md")) as f:
            self.assertIn("OK - nothing lost, no anomalies", f.read())
